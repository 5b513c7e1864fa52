"""gptlib's command line as on a Colab T4, run on a bigger GPU (the GPU check's T4 path: gpu_check.sh part 1).

    python benchmarks/t4_emulate.py train --data DIR --run-dir DIR --preset gpt2-small [ARGS...]

A T4 has 15,828,320,256 bytes (14.7 GiB) of memory, no bf16 and no flash attention (SDPA gives it the
memory-efficient kernel). Here this process may allocate no more than that (torch.cuda.set_per_process_memory_fraction),
flash attention is off, and gptlib sees a GPU without native bf16 (dtype auto: float16 + GradScaler) and with a T4's
memory (check_fits, the auto micro-batch probe). The kernels are the bigger GPU's: its speed is not a T4's. At exit
it prints the peak GPU memory allocated ("t4: peak ...").
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's gptlib

from gptlib import runtime  # noqa: E402
from gptlib.__main__ import main  # noqa: E402
from gptlib.training import memory  # noqa: E402

T4_MEMORY = 15_828_320_256  # torch.cuda.get_device_properties(0).total_memory on a Tesla T4


def emulate_t4() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(T4_MEMORY / total)
    torch.backends.cuda.enable_flash_sdp(False)
    runtime.native_bf16 = lambda device: False  # compute capability 7.5
    memory.device_memory = lambda device: T4_MEMORY


if __name__ == "__main__":
    emulate_t4()
    try:
        status = main(sys.argv[1:])
    finally:
        print(
            f"t4: peak GPU memory allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB of "
            f"{T4_MEMORY / 2**30:.2f} GiB"
        )
    sys.exit(status)
