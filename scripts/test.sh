#!/usr/bin/env bash
# Set up ./.venv (if needed) and run the whole test suite on CPU. Extra arguments go to pytest.
# Two worker processes (pytest-xdist), a test file to each at a time so that a file's fixtures are built once:
# many tests wait on subprocesses, notebook kernels and timers, so two workers nearly halve the time on two
# cores. `bash scripts/test.sh -n 0` runs in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The code as ruff lays it out (100 columns) and its lint (pyflakes, pycodestyle, isort, bugbear): pyproject.toml.
# `.venv/bin/ruff format gptlib tests benchmarks` and `.venv/bin/ruff check --fix ...` make it so.
.venv/bin/ruff format --check -q gptlib tests benchmarks || { echo "ruff format: the files above are not laid out"; exit 1; }
.venv/bin/ruff check -q gptlib tests benchmarks
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
