"""gptlib: train GPT-style language models from scratch, on a laptop CPU or a Colab GPU.

Importing gptlib has no side effects: no Drive mounts, no seeds, no prints.
"""

__version__ = "0.1.0"

from gptlib.config import ModelConfig, RunConfig, TrainConfig, get_preset  # noqa: F401


def __getattr__(name):  # PEP 562: `gptlib.GPT` imports torch only when used (tokenize never needs torch)
    if name == "GPT":
        from gptlib.model import GPT

        return GPT
    raise AttributeError(f"module 'gptlib' has no attribute {name!r}")
