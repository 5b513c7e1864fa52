#!/usr/bin/env bash
# The tests at gptlib's declared torch floor: a venv with the oldest torch pyproject.toml admits
# (TORCH_FLOOR below, the 2.5 series: torch.OutOfMemoryError arrived in 2.5), gptlib and its test extras
# installed beside it, then the tests of what the torch version changes. Run by .ci/run after the Colab env
# (~2.5 min with the wheels cached); also on its own:
#
#   bash scripts/torch_floor_env.sh                         # the subset below
#   GPTLIB_FLOOR_TESTS=all bash scripts/torch_floor_env.sh  # every test (all passed at 2.5.1: ci/torch-floor-2.5.1.txt)
#
# PyPI has no CPU-only build of torch 2.5.1: its wheel is the CUDA 12.4 build (~2.5 GB with its nvidia-*
# wheels), which runs on the CPU. The wheels are kept in $GPTLIB_FLOOR_CACHE (default
# ~/.cache/gptlib-floor), so a second run on the same machine installs without the network.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_FLOOR=2.5.1  # keep in step with "torch>=2.5" in pyproject.toml
VENV=.venv-floor  # git-ignored; rebuilt on every run
WH="${GPTLIB_FLOOR_CACHE:-$HOME/.cache/gptlib-floor}/wheels"
# The torch calls gptlib makes: the model (SDPA, KV cache, RMSNorm under autocast), training (autocast, GradScaler, compile, OOM), the
# checkpoint format and exact resume (RNG states, weights_only loading), decoding (compiled step), runtime, the
# benchmarks' train step, and export. ~1 min of tests; the rest of the suite is gptlib's own logic over them, and so
# are two tests of these files left out for time (--deselect; ~16 s, most of it sleeping): the progress figures'
# arithmetic around a validation made slow by a 2 s sleep, and the Colab-units rate in metrics.jsonl over two
# 3-second runs. The files slowest first (seconds of tests here, 2026-11-30: resume 54, train 34, bench 23, runtime
# 16, the rest under 10): the two workers take them in this order (--no-loadscope-reorder below), where
# pytest-xdist's own order, most tests first, left test_resume.py for the end.
SUBSET="tests/test_resume.py tests/test_train.py tests/test_bench.py tests/test_runtime.py tests/test_checkpoint.py
tests/test_generate.py tests/test_model.py tests/test_export.py
--deselect tests/test_train.py::test_validation_time_is_left_out_of_the_bars_tokens_per_s_but_not_the_eta
--deselect tests/test_runtime.py::test_the_metrics_take_the_users_colab_rate"
TESTS="${GPTLIB_FLOOR_TESTS:-$SUBSET}"
[ "$TESTS" = all ] && TESTS=tests
t_start=$SECONDS
say() { printf '[torch-floor %3ds] %s\n' "$((SECONDS - t_start))" "$*"; }

mkdir -p "$WH"
install_floor() {
    if ! "$VPY" -m pip install -q --no-index --find-links "$WH" "torch==$TORCH_FLOOR" 2>/dev/null; then
        say "downloading torch $TORCH_FLOOR and its wheels into $WH (first run on this machine)"
        "$VPY" -m pip download -q --only-binary=:all: -d "$WH" "torch==$TORCH_FLOOR"
        "$VPY" -m pip install -q --no-index --find-links "$WH" "torch==$TORCH_FLOOR"
    fi
    # gptlib as a user on an older torch installs it: the torch there satisfies the range and stays.
    # transformers 5 needs torch >= 2.6 (it disables itself on 2.5), so this env takes the 4.x series, as such a
    # user's would; transformers is a test-only dependency of gptlib (the export/import checks).
    "$VPY" -m pip install -q -e ".[test]" "transformers<5"
}
build_floor_cached() { install_floor; "$VPY" -m pip uninstall -q -y gptlib; }
if [ -n "${GPTLIB_VENV_CACHE:-}" ]; then
    # .ci/run: a hard-linked copy of this venv built once per week and per pyproject.toml's requirements
    # (scripts/venv_cache.sh), gptlib installed into it from this clone
    . scripts/venv_cache.sh
    key="$(venv_key "$("${PYTHON:-python3}" -VV)" "$TORCH_FLOOR" transformers-4 \
        "$(sed -n '/^dependencies = \[/,/^test = /p' pyproject.toml)" "$(date +%G-W%V)")"
    venv_from_cache "${PYTHON:-python3}" "$VENV" "${WH%/wheels}" "$key" build_floor_cached
    "$VENV/bin/python" -m pip install -q --no-deps -e .
    "$VENV/bin/python" -m pip check  # gptlib's requirements hold in the copy
else
    rm -rf "$VENV"
    "${PYTHON:-python3}" -m venv "$VENV"
    VPY="$VENV/bin/python" install_floor
fi
VPY="$VENV/bin/python"
have="$("$VPY" -c 'import torch; print(torch.__version__)')"
case "$have" in "$TORCH_FLOOR"*) ;; *) echo "FAIL: torch $have in $VENV, expected $TORCH_FLOOR (gptlib's install replaced it)"; exit 1;; esac
say "$("$VPY" -c 'import sys, torch, numpy, transformers; print(f"python {sys.version.split()[0]}, torch {torch.__version__}, numpy {numpy.__version__}, transformers {transformers.__version__}")')"
say "tests: $(echo $TESTS)"
# shellcheck disable=SC2086  # TESTS is a list of pytest arguments
"$VPY" -m pytest -n 2 --dist loadfile --no-loadscope-reorder -p no:cacheprovider --durations=10 $TESTS && rc=0 || rc=$?
say "done (pytest exit $rc)"
exit "$rc"
