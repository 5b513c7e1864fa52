#!/usr/bin/env bash
# GPU benchmarks (not tests): gpt2-small MFU and the optimization ladder (issue 5), decoding speed (issue 6).
# Run from the repository root with gptlib's requirements installed:  bash benchmarks/gpu_bench.sh
# Raw output (command, device, torch version, date at the top) goes to benchmarks/results/*_<GPU>.txt.
# MFU = (6N + 12*L*d*T) FLOPs/token x tokens/s / the GPU's dense bf16 peak (gptlib/bench.py PEAK_TFLOPS);
# every timed step starts and ends with torch.cuda.synchronize(); the median of the timed steps is reported.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results
mkdir -p "$OUT"
GPU=$(python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'; print(torch.cuda.get_device_name(0).replace(' ', '_'))")

run() {  # run <output file> <command...>: header + raw output, also shown on the terminal
  local file="$OUT/$1"; shift
  {
    echo "\$ $*"
    python -c "from gptlib.bench import machine_info; print(machine_info())"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
    date -u +"%Y-%m-%d %H:%M:%S UTC"
    "$@"
  } 2>&1 | tee "$file"
}

# 1. gpt2-small as the preset trains it: 32,768 vocab, context 1024, bf16 autocast, torch.compile, fused AdamW,
#    flash SDPA, micro-batch 16 x 32 accumulation = 524,288 tokens/step. Synthetic tokens preloaded on the GPU.
run "gpt2_small_mfu_${GPU}.txt" \
  python -m gptlib bench train --preset gpt2-small --device cuda --compile on --set dtype=bfloat16 --steps 20 --warmup 5

# 1b. the same with the largest micro-batch that fits (OOM-safe probe), tokens per step unchanged.
run "gpt2_small_mfu_autobatch_${GPU}.txt" \
  python -m gptlib bench train --preset gpt2-small --device cuda --compile on --set dtype=bfloat16 --steps 20 --warmup 5 \
  --auto-batch

# 2. the optimization ladder at the seed's shape (gpt2-small, 64 x 512 tokens per step as 16 x 4 micro-batches, so
#    the fp32 rungs fit): memmap + per-sample loop
#    (page cache dropped before each batch) -> RAM preload -> vectorised batches -> compile -> bf16 -> flash.
run "ladder_${GPU}.txt" \
  python -m gptlib bench ladder --device cuda --steps 10 --warmup 3

# 3. single-stream decoding of gpt2-small (fp32, batch 1, greedy): gptlib eager, gptlib with the compiled decode step
#    (torch.compile, CUDA graphs; compile time printed, not timed) and transformers' generate on the same weights.
#    Needs `pip install transformers`.
run "generate_${GPU}.txt" \
  python benchmarks/generate_bench.py --device cuda --compile --new-tokens 256 1024 --repeats 3 \
  --nocache-repeats 1 --nocache-tokens 256

# More than one GPU (not run here): the same train entry under torchrun, e.g.
#   torchrun --standalone --nproc_per_node=8 -m gptlib train --data DATA_DIR --preset gpt2-small --run-dir RUN_DIR
