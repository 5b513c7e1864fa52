"""gptlib's command line as on a Colab T4, run on a bigger GPU (the GPU check's T4 path: gpu_check.sh part 2).

    python benchmarks/t4_emulate.py train --data DIR --run-dir DIR --preset gpt2-small [ARGS...]

A T4 has 15,828,320,256 bytes (14.7 GiB) of memory, no bf16 (compute capability 7.5), and of PyTorch's attention
kernels only the memory-efficient one and math: flash and cuDNN attention need 8.0. Here, before gptlib starts:
- the GPU's memory beyond a T4's is taken by a raw allocation of the driver's (cuMemAlloc), outside torch: torch's
  allocator, cuBLAS/cuDNN workspaces, Triton's modules and the CUDA context then share a T4's room, and
  torch.cuda.mem_get_info (where the token data goes) sees it;
- flash and cuDNN attention are turned off, so SDPA takes the memory-efficient kernel, as on a T4;
- gptlib sees a GPU without native bf16 (dtype auto: float16 + GradScaler) and with a T4's memory (check_fits, the
  auto micro-batch probe).
The kernels are the bigger GPU's: its speed is not a T4's. It prints the attention kernel chosen ("t4: attention ...")
and, at exit, the peak GPU memory allocated. Without CUDA (CI) the CUDA calls are skipped and gptlib runs as asked.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's gptlib

from gptlib import runtime  # noqa: E402
from gptlib.__main__ import main  # noqa: E402
from gptlib.training import memory  # noqa: E402

T4_MEMORY = 15_828_320_256  # torch.cuda.get_device_properties(0).total_memory on a Tesla T4


def hold_back(nbytes: int) -> None:
    """nbytes of GPU memory taken by the CUDA driver's own allocator, never freed: invisible to torch's caching
    allocator, counted by cudaMemGetInfo."""
    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    driver = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.c_uint64()
    status = driver.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    if status != 0:
        raise RuntimeError(f"t4: cuMemAlloc_v2 of {nbytes:,} bytes failed (CUresult {status})")


def attention_kernel() -> str:
    """The kernel SDPA picks for gpt2-small's fp16 attention (12 heads x 64, 1,024 tokens, causal)."""
    from torch.nn.attention import SDPBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.empty(1, 12, 1024, 64, device=device, dtype=torch.float16)
    return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name.lower()


def emulate_t4() -> None:
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        hold_back(total - T4_MEMORY)
        free, _ = torch.cuda.mem_get_info()
        print(f"t4: {(total - T4_MEMORY) / 2**30:.1f} GiB held back; {free / 2**30:.1f} GiB free")
    else:
        print(
            "t4: no CUDA GPU here: gptlib runs on this machine as asked (its memory is not a T4's)"
        )
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    runtime.native_bf16 = lambda device: False  # compute capability 7.5
    memory.device_memory = lambda device: T4_MEMORY
    print(f"t4: attention {attention_kernel()}")


if __name__ == "__main__":
    emulate_t4()
    try:
        status = main(sys.argv[1:])
    finally:
        if torch.cuda.is_available():
            peak = torch.cuda.max_memory_allocated()
            print(
                f"t4: peak GPU memory allocated {peak / 2**30:.2f} GiB of {T4_MEMORY / 2**30:.2f} GiB"
            )
    sys.exit(status)
