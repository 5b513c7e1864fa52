#!/usr/bin/env bash
# Create ./.venv and install gptlib with its test extras. Idempotent: a second run only checks.
# torch is pinned to the tested version here (pip's default build: on Linux PyPI's, with CUDA's libraries);
# on Colab this script is never used and Colab's own torch is never reinstalled.
# GPTLIB_VENV_CACHE=1 (set by .ci/run): a missing .venv is a hard-linked copy of one built per week and
# per pyproject.toml's requirements in ~/.cache/gptlib-main (scripts/venv_cache.sh), checked, with gptlib
# installed into it from this clone.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC="${GPTLIB_TORCH_SPEC:-torch==2.13.0}"
PY="${PYTHON:-python3}"
VPY=.venv/bin/python
if [ ! -x .venv/bin/python ] && [ -n "${GPTLIB_VENV_CACHE:-}" ]; then
    . scripts/venv_cache.sh
    build_main() {
        $VPY -m pip install -q --upgrade pip
        $VPY -m pip install -q "$TORCH_SPEC"
        $VPY -m pip install -q -e ".[test]"
        $VPY -m pip uninstall -q -y gptlib
    }
    key="$(venv_key "$("$PY" -VV)" "$TORCH_SPEC" "$(sed -n '/^dependencies = \[/,/^test = /p' pyproject.toml)" \
        "$(date +%G-W%V)")"
    venv_from_cache "$PY" .venv "$HOME/.cache/gptlib-main" "$key" build_main
    $VPY -m pip install -q --no-deps -e .
    $VPY -m pip check  # gptlib's requirements hold in the copy
else
    [ -x .venv/bin/python ] || "$PY" -m venv .venv
    want="${TORCH_SPEC#torch==}"
    have="$($VPY -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
    if [ "$have" != "$want" ]; then
        $VPY -m pip install -q --upgrade pip
        $VPY -m pip install -q "$TORCH_SPEC"
    fi
    # The torch range in pyproject.toml is already satisfied, so this never replaces the pinned torch.
    $VPY -m pip install -q -e ".[test]"
fi
$VPY -c 'import torch, gptlib; print(f"gptlib {gptlib.__version__}, torch {torch.__version__}, python", __import__("sys").version.split()[0])'
