#!/usr/bin/env bash
# Create ./.venv and install gptlib with its test extras. Idempotent: a second run only checks.
# torch is pinned to the tested version here (the CPU build on machines without CUDA); on Colab
# this script is never used and Colab's own torch is never reinstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${GPTLIB_TORCH_SPEC:-torch==2.13.0}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
VPY=.venv/bin/python
want="${TORCH_SPEC#torch==}"
have="$($VPY -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
if [ "$have" != "$want" ]; then
    $VPY -m pip install -q --upgrade pip
    $VPY -m pip install -q "$TORCH_SPEC"
fi
# The torch range in pyproject.toml is already satisfied, so this never replaces the pinned torch.
$VPY -m pip install -q -e ".[test]"
$VPY -c 'import torch, gptlib; print(f"gptlib {gptlib.__version__}, torch {torch.__version__}, python", __import__("sys").version.split()[0])'
