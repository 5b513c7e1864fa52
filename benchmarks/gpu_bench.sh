#!/usr/bin/env bash
# The GPU benchmarks alone (gpt2-small tokens/s and MFU, with auto micro-batch too; the optimization ladder;
# decoding vs transformers; HellaSwag speed): the bench_* steps of benchmarks/gpu_check.sh, which holds their
# commands and time budgets and writes benchmarks/results/gpu_<GPU>_<step>.txt. Arguments go to gpu_check.sh.
exec bash "$(dirname "$0")/gpu_check.sh" --only bench "$@"
