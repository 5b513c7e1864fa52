#!/usr/bin/env bash
# export-gguf checked by a real client: llama-cpp-python (llama.cpp built from its PyPI source) loads the GGUF
# files and tests/test_llama_cpp.py compares it with gptlib (greedy tokens, tokenization, chat). Run by .ci/run
# as its own step; also on its own:
#
#   bash scripts/llama_env.sh
#
# The wheel is built once per machine into $GPTLIB_LLAMA_CACHE (default ~/.cache/gptlib-llama), outside the
# repository, as the Colab env keeps its wheels: the build compiles llama.cpp, ~10-27 min on 2 shared cores, with
# GGML_NATIVE=OFF so the wheel runs on any x86-64 CPU, not only the one that built it. With the wheel cached the
# set-up takes seconds: ./.venv (torch, gptlib, transformers, jinja2) plus llama-cpp-python in .llama-site on
# PYTHONPATH, so the main suite's .venv has no llama_cpp and its run of tests/test_llama_cpp.py is a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
LLAMA_VERSION=0.3.36
CACHE="${GPTLIB_LLAMA_CACHE:-$HOME/.cache/gptlib-llama}"
WHEEL="$CACHE/llama_cpp_python-$LLAMA_VERSION-py3-none-linux_x86_64.whl"
SITE=.llama-site  # git-ignored; refilled on every run
t_start=$SECONDS
say() { printf '[llama.cpp %3ds] %s\n' "$((SECONDS - t_start))" "$*"; }

[ -x .venv/bin/python ] || bash scripts/setup.sh  # .ci/run's main step made it
mkdir -p "$CACHE"
if [ ! -f "$WHEEL" ]; then
    say "building llama-cpp-python $LLAMA_VERSION into $CACHE (first run on this machine, ~10-27 min)"
    CMAKE_ARGS="-DGGML_NATIVE=OFF" .venv/bin/python -m pip wheel -q --no-deps --no-binary llama-cpp-python \
        -w "$CACHE" "llama-cpp-python==$LLAMA_VERSION"
fi
rm -rf "$SITE"
# llama-cpp-python is pure Python over its own libllama.so: it goes into a folder of its own on PYTHONPATH, beside
# .venv's torch and gptlib (a second venv with its own pip costs ~1 min of set-up on these machines)
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$SITE" "$WHEEL"
.venv/bin/python -c 'import diskcache' 2>/dev/null \
    || .venv/bin/python -m pip install -q --disable-pip-version-check --target "$SITE" "diskcache>=5.6.1"
export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
say "$(.venv/bin/python -c 'import llama_cpp, gptlib, torch; print(f"llama-cpp-python {llama_cpp.__version__} from {llama_cpp.__path__[0]}, torch {torch.__version__}, gptlib from {gptlib.__file__}")')"
.venv/bin/python -m pytest -p no:cacheprovider --durations=10 tests/test_llama_cpp.py && rc=0 || rc=$?
say "done (pytest exit $rc)"
exit "$rc"
