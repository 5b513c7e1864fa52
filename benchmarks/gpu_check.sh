#!/usr/bin/env bash
# The GPU check: gptlib's CUDA code on a real GPU, in parts that each fit one 10-minute call on a lent H100 (each part
# at most 360 s of wall time, its set-up included), ordered by what a Colab user meets first. From the repository root:
#
#   bash benchmarks/gpu_check.sh --next           the first part not yet run at this code (gpu_summary.txt says)
#   bash benchmarks/gpu_check.sh --which          which part --next would run, and this code's hash (no GPU needed)
#   bash benchmarks/gpu_check.sh --part N         part N
#   bash benchmarks/gpu_check.sh --list           the parts, their time budgets and their steps
#   bash benchmarks/gpu_check.sh --dry            the plan checked on a CPU (CI runs it): each part's steps collect,
#                                                 its budgets add to <= 360 s, the wheels the GPU image lacks resolve
#   bash benchmarks/gpu_check.sh --download-wheels DIR   those wheels, for Python 3.12 (the lent machine has no network)
#
# Options: --results DIR (default: $OUT where it is set, the folder a lent machine sends back, else benchmarks/results);
# --wheels DIR (default: .whl where it exists): installed into $GPTLIB_GPU_SITE (default /tmp/gptlib-gpu-site), never
# over the machine's own packages; torch is never installed or upgraded.
#
# What a part writes, as it runs (a part cut off at its time limit keeps what it wrote):
#   gpu_<GPU>_part<N>.log   everything the part printed (pytest -v: each test's outcome as it ends)
#   gpu_<GPU>_part<N>.txt   what its tests measured (tests/test_gpu.py's record())
#   gpu_summary.txt         benchmarks/results/gpu_summary.txt (every part run so far) and this run's row: part,
#                           status, seconds, budget, code, commit, GPU, torch, date
# "code" is a hash of what the check runs (gptlib/, tests/, benchmarks/ but its results/, scripts/, notebooks/,
# pyproject.toml): --next passes over the parts with a row of this code, so after a fix every part runs again.
# "commit" is $GPTLIB_COMMIT, else git's HEAD where .git exists (a lent machine gets the tree without .git).
# Commit the files under benchmarks/results/.
#
# A step runs under `timeout` with the KILL signal (SIGINT would be taken by training's graceful stop); pytest dumps
# every thread's stack 15 s before (faulthandler_timeout), so a hang says where it was.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

PART_MAX_S=360
# What the parts need that the lent GPU image lacks (its own packages: /work/.library/device/KINDS.md). Their
# dependencies the image has are left out of the wheels (GPU_IMAGE_HAS); the rest come along.
GPU_NEEDS="ipywidgets nbclient nbformat ipykernel gguf"
GPU_IMAGE_HAS="attrs certifi charset-normalizer filelock fsspec huggingface-hub idna jinja2 markupsafe numpy packaging
pip platformdirs psutil pygments python-dateutil pyyaml regex requests safetensors setuptools six tokenizers torch
tqdm transformers typing-extensions urllib3 wheel"

# --- the parts -------------------------------------------------------------------------------------------------------
# part N "what it runs"; then its steps: step NAME BUDGET_S COMMAND, or tests NAME BUDGET_S TEST... (tests of
# tests/test_gpu.py, in one pytest process: they share its data and compiled runs). Budgets are estimates until a part
# has run on an H100; its row in gpu_summary.txt gives the seconds it took.
P_TITLE=() S_PART=() S_NAME=() S_BUDGET=() S_CMD=() S_DRY=()
part() { P_TITLE[$1]=$2; }
step() {  # step NAME BUDGET COMMAND [DRY_COMMAND]
  S_PART+=("$((${#P_TITLE[@]}))") S_NAME+=("$1") S_BUDGET+=("$2") S_CMD+=("$3") S_DRY+=("${4:-$3 --help}")
}
tests() {  # tests NAME BUDGET TEST...
  local name=$1 budget=$2 ids="" t
  shift 2
  for t in "$@"; do ids+=" tests/test_gpu.py::$t"; done
  local run="\"\$PY\" -m pytest$ids -m gpu -p no:cacheprovider"
  step "$name" "$budget" "$run -v -rA -o faulthandler_timeout=$((budget - 15))" "$run --collect-only -q"
}

part 1 "first contact: gpt2-small at full size as a Colab user first trains it (bf16, compiled, auto micro-batch), its
resume in a new process, the T4 path from the CLI (fp16, no flash attention, 14.7 GiB), sampling and HellaSwag"
step setup 20 setup_deps setup_deps
tests tests 320 test_gpt2_small_trains_compiled_in_bf16 test_gpt2_small_resumes_in_a_fresh_process \
  test_gpt2_small_from_the_cli_on_an_emulated_t4 test_sampling_and_a_hellaswag_batch_on_the_gpu

part 2 "both recipes: checkpoints made on a CPU resumed on the GPU, the modern recipe at full size (MFU) and in fp16
compiled; the auto micro-batch and a forced OOM"
step setup 20 setup_deps setup_deps
tests tests 320 test_a_cpu_made_checkpoint_resumes_on_the_gpu test_the_modern_recipe_at_full_size_compiled_in_bf16 \
  test_the_modern_recipe_trains_compiled_in_fp16 test_auto_micro_batch_picks_a_size_that_trains \
  test_forced_oom_gives_advice_and_the_process_goes_on

part 3 "the notebooks 02-05 headless on the GPU (05: a GPT-2 folder of this machine's transformers imported, a chat
fine-tune)"
step setup 30 setup_deps setup_deps
tests tests 310 test_notebook_on_the_gpu test_notebook_05_imports_gpt2_and_finetunes_a_chat_on_the_gpu \
  test_a_chat_fine_tune_with_its_data_on_the_gpu

part 4 "speed of gpt2-small: training tokens/s and MFU (the preset's micro-batch, then the auto micro-batch's),
HellaSwag scoring"
step setup 20 setup_deps setup_deps
# gpt2-small as the preset trains it (32,768 vocab, context 1024, bf16, compile, fused AdamW, flash SDPA, 16 x 32
# micro-batches = 524,288 tokens/step) on synthetic tokens: tokens/s and MFU; then with the largest micro-batch that fits.
step bench_mfu 120 "\"\$PY\" benchmarks/bench.py train --preset gpt2-small --device cuda --compile on --set dtype=bfloat16 --steps 10 --warmup 3" \
  "\"\$PY\" benchmarks/bench.py train --help"
step bench_mfu_autobatch 110 "\"\$PY\" benchmarks/bench.py train --preset gpt2-small --device cuda --compile on --set dtype=bfloat16 --steps 6 --warmup 2 --auto-batch" \
  "\"\$PY\" benchmarks/bench.py train --help"
# HellaSwag scoring speed: all 10,042 items (synthetic, realistic lengths) with gpt2-small.
step bench_eval 80 "\"\$PY\" benchmarks/eval_bench.py --device cuda --preset gpt2-small --items 10042 --repeats 2"

part 5 "speed: the modern recipe's MFU, the optimization ladder at the original author's shape"
step setup 20 setup_deps setup_deps
# The same with --recipe modern: Muon's Newton-Schulz in each step (0.3% of its FLOPs at this shape).
step bench_mfu_modern 110 "\"\$PY\" benchmarks/bench.py train --preset gpt2-small --recipe modern --device cuda --compile on --set dtype=bfloat16 --steps 10 --warmup 3" \
  "\"\$PY\" benchmarks/bench.py train --help"
# gpt2-small, 64 x 512 tokens per step as 16 x 4, each rung one more speed-up.
step bench_ladder 170 "\"\$PY\" benchmarks/bench.py ladder --device cuda --steps 6 --warmup 2" \
  "\"\$PY\" benchmarks/bench.py ladder --help"

part 6 "exactness: compiled vs eager in bf16, a SIGKILL and resume against run-to-run noise, checkpoint snapshots,
KV-cached decoding, torchrun over NCCL"
step setup 20 setup_deps setup_deps
tests tests 330 test_compiled_and_eager_losses_agree_in_bf16 test_sigkill_then_resume_stays_within_run_to_run_noise \
  test_checkpoint_snapshot_equals_live_weights_on_consecutive_saves \
  test_kv_cached_decoding_on_the_gpu_gives_the_full_forwards_tokens test_torchrun_one_process_on_nccl

part 7 "decoding speed against transformers; the phase1 preset as notebook 02 trains it; a small GPT-2 compiled in
bf16 and fp16"
step setup 20 setup_deps setup_deps
# Decoding (fp32, batch 1, greedy): the KV-cached engine and transformers' generate.
step bench_generate 100 "\"\$PY\" benchmarks/generate_bench.py --device cuda --new-tokens 256 1024 --repeats 2 --nocache-repeats 1 --nocache-tokens 256"
tests tests 220 test_phase1_trains_on_the_gpu test_small_gpt2_bpe_trains_compiled

N_PARTS=$((${#P_TITLE[@]}))
title() { tr '\n' ' ' <<< "${P_TITLE[$1]}" | sed 's/ *$//'; }
part_budget() { local i t=0; for i in "${!S_NAME[@]}"; do [[ ${S_PART[$i]} == "$1" ]] && t=$((t + S_BUDGET[i])); done; echo $t; }

# --- arguments --------------------------------------------------------------------------------------------------------
die() { echo "gpu_check: $*" >&2; exit 2; }
MODE="" PART="" RESULTS="" WHEELS="" SITE=${GPTLIB_GPU_SITE:-/tmp/gptlib-gpu-site}
while [[ $# -gt 0 ]]; do
  case $1 in
    --next) MODE=next; shift ;;
    --which) MODE=which; shift ;;
    --part) [[ ${2:-} =~ ^[0-9]+$ && $2 -ge 1 && $2 -le $N_PARTS ]] || die "--part takes 1 to $N_PARTS"
            MODE=part PART=$2; shift 2 ;;
    --list) MODE=list; shift ;;
    --dry) MODE=dry; shift ;;
    --download-wheels) [[ $# -ge 2 ]] || die "--download-wheels needs a folder"; MODE=wheels RESULTS=$2; shift 2 ;;
    --results) RESULTS=$2; shift 2 ;;
    --wheels) WHEELS=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[[ -n $MODE ]] || die "say what to run: --next, --which, --part N, --list, --dry or --download-wheels DIR (see --help)"

list_parts() {
  local n i
  for ((n = 1; n <= N_PARTS; n++)); do
    printf 'part %d  %3d s  %s\n' "$n" "$(part_budget "$n")" "$(title "$n")"
    for i in "${!S_NAME[@]}"; do
      [[ ${S_PART[$i]} == "$n" ]] && printf '    %-20s %3d s  %s\n' "${S_NAME[$i]}" "${S_BUDGET[$i]}" "${S_CMD[$i]}"
    done
  done
}
[[ $MODE == list ]] && { list_parts; exit 0; }

wheel_reqs() {  # the wheels the image lacks, as pip resolves GPU_NEEDS for CPython 3.12 on Linux x86-64: NAME==VERSION
  local report
  report=$(mktemp)
  python3 -m pip install -q --dry-run --ignore-installed --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 --platform any --target "$(mktemp -d)" --report "$report" $GPU_NEEDS \
    > "$report.log" 2>&1 || { grep -v "^WARNING: Location" "$report.log" >&2; return 1; }
  python3 - "$report" "$GPU_IMAGE_HAS" <<'EOF'
import json, re, sys
has = {re.sub(r"[-_.]+", "-", n).lower() for n in sys.argv[2].split()}
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if re.sub(r"[-_.]+", "-", meta["name"]).lower() not in has:
        print(f"{meta['name']}=={meta['version']}")
EOF
}

if [[ $MODE == wheels ]]; then
  resolved=$(wheel_reqs) || die "pip could not resolve $GPU_NEEDS for Python 3.12"
  mapfile -t reqs <<< "$resolved"
  mkdir -p "$RESULTS"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$RESULTS" "${reqs[@]}" || exit 1
  echo "${#reqs[@]} wheels, $(du -sh "$RESULTS" | cut -f1) in $RESULTS: ${reqs[*]}"
  echo "carry that folder; the check installs it (--wheels $RESULTS; .whl by default)"
  exit 0
fi

# --- the plan, checked on a CPU ---------------------------------------------------------------------------------------
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  for c in .venv/bin/python python3; do command -v "$c" >/dev/null && "$c" -c "import torch" 2>/dev/null && { PY=$c; break; }; done
fi
[[ -n $PY ]] || die "no Python with torch here (run scripts/setup.sh, or set PYTHON)"
export PY PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [[ $MODE == dry ]]; then
  failed=0
  for ((n = 1; n <= N_PARTS; n++)); do
    budget=$(part_budget "$n")
    if ((budget > PART_MAX_S)); then echo "part $n: its budgets add to $budget s, over $PART_MAX_S s"; failed=1; fi
    for i in "${!S_NAME[@]}"; do
      [[ ${S_PART[$i]} == "$n" && ${S_NAME[$i]} != setup ]] || continue
      if out=$(eval "${S_DRY[$i]}" 2>&1); then
        tests=$(grep -oE '^tests/test_gpu.py: [0-9]+' <<< "$out" | grep -oE '[0-9]+$' || true)
        if [[ -n $tests ]]; then what="collects $tests tests"; else what="runs (--help)"; fi
        echo "part $n ($budget s): ${S_NAME[$i]} $what"
      else
        echo "part $n: ${S_NAME[$i]} does not collect: ${S_DRY[$i]}"; tail -20 <<< "$out"; failed=1
      fi
    done
  done
  if reqs=$(wheel_reqs); then echo "wheels the GPU image lacks ($(wc -l <<< "$reqs")): $(tr '\n' ' ' <<< "$reqs")"
  else echo "the wheels for the GPU image do not resolve: $GPU_NEEDS"; failed=1; fi
  exit $failed
fi

# --- which part ------------------------------------------------------------------------------------------------------
RESULTS=${RESULTS:-${OUT:-$REPO/benchmarks/results}}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
SUMMARY=$RESULTS/gpu_summary.txt
[[ -f $SUMMARY ]] || cp "$REPO/benchmarks/results/gpu_summary.txt" "$SUMMARY" 2>/dev/null \
  || printf '%-5s %-9s %7s %6s  %-12s %-9s %s\n' part status seconds budget code commit "GPU, torch, date" > "$SUMMARY"
CODE=$(find gptlib tests benchmarks scripts notebooks pyproject.toml -type f -not -path 'benchmarks/results/*' \
       -not -path 'benchmarks/work/*' -not -path '*/__pycache__/*' -not -name '*.pyc' \
       | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)
COMMIT=${GPTLIB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "-")}
if [[ $MODE == next || $MODE == which ]]; then
  for ((n = 1; n <= N_PARTS; n++)); do
    awk -v n="$n" -v c="$CODE" '$1 == n && $5 == c {found = 1} END {exit !found}' "$SUMMARY" || { PART=$n; break; }
  done
  if [[ -z $PART ]]; then echo "every part has run at code $CODE: see $SUMMARY"; exit 0; fi
  if [[ $MODE == which ]]; then echo "part $PART: the first without a row at code $CODE in $SUMMARY"; exit 0; fi
fi

# --- a part on the GPU ------------------------------------------------------------------------------------------------
# Without a GPU the part still runs (its tests skip, its benches fail): what CI checks of this script.
mapfile -t INFO < <("$PY" -c "
import re, torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA GPU'
print(torch.__version__); print(name); print(re.sub(r'[^A-Za-z0-9._-]+', '_', name).strip('_'))")
TORCH_VERSION=${INFO[0]} DEVICE_NAME=${INFO[1]} TAG=${INFO[2]}

[[ -z $WHEELS && -d .whl ]] && WHEELS=.whl
export PYTHONPATH="$REPO:$SITE${PYTHONPATH#"$REPO"}"
setup_deps() {  # the carried wheels into $SITE (never over the image's packages); then what is still missing
  if [[ -n $WHEELS ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl \
      && echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
  fi
  for m in $GPU_NEEDS; do "$PY" -c "import $m" 2>/dev/null || echo "missing: $m (the tests that need it skip)"; done
  echo "torch $("$PY" -c 'import torch; print(torch.__version__)') is the machine's own"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || true
}
export -f setup_deps
export GPU_NEEDS WHEELS SITE GPTLIB_GPU_RESULTS=$RESULTS GPTLIB_GPU_TAG=$TAG GPTLIB_GPU_PART=part$PART

LOG=$RESULTS/gpu_${TAG}_part$PART.log
{
  echo "GPU check part $PART: $(title "$PART")"
  echo "device: $DEVICE_NAME; torch $TORCH_VERSION; python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
  echo "code $CODE, commit $COMMIT; $(date -u '+%Y-%m-%d %H:%M:%S UTC'); budget $(part_budget "$PART") s"
  echo "command: bash benchmarks/gpu_check.sh --part $PART (results: $RESULTS)"
} | tee "$LOG"
status=ok t_part=$SECONDS
for i in "${!S_NAME[@]}"; do
  [[ ${S_PART[$i]} == "$PART" ]] || continue
  echo -e "\n=== ${S_NAME[$i]} (budget ${S_BUDGET[$i]} s): ${S_CMD[$i]//\"\$PY\"/$PY}" | tee -a "$LOG"
  t0=$SECONDS
  timeout --signal=KILL "${S_BUDGET[$i]}" bash -c "${S_CMD[$i]}" < /dev/null 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  case $rc in 0) s=ok ;; 137) s=TIMEOUT ;; *) s="FAIL(rc=$rc)" ;; esac
  # a test step that passed nothing (all skipped: a missing package) is not a pass
  [[ $s == ok && ${S_CMD[$i]} == *pytest* ]] && ! tail -5 "$LOG" | grep -qE '[0-9]+ passed' && s=SKIPPED
  echo "--- ${S_NAME[$i]}: $s after $((SECONDS - t0)) s (budget ${S_BUDGET[$i]} s)" | tee -a "$LOG"
  [[ $s == ok || $status != ok ]] || status="${S_NAME[$i]}:$s"
done
row=$(printf '%-5s %-9s %7d %6d  %-12s %-9s %s' "$PART" "$status" $((SECONDS - t_part)) "$(part_budget "$PART")" \
      "$CODE" "$COMMIT" "$DEVICE_NAME, torch $TORCH_VERSION, $(date -u '+%Y-%m-%d %H:%M')")
echo "$row" >> "$SUMMARY"
echo -e "\n$row\nresults: $LOG, $RESULTS/gpu_${TAG}_part$PART.txt, $SUMMARY" | tee -a "$LOG"
[[ $status == ok ]]
