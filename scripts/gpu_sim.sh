#!/usr/bin/env bash
# The lent GPU machine's run of the GPU check, simulated on this CPU: part 1 of benchmarks/gpu_check.sh from a copy of
# the tree as that machine gets it, in a Python 3.12 with the image's packages, the carried wheels installed as the
# check's set-up installs them. What a GPU's few minutes would otherwise find first (a missing file, a wheel that does
# not install or import, a test that errors in its set-up) is found here. tests/test_gpu_check.py runs it in CI.
#
#   bash scripts/gpu_sim.sh [PART]        part 1 by default; exit 0 when the part's row says ok
#
# - Python: pyenv's newest 3.12 (the machine's is 3.12.3), else python3.12 on PATH, else exit 3 (nothing to check).
# - The image: a venv of what gptlib and the check use from ci/gpu-image.txt, at its versions where it pins them,
#   torch 2.11.0 from PyPI (the same cu130 build the machine has; it runs on a CPU). Built once per key into
#   ~/.cache/gptlib-gpusim (scripts/venv_cache.sh; ~2.7 GB of wheels kept there, 4.6 GB venv), then hard-linked.
# - The wheels: `gpu_check.sh --prepare` into this checkout's .whl (git-ignored; network when they change), as before a
#   real call; with its commit and code hash.
# - The copy: git's tracked and untracked-not-ignored files and the wheels as .whl, in a folder with no .git and no
#   ../shared beside it; the run's results go to a temporary folder (printed), never into the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${1:-1}
CACHE=${GPTLIB_GPUSIM_CACHE:-$HOME/.cache/gptlib-gpusim}
# what of the image gptlib, the check's part 1 and the carried wheels import (the image's own versions where
# ci/gpu-image.txt pins them): the carried wheels need attrs, requests, pygments, python-dateutil and the rest there
NEEDS="torch numpy tokenizers safetensors huggingface-hub tqdm matplotlib pyarrow fsspec filelock psutil pyyaml
packaging pytest attrs requests pygments python-dateutil typing-extensions"
t_start=$SECONDS
say() { printf '[gpu-sim %3ds] %s\n' "$((SECONDS - t_start))" "$*"; }

PY=""
v="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.* 2>/dev/null | sort -V | tail -1 || true)"
if [ -n "$v" ] && [ -x "$v/bin/python" ]; then PY="$v/bin/python"; elif command -v python3.12 >/dev/null; then PY=python3.12; fi
[ -n "$PY" ] || { echo "gpu_sim: no Python 3.12 here (pyenv or PATH): the GPU machine's Python cannot be simulated"; exit 3; }

WORK=$(mktemp -d /tmp/gptlib-gpusim-XXXXXX)
# what is left is the run's results ($WORK/out)
trap 'rm -rf "$WORK/venv" "$WORK/machine" "$WORK/site"' EXIT
grep -E '^[A-Za-z0-9_.-]+==' ci/gpu-image.txt > "$WORK/constraints.txt"
WH="$CACHE/wheels-cp312"
mkdir -p "$WH"
install_image() {
    # shellcheck disable=SC2086
    if ! "$VPY" -m pip install -q --no-index --find-links "$WH" -c "$WORK/constraints.txt" $NEEDS 2>/dev/null; then
        say "filling $WH from the package index (first run on this machine: ~2.7 GB, a few minutes)"
        # shellcheck disable=SC2086
        "$VPY" -m pip download -q --only-binary=:all: -d "$WH" -c "$WORK/constraints.txt" $NEEDS 2>&1 \
            | { grep -v "^WARNING: Location" || true; }
        # shellcheck disable=SC2086
        "$VPY" -m pip install -q --no-index --find-links "$WH" -c "$WORK/constraints.txt" $NEEDS
    fi
}
. scripts/venv_cache.sh
venv_from_cache "$PY" "$WORK/venv" "$CACHE" "$(venv_key "$("$PY" -VV)" "$NEEDS" "$WORK/constraints.txt")" install_image
VPY="$WORK/venv/bin/python"
say "the image: $("$VPY" -c 'import sys, torch, numpy; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}")')"

# the wheels and .whl/COMMIT, as before a real call
bash benchmarks/gpu_check.sh --prepare > "$WORK/prepare.log" 2>&1 || { cat "$WORK/prepare.log"; exit 1; }
say "the wheels the image lacks: $(tr '\n' ' ' < .whl/REQUIREMENTS)"

# the tree as the GPU machine gets it: tracked and untracked-not-ignored files, the carried wheels; no .git, no ../shared
mkdir -p "$WORK/machine/repo"
git ls-files -z -co --exclude-standard | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
    | xargs -0 cp --parents -t "$WORK/machine/repo"
cp -r .whl "$WORK/machine/repo/.whl"
say "copied $(find "$WORK/machine/repo" -type f | wc -l) files into $WORK/machine/repo"

set +e
(
    cd "$WORK/machine/repo"
    env -u OUT -u GPTLIB_GPU_RESULTS -u GPTLIB_GPU_PART -u GPTLIB_GPU_TAG -u GPTLIB_SHAKESPEARE -u PYTHONPATH \
        -u VIRTUAL_ENV PYTHON="$VPY" GPTLIB_GPU_SITE="$WORK/site" \
        bash benchmarks/gpu_check.sh --part "$PART" --results "$WORK/out"
)
rc=$?
set -e
say "part $PART: exit $rc; results in $WORK/out"
exit "$rc"
