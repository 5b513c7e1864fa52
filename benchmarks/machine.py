"""The machine a benchmark ran on: the first line of its output."""

from __future__ import annotations

import os
import platform

import torch

from gptlib.training.throughput import cpu_name


def machine_info() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return (
        f"torch {torch.__version__}; python {platform.python_version()}; CPU {cpu_name()} ({os.cpu_count()} "
        f"cores); GPU {gpu}"
    )
