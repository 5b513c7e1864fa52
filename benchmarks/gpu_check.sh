#!/usr/bin/env bash
# The GPU check: gptlib's CUDA code on a real GPU, in parts that each fit one call of at most 9 minutes on a lent H100
# or H200 (each part at most 540 s of wall time, its set-up included), ordered by what a Colab user meets first. The
# same tests run on a CPU in CI at a small size (tests/test_gpu.py), and scripts/gpu_sim.sh runs part 1 from a copy of
# the tree as the GPU machine gets it. From the repository root:
#
#   bash benchmarks/gpu_check.sh --prepare        before a call, here: the wheels the GPU image lacks into .whl (once;
#                                                 network), and this checkout's commit and code hash into .whl/COMMIT
#   bash benchmarks/gpu_check.sh --next           there: the first part not yet run at this code on a GPU
#   bash benchmarks/gpu_check.sh --which          which part --next would run, and this code's hash (no GPU needed)
#   bash benchmarks/gpu_check.sh --part N         part N
#   bash benchmarks/gpu_check.sh --list           the parts, their time budgets and their steps
#   bash benchmarks/gpu_check.sh --dry            the plan checked on a CPU (CI runs it): each part's steps collect,
#                                                 its budgets add to <= 540 s, the wheels the GPU image lacks resolve
#   bash benchmarks/gpu_check.sh --download-wheels DIR   those wheels, for Python 3.12 (the lent machine has no network)
#
# Options: --results DIR (default: $OUT where it is set, the folder a lent machine sends back, else a new temporary
# folder: a run never writes into benchmarks/results/ by itself); --wheels DIR (default: .whl where it exists):
# installed into a fresh $GPTLIB_GPU_SITE (default /tmp/gptlib-gpu-site), never over the machine's own packages;
# torch is never installed or upgraded. With --part: --step NAME runs that step alone (e.g. setup, or a failed
# bench again), --budget S gives each step S seconds instead of its own (what a hung step leaves: CI checks it).
#
# What a part writes, as it runs (a part cut off at its time limit keeps what it wrote):
#   gpu_<GPU>_part<N>.log           everything the part printed (pytest -v: each test's name and outcome as it ends)
#   gpu_<GPU>_part<N>.txt           what its tests measured (tests/test_gpu.py's record()), the attention kernel first
#   gpu_<GPU>_part<N>.children.log  the output of the processes its tests start, as it comes
#   gpu_summary.txt                 benchmarks/results/gpu_summary.txt (every part run so far) and this run's row:
#                                   part, status, seconds, budget, code, commit, GPU, torch, date
# "code" is a hash of the files the check runs that travel to the GPU machine (gptlib/, tests/, benchmarks/ but its
# results/, scripts/, notebooks/, ci/, pyproject.toml; git-ignored files never): --next passes over the parts with a
# row of this code run on a GPU, so after a fix every part runs again. "commit" is $GPTLIB_COMMIT, else git's HEAD
# where .git exists, else what --prepare wrote into .whl/COMMIT ("+changes" where the code differs from it).
# Commit the files under benchmarks/results/.
#
# A step runs under `timeout`: at its budget every process of the step gets SIGABRT, on which Python dumps every
# thread's stack (PYTHONFAULTHANDLER) into the log (the tests' children: into the .children.log), then KILL 15 s later.
# The dump reads other threads' frames unlocked, so a thread running Python code at that moment can cut it short:
# the tests' own waits block rather than poll (tests/test_gpu.py's _run). And a second SIGABRT mid-dump kills the
# process at once (faulthandler puts the default action back before it writes): `timeout` signals its own child and
# then its process group, so a step's Python must not be that child (see the trap below).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

PART_MAX_S=540
IMAGE=ci/gpu-image.txt
# What the parts need that the lent GPU image lacks. Their dependencies the image has ($IMAGE) are never carried (a
# carried copy would shadow the image's own); the rest come along.
GPU_NEEDS="ipywidgets anywidget nbclient nbformat ipykernel gguf"
image_names() { grep -vE '^\s*(#|$)' "$REPO/$IMAGE" | sed -E 's/[=<>!~;[ ].*//'; }
# Attention as an A100 runs it (flash). torch 2.11 with cuDNN > 9.15 prefers cuDNN attention on an H100/H200 (the lent
# machine's cu130 build does); Colab's cu128 build may not: each part's .txt names the kernel its runs got.
export TORCH_CUDNN_SDPA_DEPRIORITIZED=1

# --- the parts -------------------------------------------------------------------------------------------------------
# part N "what it runs"; then its steps: step NAME BUDGET_S COMMAND, or tests NAME BUDGET_S TEST... (tests of
# tests/test_gpu.py, in one pytest process: they share its data and compiled runs). Budgets are estimates for an H100
# (docs/benchmarks.md gives each one's parts) until a part has run; its row in gpu_summary.txt gives the seconds.
P_TITLE=() S_PART=() S_NAME=() S_BUDGET=() S_CMD=() S_DRY=() S_IDS=()
part() { P_TITLE[$1]=$2; }
step() {  # step NAME BUDGET COMMAND [DRY_COMMAND]
  S_PART+=("$((${#P_TITLE[@]}))") S_NAME+=("$1") S_BUDGET+=("$2") S_CMD+=("$3") S_DRY+=("${4:-$3 --help}")
}
COLLECT_ARGS="-m gpu -p no:cacheprovider -p no:logging -o addopts="
tests() {  # tests NAME BUDGET TEST...
  local name=$1 budget=$2 ids="" t
  shift 2
  for t in "$@"; do ids+=" tests/test_gpu.py::$t"; done
  local run="\"\$PY\" -m pytest$ids $COLLECT_ARGS"
  step "$name" "$budget" "$run -v -rA" "$run --collect-only -qq"
  S_IDS[${#S_NAME[@]} - 1]=$ids  # --dry collects every part's at once
}

# Set-up: a fresh site of the carried wheels (~5 s), five imports and the requirement check (~10 s).
part 1 "first contact: gpt2-small at full size as a Colab user first trains it (bf16, compiled, auto micro-batch), its
resume in a new process, sampling and HellaSwag"
step setup 40 setup_deps setup_deps
# data 10-20 s; the first run 100-170 s (compile 60-120, probe 10, 20 steps of 524,288 tokens ~25); the resume in a new
# process 45-90 s (import, probe, compile again, 10 steps); sampling and a HellaSwag batch 10-20 s: 165-300 s
tests tests 400 test_gpt2_small_trains_compiled_in_bf16 test_gpt2_small_resumes_in_a_fresh_process \
  test_sampling_and_a_hellaswag_batch_on_the_gpu

part 2 "a Colab T4's path from the CLI: gpt2-small's defaults, compiled, on this GPU made a T4 (15.8 GB, fp16 +
GradScaler, neither flash nor cuDNN attention); a run begun here in bf16 resumed on it (the third day)"
step setup 40 setup_deps setup_deps
# data 10-20 s; the run 100-180 s (the probe at a T4's room, the fp16 compile, 3 steps of 524,288 tokens); the third
# day 90-200 s (a 4 x 256 model at context 1024: 10 steps in bf16 compiled here, its probe and compile 40-70 s; resumed
# in a new process on the "T4": import, its probe's three tries, the fp16 compile 40-70 s, 5 steps): 200-400 s
tests tests 460 test_gpt2_small_from_the_cli_on_an_emulated_t4 test_a_bf16_run_resumes_on_an_emulated_t4_the_third_day

part 3 "both recipes: checkpoints made on a CPU resumed on the GPU, the modern recipe at full size (MFU) and in fp16
compiled; the auto micro-batch and a forced OOM"
step setup 40 setup_deps setup_deps
tests tests 400 test_a_cpu_made_checkpoint_resumes_on_the_gpu test_the_modern_recipe_at_full_size_compiled_in_bf16 \
  test_the_modern_recipe_trains_compiled_in_fp16 test_auto_micro_batch_picks_a_size_that_trains \
  test_forced_oom_gives_advice_and_the_process_goes_on

part 4 "the notebooks 02-05 headless on the GPU (05: a GPT-2 folder of this machine's transformers imported, a chat
fine-tune)"
step setup 40 setup_deps setup_deps
tests tests 360 test_notebook_on_the_gpu test_notebook_05_imports_gpt2_and_finetunes_a_chat_on_the_gpu \
  test_a_chat_fine_tune_with_its_data_on_the_gpu

part 5 "speed of gpt2-small: training tokens/s and MFU (the preset's micro-batch, then the auto micro-batch's),
HellaSwag scoring"
step setup 40 setup_deps setup_deps
# gpt2-small as the preset trains it (32,768 vocab, context 1024, bf16, compile, fused AdamW, flash SDPA, 16 x 32
# micro-batches = 524,288 tokens/step) on synthetic tokens: tokens/s and MFU; then with the largest micro-batch that fits.
step bench_mfu 150 "\"\$PY\" benchmarks/bench.py train --preset gpt2-small --device cuda --compile on --set dtype=bfloat16 --steps 10 --warmup 3" \
  "\"\$PY\" benchmarks/bench.py train --help"
step bench_mfu_autobatch 140 "\"\$PY\" benchmarks/bench.py train --preset gpt2-small --device cuda --compile on --set dtype=bfloat16 --steps 6 --warmup 2 --auto-batch" \
  "\"\$PY\" benchmarks/bench.py train --help"
# HellaSwag scoring speed: all 10,042 items (synthetic, realistic lengths) with gpt2-small.
step bench_eval 100 "\"\$PY\" benchmarks/eval_bench.py --device cuda --preset gpt2-small --items 10042 --repeats 2"

part 6 "speed: the modern recipe's MFU, the optimization ladder at the original author's shape"
step setup 40 setup_deps setup_deps
# The same with --recipe modern: Muon's Newton-Schulz in each step (0.3% of its FLOPs at this shape).
step bench_mfu_modern 140 "\"\$PY\" benchmarks/bench.py train --preset gpt2-small --recipe modern --device cuda --compile on --set dtype=bfloat16 --steps 10 --warmup 3" \
  "\"\$PY\" benchmarks/bench.py train --help"
# gpt2-small, 64 x 512 tokens per step as 16 x 4, each rung one more speed-up.
step bench_ladder 240 "\"\$PY\" benchmarks/bench.py ladder --device cuda --steps 6 --warmup 2" \
  "\"\$PY\" benchmarks/bench.py ladder --help"

part 7 "exactness: compiled vs eager in bf16, a SIGKILL and resume against run-to-run noise, checkpoint snapshots,
KV-cached decoding, torchrun over NCCL"
step setup 40 setup_deps setup_deps
tests tests 400 test_compiled_and_eager_losses_agree_in_bf16 test_sigkill_then_resume_stays_within_run_to_run_noise \
  test_checkpoint_snapshot_equals_live_weights_on_consecutive_saves \
  test_kv_cached_decoding_on_the_gpu_gives_the_full_forwards_tokens test_torchrun_one_process

part 8 "decoding speed against transformers; the phase1 preset as notebook 02 trains it; a small GPT-2 compiled in
bf16 and fp16"
step setup 40 setup_deps setup_deps
# Decoding (fp32, batch 1, greedy): the KV-cached engine and transformers' generate.
step bench_generate 130 "\"\$PY\" benchmarks/generate_bench.py --device cuda --new-tokens 256 1024 --repeats 2 --nocache-repeats 1 --nocache-tokens 256"
tests tests 280 test_phase1_trains_on_the_gpu test_small_gpt2_bpe_trains_compiled

N_PARTS=$((${#P_TITLE[@]}))
title() { tr '\n' ' ' <<< "${P_TITLE[$1]}" | sed 's/ *$//'; }
part_budget() { local i t=0; for i in "${!S_NAME[@]}"; do [[ ${S_PART[$i]} == "$1" ]] && t=$((t + S_BUDGET[i])); done; echo $t; }

# --- arguments --------------------------------------------------------------------------------------------------------
die() { echo "gpu_check: $*" >&2; exit 2; }
MODE="" PART="" RESULTS="" WHEELS="" ONLY="" BUDGET="" SITE=${GPTLIB_GPU_SITE:-/tmp/gptlib-gpu-site}
while [[ $# -gt 0 ]]; do
  case $1 in
    --next) MODE=next; shift ;;
    --which) MODE=which; shift ;;
    --part) [[ ${2:-} =~ ^[0-9]+$ && $2 -ge 1 && $2 -le $N_PARTS ]] || die "--part takes 1 to $N_PARTS"
            MODE=part PART=$2; shift 2 ;;
    --list) MODE=list; shift ;;
    --dry) MODE=dry; shift ;;
    --prepare) MODE=prepare; shift ;;
    --download-wheels) [[ $# -ge 2 ]] || die "--download-wheels needs a folder"; MODE=wheels WHEELS=$2; shift 2 ;;
    --results) [[ $# -ge 2 ]] || die "--results needs a folder"; RESULTS=$2; shift 2 ;;
    --wheels) [[ $# -ge 2 ]] || die "--wheels needs a folder"; WHEELS=$2; shift 2 ;;
    --step) [[ $# -ge 2 ]] || die "--step needs a step's name (see --list)"; ONLY=$2; shift 2 ;;
    --budget) [[ ${2:-} =~ ^[0-9]+$ ]] || die "--budget takes seconds"; BUDGET=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
[[ -n $MODE ]] || die "say what to run: --next, --which, --part N, --list, --dry, --prepare or --download-wheels DIR (see --help)"
[[ -z $ONLY$BUDGET || $MODE == part ]] || die "--step and --budget go with --part N"
if [[ -n $ONLY ]]; then
  found=""
  for i in "${!S_NAME[@]}"; do [[ ${S_PART[$i]} == "$PART" && ${S_NAME[$i]} == "$ONLY" ]] && found=1; done
  [[ -n $found ]] || die "part $PART has no step $ONLY (see --list)"
fi

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

# --- this code: the files that travel to the GPU machine, their hash ------------------------------------------------
HASHED="gptlib tests benchmarks scripts notebooks ci pyproject.toml"
code_files() {  # NUL-separated; git's list where .git is here, else every file but what git ignores there
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    git ls-files -z -co --exclude-standard -- $HASHED | tr '\0' '\n' | grep -v '^benchmarks/results/' \
      | while IFS= read -r f; do [[ -f $f ]] && printf '%s\0' "$f"; done
  else
    # shellcheck disable=SC2086
    find $HASHED -type f -not -path 'benchmarks/results/*' -not -path 'benchmarks/work/*' -not -path '*/__pycache__/*' \
      -not -path '*/.ipynb_checkpoints/*' -not -path '*.egg-info/*' -not -name '*.pyc' -print0 2>/dev/null
  fi
}
code_hash() {
  code_files | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-12
}

# --- the wheels the image lacks ---------------------------------------------------------------------------------------
PIP_312=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
  --platform manylinux1_x86_64 --platform any)
# pip for those wheels: a Python 3.12's (pyenv's or PATH's), whose Requires-Python checks are the machine's; else python3's
# told to pass over them (pip checks a constraint's against the Python it runs in, whatever --python-version says)
pip_312() {
  local v
  v=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.* 2>/dev/null | sort -V | tail -1)
  if [[ -n $v && -x $v/bin/python ]]; then "$v/bin/python" -m pip "$@"
  elif command -v python3.12 >/dev/null; then python3.12 -m pip "$@"
  else python3 -m pip "$@" --ignore-requires-python
  fi
}
wheel_reqs() {  # GPU_NEEDS resolved for CPython 3.12 on Linux x86-64, the image's versions as constraints -> NAME==VERSION
  local report tmp
  tmp=$(mktemp -d)
  report=$tmp/report.json
  grep -E '^[A-Za-z0-9_.-]+==' "$REPO/$IMAGE" > "$tmp/constraints.txt"
  # shellcheck disable=SC2086
  pip_312 install -q --dry-run --ignore-installed "${PIP_312[@]}" --target "$tmp/t" --report "$report" \
    -c "$tmp/constraints.txt" $GPU_NEEDS > "$tmp/log" 2>&1 || { grep -v "^WARNING: Location" "$tmp/log" >&2; return 1; }
  python3 - "$report" <<EOF
import json, re, sys
has = {re.sub(r"[-_.]+", "-", n).lower() for n in """$(image_names)""".split()}
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if re.sub(r"[-_.]+", "-", meta["name"]).lower() not in has:
        print(f"{meta['name']}=={meta['version']}")
EOF
}

download_wheels() {  # download_wheels DIR: the wheels, replacing what DIR held
  local resolved
  resolved=$(wheel_reqs) || die "pip could not resolve $GPU_NEEDS for Python 3.12 with the image's versions ($IMAGE)"
  mapfile -t reqs <<< "$resolved"
  rm -rf "$1" && mkdir -p "$1"
  pip_312 download -q --no-deps "${PIP_312[@]}" -d "$1" "${reqs[@]}" 2>&1 | grep -v "^WARNING: Location" || true
  [[ $(ls "$1"/*.whl 2>/dev/null | wc -l) -eq ${#reqs[@]} ]] || die "pip downloaded $(ls "$1"/*.whl 2>/dev/null | wc -l) of ${#reqs[@]} wheels into $1"
  printf '%s\n' "${reqs[@]}" > "$1/REQUIREMENTS"
  echo "${#reqs[@]} wheels, $(du -sh "$1" | cut -f1) in $1: ${reqs[*]}"
}

if [[ $MODE == wheels ]]; then
  download_wheels "$WHEELS"
  echo "carry that folder; the check installs it (--wheels $WHEELS; .whl by default)"
  exit 0
fi
if [[ $MODE == prepare ]]; then
  # the wheels once (again when the resolution changes), the commit and code hash every time
  want=$(wheel_reqs) || die "pip could not resolve $GPU_NEEDS for Python 3.12 with the image's versions ($IMAGE)"
  if [[ $want != "$(cat .whl/REQUIREMENTS 2>/dev/null)" ]]; then download_wheels .whl; fi
  commit=$(git rev-parse --short HEAD 2>/dev/null) || die "--prepare runs in a git checkout (it records its commit)"
  [[ -z $(git status --porcelain -- $HASHED 2>/dev/null) ]] || commit="$commit+changes"
  printf '%s %s\n' "$commit" "$(code_hash)" > .whl/COMMIT
  echo "prepared .whl: $(ls .whl/*.whl | wc -l) wheels; commit $commit, code $(code_hash)"
  echo "now: bash benchmarks/gpu_check.sh --next, carrying .whl (the device tool's carry: [\".whl\"])"
  exit 0
fi

# --- the plan, checked on a CPU ---------------------------------------------------------------------------------------
PY=${PYTHON:-}
# --which needs no Python (the probe imports torch: seconds)
if [[ -z $PY && $MODE != which ]]; then
  for c in .venv/bin/python python3; do command -v "$c" >/dev/null && "$c" -c "import torch" 2>/dev/null && { PY=$c; break; }; done
fi
[[ -n $PY || $MODE == which ]] || die "no Python with torch here (run scripts/setup.sh, or set PYTHON)"
export PY PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

if [[ $MODE == dry ]]; then
  failed=0
  # Every part's tests in one collection (each pytest process imports torch, gptlib and tests/test_gpu.py: ~4 s),
  # counted per step below; where it fails, each step collects on its own (its dry command), naming the part. A dry
  # command that ran already is not run again (parts 5 and 6 share `bench.py train --help`).
  # shellcheck disable=SC2086
  all_tests=$("$PY" -m pytest $(tr ' ' '\n' <<< "${S_IDS[*]}" | sort -u) $COLLECT_ARGS --collect-only -q 2>&1) \
    || all_tests=""
  declare -A dry_out=() dry_rc=()
  for ((n = 1; n <= N_PARTS; n++)); do
    budget=$(part_budget "$n")
    if ((budget > PART_MAX_S)); then echo "part $n: its budgets add to $budget s, over $PART_MAX_S s"; failed=1; fi
    for i in "${!S_NAME[@]}"; do
      [[ ${S_PART[$i]} == "$n" && ${S_NAME[$i]} != setup ]] || continue
      count=0
      if [[ -n ${S_IDS[$i]:-} && -n $all_tests ]]; then
        count=$(grep -cE "^($(sed 's/^ //; s/ /|/g' <<< "${S_IDS[$i]}"))(\[[^]]*\])?\$" <<< "$all_tests")
      fi
      if ((count > 0)); then
        out="tests/test_gpu.py: $count" rc=0
      elif [[ -n ${dry_rc[${S_DRY[$i]}]:-} ]]; then
        out=${dry_out[${S_DRY[$i]}]} rc=${dry_rc[${S_DRY[$i]}]}
      else
        out=$(eval "${S_DRY[$i]}" 2>&1) && rc=0 || rc=$?
        dry_out[${S_DRY[$i]}]=$out dry_rc[${S_DRY[$i]}]=$rc
      fi
      if ((rc == 0)); then
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
RESULTS=${RESULTS:-${OUT:-$(mktemp -d /tmp/gptlib-gpu-results-XXXXXX)}}
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
SUMMARY=$RESULTS/gpu_summary.txt
[[ -f $SUMMARY ]] || cp "$REPO/benchmarks/results/gpu_summary.txt" "$SUMMARY" 2>/dev/null \
  || printf '%-5s %-9s %7s %6s  %-12s %-9s %s\n' part status seconds budget code commit "GPU, torch, date" > "$SUMMARY"
CODE=$(code_hash)
if [[ -n ${GPTLIB_COMMIT:-} ]]; then COMMIT=$GPTLIB_COMMIT
elif COMMIT=$(git rev-parse --short HEAD 2>/dev/null); then :
elif read -r COMMIT prepared_code < .whl/COMMIT 2>/dev/null; then [[ $prepared_code == "$CODE" ]] || COMMIT="${COMMIT%+changes}+changes"
else COMMIT="-"
fi
if [[ $MODE == next || $MODE == which ]]; then
  for ((n = 1; n <= N_PARTS; n++)); do
    # a row of this code run on a GPU (a CPU's rows say "no CUDA GPU": they never count)
    awk -v n="$n" -v c="$CODE" '$1 == n && $5 == c && !/no CUDA GPU/ {found = 1} END {exit !found}' "$SUMMARY" \
      || { PART=$n; break; }
  done
  if [[ -z $PART ]]; then echo "every part has run on a GPU at code $CODE: see $SUMMARY"; exit 0; fi
  if [[ $MODE == which ]]; then echo "part $PART: the first without a GPU's row at code $CODE in $SUMMARY"; exit 0; fi
fi

# --- a part on the GPU ------------------------------------------------------------------------------------------------
# Without a GPU the part still runs (its tests at a CPU's size, its benches fail): what CI checks of this script.
mapfile -t INFO < <(timeout 120 "$PY" -c "
import re, torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA GPU'
print(torch.__version__); print(name); print(re.sub(r'[^A-Za-z0-9._-]+', '_', name).strip('_'))")
[[ ${#INFO[@]} -eq 3 ]] || die "$PY could not say which GPU this is in 120 s (torch.cuda hung or failed to import)"
TORCH_VERSION=${INFO[0]} DEVICE_NAME=${INFO[1]} TAG=${INFO[2]}

[[ -z $WHEELS && -d .whl ]] && WHEELS=.whl
export PYTHONPATH="$REPO:$SITE${PYTHONPATH#"$REPO"}"
setup_deps() {  # a fresh site of the carried wheels (never over the image's packages); fails on any install or import
  local m failed=0
  rm -rf "$SITE"
  if [[ -n $WHEELS ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl \
      || { echo "setup: pip could not install the wheels of $WHEELS into $SITE"; return 1; }
    echo "installed $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
  fi
  for m in $GPU_NEEDS; do
    "$PY" -c "import $m; print('import $m', getattr($m, '__version__', ''), 'from', $m.__file__)" 2>&1 | tail -1 \
      | sed "/^import $m /!s/^/setup: import $m failed: /" | tee /dev/stderr | grep -q "^setup: " && failed=1
  done
  # every carried package's requirements met by what is here (the image's versions, or another carried wheel)
  "$PY" - "$SITE" <<'EOF' || failed=1
import importlib.metadata as md, sys
from packaging.requirements import Requirement
bad = []
for dist in md.distributions(path=[sys.argv[1]]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(f"{dist.metadata['Name']} needs {req}: not installed")
            continue
        if not req.specifier.contains(have, prereleases=True):
            bad.append(f"{dist.metadata['Name']} needs {req}: {have} here")
for line in bad:
    print(f"setup: {line}")
sys.exit(1 if bad else 0)
EOF
  echo "torch $("$PY" -c 'import torch; print(torch.__version__)') is the machine's own"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null
  return $failed
}
export -f setup_deps
export GPU_NEEDS WHEELS SITE GPTLIB_GPU_RESULTS=$RESULTS GPTLIB_GPU_TAG=$TAG GPTLIB_GPU_PART=part$PART
# a step's kill dumps every Python thread's stack (SIGABRT), no core files
export PYTHONFAULTHANDLER=1

LOG=$RESULTS/gpu_${TAG}_part$PART.log
STEP_OUT=$(mktemp)
{
  echo "GPU check part $PART: $(title "$PART")"
  echo "device: $DEVICE_NAME; torch $TORCH_VERSION; python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
  echo "code $CODE, commit $COMMIT; $(date -u '+%Y-%m-%d %H:%M:%S UTC'); budget $(part_budget "$PART") s"
  echo "command: bash benchmarks/gpu_check.sh --part $PART (results: $RESULTS)"
} | tee "$LOG"
status=ok t_part=$SECONDS
for i in "${!S_NAME[@]}"; do
  [[ ${S_PART[$i]} == "$PART" && ${ONLY:-${S_NAME[$i]}} == "${S_NAME[$i]}" ]] || continue
  budget=${BUDGET:-${S_BUDGET[$i]}}
  echo -e "\n=== ${S_NAME[$i]} (budget $budget s): ${S_CMD[$i]//\"\$PY\"/$PY}" | tee -a "$LOG"
  t0=$SECONDS
  : > "$STEP_OUT"
  # The trap keeps bash from exec-ing the command (bash execs a -c string's last command when nothing is trapped), so
  # bash is the child `timeout` signals twice and the step's Python gets the group's one SIGABRT.
  timeout --signal=ABRT --kill-after=15 "$budget" bash -c "trap 'exit 134' ABRT; ulimit -c 0; ${S_CMD[$i]}" \
    < /dev/null 2>&1 \
    | tee -a "$LOG" "$STEP_OUT"
  rc=${PIPESTATUS[0]}
  case $rc in 0) s=ok ;; 124|137) s=TIMEOUT ;; *) s="FAIL(rc=$rc)" ;; esac
  if [[ $s == ok && ${S_CMD[$i]} == *pytest* ]]; then
    # every test passed: none skipped, errored or failed (pytest's closing line)
    summary=$(grep -E '^=+ .* in [0-9.]+s' "$STEP_OUT" | tail -1)
    if ! [[ $summary =~ [0-9]+\ passed ]] || [[ $summary =~ (skipped|error|failed|xfail|xpass|deselected) ]]; then
      s="NOT_ALL_PASSED"
    fi
  fi
  echo "--- ${S_NAME[$i]}: $s after $((SECONDS - t0)) s (budget $budget s)" | tee -a "$LOG"
  [[ $s == ok || $status != ok ]] || status="${S_NAME[$i]}:$s"
done
rm -f "$STEP_OUT"
# a part run in pieces (--step, --budget) is not the part: its row says so, and --next does not count it
what=$PART
[[ -z $ONLY$BUDGET ]] || what="$PART:${ONLY:-all}${BUDGET:+@${BUDGET}s}"
row=$(printf '%-5s %-9s %7d %6d  %-12s %-9s %s' "$what" "$status" $((SECONDS - t_part)) "$(part_budget "$PART")" \
      "$CODE" "$COMMIT" "$DEVICE_NAME, torch $TORCH_VERSION, $(date -u '+%Y-%m-%d %H:%M')")
echo "$row" >> "$SUMMARY"
echo -e "\n$row\nresults: $LOG, $RESULTS/gpu_${TAG}_part$PART.txt, $RESULTS/gpu_${TAG}_part$PART.children.log, $SUMMARY" \
  | tee -a "$LOG"
[[ $status == ok ]]
