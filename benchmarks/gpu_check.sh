#!/usr/bin/env bash
# GPU acceptance check: the tests marked `gpu` (tests/test_gpu.py), then the GPU benchmarks, in one command run
# from the repository root of a fresh checkout:
#
#   bash benchmarks/gpu_check.sh [--shakespeare PATH] [--only STEP,...] [--wheels DIR] [--results DIR] [--archive FILE]
#   bash benchmarks/gpu_check.sh --list                          the steps, their time budgets and commands
#   GPTLIB_GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh          dry run, no GPU needed (below)
#   bash benchmarks/gpu_check.sh --download-wheels DIR [REQ...]  on a machine with PyPI: wheels for an offline GPU machine
#
# Each step runs under `timeout` (SIGINT at its budget, so pytest prints where it was; SIGKILL 15 s later); a failed
# or timed-out step does not stop the rest, and a table (step, status, seconds, budget) prints at the end. The
# budgets add up to under 27 minutes: the whole check fits one H100 in a 30-minute lease. --only runs some steps (a
# name, or a prefix: `--only test`, `--only bench`); on a machine that caps one command at 10 minutes, run it in four
# parts: --only test_train,test_state,test_memory / --only test_decode,test_notebooks,bench_eval,bench_generate /
# --only bench_mfu / --only bench_ladder. The summary file accumulates over the parts.
#
# Set-up. Python: $PYTHON, else .venv/bin/python, else python3, the first whose torch sees a CUDA GPU; that torch is
# never reinstalled or upgraded (a GPU image's own CUDA build stays: check with
# `python3 -c "import torch; assert torch.cuda.is_available()"`). Only when no Python has a CUDA torch does it run
# scripts/setup.sh (.venv with torch==2.13.0 from PyPI, which is a CUDA build on Linux x86-64). gptlib runs from this
# checkout (PYTHONPATH); the requirements of pyproject.toml (gptlib's and the test extra's, torch excepted) that are
# missing are installed, torch and numpy pinned to the installed versions: from --wheels DIR (offline, pip --no-index;
# into $GPTLIB_GPU_SITE, default /tmp/gptlib-gpu-site, if the environment cannot be written), else from PyPI.
# Offline machines: fetch the wheels elsewhere with --download-wheels DIR (default requirements: ipywidgets nbclient
# nbformat ipykernel, what GPU images often lack; Python version $GPTLIB_WHEELS_PYTHON, default 3.12) and carry DIR.
# Nothing is downloaded by the check itself: Tiny Shakespeare comes from --shakespeare PATH, $GPTLIB_SHAKESPEARE or
# ../shared/data/tinyshakespeare.txt; the HellaSwag speed bench scores synthetic items; HF_HUB_OFFLINE=1 is set.
#
# Output: benchmarks/results/gpu_<GPU>_<step>.txt (raw output of each step, starting with the device, torch version,
# command and date), the tests' own measurements beside them (gpu_<GPU>_resume_noise.txt, ..._compile_vs_eager_bf16.txt,
# ...), and gpu_<GPU>_summary.txt (the table; steps not run this time keep their last row). --archive FILE also packs
# this call's files into one tar.gz.
#
# Dry run (GPTLIB_GPU_CHECK_DRY=1 or --dry): every step's plumbing without a GPU: the requirement check (nothing
# installed), each test group's selection collected (pytest --collect-only), the train, decoding and HellaSwag benches
# on CPU at toy sizes (the ladder and the auto-batch bench: --help), all time-boxed and logged the same way into a
# temporary results folder, plus one step that must time out.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)

DRY=${GPTLIB_GPU_CHECK_DRY:-0}
[[ $DRY == 0 ]] && DRY=""
ONLY="" WHEELS="" RESULTS="" ARCHIVE="" LIST="" SHAKESPEARE=${GPTLIB_SHAKESPEARE:-}
SITE=${GPTLIB_GPU_SITE:-/tmp/gptlib-gpu-site}

# Reads pyproject.toml; prints each requirement (gptlib's and the test extra's, never torch) that is not installed
# or not satisfied, one per line. --all: every requirement; names after it: only those.
REQS_PY='
import re, sys
from importlib import metadata
args = sys.argv[1:]
every = "--all" in args
only = {a.lower() for a in args if a != "--all"}
text = open("pyproject.toml").read()
try:
    import tomllib
    project = tomllib.loads(text)["project"]
    reqs = project["dependencies"] + project.get("optional-dependencies", {}).get("test", [])
except ImportError:  # Python 3.10
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    test = re.search(r"^test = \[(.*?)\]", text, re.M)
    reqs = re.findall(r"\"([^\"]+)\"", block) + (re.findall(r"\"([^\"]+)\"", test.group(1)) if test else [])
try:
    from packaging.requirements import Requirement
except ImportError:
    Requirement = None
for spec in reqs:
    name = re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].strip()
    if name.lower() == "torch" or (only and name.lower() not in only):
        continue
    if every:
        print(spec)
        continue
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        print(spec)
        continue
    if Requirement is not None and not Requirement(spec).specifier.contains(have, prereleases=True):
        print(spec)
'

die() { echo "gpu_check: $*" >&2; exit 2; }

download_wheels() {  # download_wheels DIR [REQ...]
  local dir=$1 py=${PYTHON:-python3} pyver=${GPTLIB_WHEELS_PYTHON:-3.12} reqs
  shift
  if [[ $# -gt 0 ]]; then reqs=("$@"); else mapfile -t reqs < <("$py" -c "$REQS_PY" --all ipywidgets nbclient nbformat ipykernel); fi
  echo "downloading wheels (with their dependencies) for CPython $pyver, Linux x86-64, into $dir: ${reqs[*]}"
  "$py" -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dir" "${reqs[@]}" || exit 1
  echo "$(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1); on the GPU machine: bash benchmarks/gpu_check.sh --wheels $dir"
  exit 0
}

while [[ $# -gt 0 ]]; do
  case $1 in
    --only) ONLY=$2; shift 2 ;;
    --wheels) WHEELS=$(cd "$2" && pwd) || die "--wheels $2: no such folder"; shift 2 ;;
    --results) RESULTS=$2; shift 2 ;;
    --archive) ARCHIVE=$2; shift 2 ;;
    --shakespeare) SHAKESPEARE=$2; shift 2 ;;
    --list) LIST=1; shift ;;
    --dry) DRY=1; shift ;;
    --download-wheels) [[ $# -ge 2 ]] || die "--download-wheels needs a folder"; shift; download_wheels "$@" ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

# --- the steps: name, budget in seconds, command, dry-run command ------------------------------------------------
NAMES=() BUDGETS=() CMDS=() DRYS=()
step() { NAMES+=("$1"); BUDGETS+=("$2"); CMDS+=("$3"); DRYS+=("$4"); }
pytest_step() {  # pytest_step NAME BUDGET -k-EXPRESSION: one group of tests/test_gpu.py
  local base="\"\$PY\" -m pytest tests/test_gpu.py -m gpu -p no:cacheprovider -k '$3'"
  step "$1" "$2" "$base -v -rA -o faulthandler_timeout=$(($2 - 15))" "$base --collect-only"
}
step setup 30 "setup_deps" "setup_deps"
pytest_step test_train 270 "phase1 or bpe or compiled_and_eager or compiled_in_fp16"
pytest_step test_state 170 "snapshot or resume or torchrun"
pytest_step test_memory 155 "auto_micro_batch or oom"
pytest_step test_decode 140 "decoding or temperature or chat_fine_tune"
pytest_step test_notebooks 160 "notebook"
# gpt2-small as the preset trains it (32,768 vocab, context 1024, bf16, compile, fused AdamW, flash SDPA, 16 x 32
# micro-batches = 524,288 tokens/step) on synthetic tokens: tokens/s and MFU; then with the largest micro-batch that fits.
step bench_mfu 120 "\"\$PY\" benchmarks/bench.py train --preset gpt2-small --device cuda --compile on --set dtype=bfloat16 --steps 10 --warmup 3" \
  "\"\$PY\" benchmarks/bench.py train --preset phase1 --device cpu --compile off --steps 2 --warmup 1"
# The same with --recipe modern: Muon's Newton-Schulz in each step (0.3% of its FLOPs at this shape).
step bench_mfu_modern 110 "\"\$PY\" benchmarks/bench.py train --preset gpt2-small --recipe modern --device cuda --compile on --set dtype=bfloat16 --steps 10 --warmup 3" \
  "\"\$PY\" benchmarks/bench.py train --preset phase1 --recipe modern --device cpu --compile off --steps 2 --warmup 1"
step bench_mfu_autobatch 110 "\"\$PY\" benchmarks/bench.py train --preset gpt2-small --device cuda --compile on --set dtype=bfloat16 --steps 6 --warmup 2 --auto-batch" \
  "\"\$PY\" benchmarks/bench.py train --help"
# The optimization ladder at the original author's shape (gpt2-small, 64 x 512 tokens per step as 16 x 4).
step bench_ladder 170 "\"\$PY\" benchmarks/bench.py ladder --device cuda --steps 6 --warmup 2" "\"\$PY\" benchmarks/bench.py ladder --help"
# Decoding (fp32, batch 1, greedy): the KV-cached engine and transformers' generate.
step bench_generate 100 "\"\$PY\" benchmarks/generate_bench.py --device cuda --new-tokens 256 1024 --repeats 2 --nocache-repeats 1 --nocache-tokens 256" \
  "\"\$PY\" benchmarks/generate_bench.py --preset phase1 --new-tokens 16 --repeats 1 --nocache-repeats 0"
# HellaSwag scoring speed: all 10,042 items (synthetic, realistic lengths) with gpt2-small.
step bench_eval 80 "\"\$PY\" benchmarks/eval_bench.py --device cuda --preset gpt2-small --items 10042 --repeats 2" \
  "\"\$PY\" benchmarks/eval_bench.py --preset phase1 --items 20 --repeats 1"

selected() {  # selected NAME: setup always; else in --only (a name or a prefix before "_"), or everything
  local n=$1 want
  [[ $n == setup || -z $ONLY ]] && return 0
  IFS=, read -ra want <<< "$ONLY"
  for w in "${want[@]}"; do [[ $n == "$w" || $n == "$w"_* ]] && return 0; done
  return 1
}

if [[ -n $ONLY ]]; then
  IFS=, read -ra want <<< "$ONLY"
  for w in "${want[@]}"; do
    found=""
    for n in "${NAMES[@]}"; do [[ $n == "$w" || $n == "$w"_* ]] && found=1; done
    [[ -n $found ]] || die "--only $w: no such step (steps: ${NAMES[*]})"
  done
fi

if [[ -n $LIST ]]; then
  total=0
  for i in "${!NAMES[@]}"; do
    printf '%-20s %5s s  %s\n' "${NAMES[$i]}" "${BUDGETS[$i]}" "${CMDS[$i]}"
    total=$((total + BUDGETS[i]))
  done
  printf '%-20s %5s s  (%d min %02d s)\n' total "$total" $((total / 60)) $((total % 60))
  exit 0
fi

# --- Python, requirements, data -------------------------------------------------------------------------------------
has_torch() { timeout 120 "$1" -c "import torch" >/dev/null 2>&1; }
has_cuda() { timeout 120 "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }
pick_python() {  # pick_python TEST: the first candidate passing TEST -> PY
  local c
  for c in ${PYTHON:-} .venv/bin/python python3 python; do
    command -v "$c" >/dev/null 2>&1 && "$1" "$c" && { PY=$(command -v "$c"); [[ $PY == /* ]] || PY=$REPO/$PY; return 0; }
  done
  return 1
}
PY=""
if [[ -n $DRY ]]; then
  pick_python has_torch || die "dry run: no Python with torch found (run scripts/setup.sh, or set PYTHON)"
elif ! pick_python has_cuda; then
  echo "no Python here has a torch that sees a CUDA GPU: running scripts/setup.sh (.venv, torch from PyPI)"
  bash scripts/setup.sh || die "scripts/setup.sh failed"
  has_cuda .venv/bin/python || die "torch in .venv sees no CUDA GPU ($(.venv/bin/python -c 'import torch; print(torch.__version__)' 2>&1)): install a CUDA build of torch there, or set PYTHON to a Python that has one"
  PY=$REPO/.venv/bin/python
fi

export PY PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's gptlib; wheels installed to $SITE
mapfile -t INFO < <("$PY" -c "
import re, torch
name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device'
print(torch.__version__); print(name); print(re.sub(r'[^A-Za-z0-9._-]+', '_', name).strip('_'))
try:
    from benchmarks.machine import machine_info
    print(machine_info())
except Exception as e:
    print(f'machine info unavailable: {e}')
")
TORCH_VERSION=${INFO[0]:-?} DEVICE_NAME=${INFO[1]:-?} TAG=${INFO[2]:-unknown} MACHINE=${INFO[3]:-}
[[ -n $DRY ]] && TAG=dryrun
SMI=$(command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null | head -1)
if [[ -z $RESULTS ]]; then
  if [[ -n $DRY ]]; then RESULTS=$(mktemp -d /tmp/gptlib-gpu-check-dry.XXXXXX); else RESULTS=$REPO/benchmarks/results; fi
fi
mkdir -p "$RESULTS" && RESULTS=$(cd "$RESULTS" && pwd)
if [[ -z $SHAKESPEARE ]]; then
  for c in "$REPO/../shared/data/tinyshakespeare.txt" "$REPO/shared/data/tinyshakespeare.txt"; do
    [[ -f $c ]] && { SHAKESPEARE=$c; break; }
  done
fi
[[ -n $SHAKESPEARE && -f $SHAKESPEARE ]] && SHAKESPEARE=$(cd "$(dirname "$SHAKESPEARE")" && pwd)/$(basename "$SHAKESPEARE")
export GPTLIB_SHAKESPEARE=$SHAKESPEARE GPTLIB_GPU_RESULTS=$RESULTS GPTLIB_GPU_TAG=$TAG REQS_PY WHEELS SITE DRY

setup_deps() {  # the missing requirements of pyproject.toml, installed (offline from $WHEELS), torch untouched
  local missing constraints
  missing=$("$PY" -c "$REQS_PY") || { echo "could not read the requirements in pyproject.toml"; return 1; }
  if [[ -z $missing ]]; then
    echo "all requirements of pyproject.toml are installed; torch $("$PY" -c 'import torch; print(torch.__version__)') is kept"
    return 0
  fi
  echo "missing:" $missing
  if [[ -n $DRY ]]; then echo "(dry run: nothing installed)"; return 0; fi
  constraints=$(mktemp)
  "$PY" -c "import torch, numpy; print(f'torch=={torch.__version__}'); print(f'numpy=={numpy.__version__}')" > "$constraints"
  if [[ -n $WHEELS ]]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" -c "$constraints" $missing || {
      echo "pip could not install into $("$PY" -c 'import sys; print(sys.prefix)'): installing the wheels into $SITE instead"
      "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WHEELS"/*.whl; }
  else
    "$PY" -m pip install -q --retries 1 --timeout 20 -c "$constraints" $missing
  fi
  missing=$("$PY" -c "$REQS_PY")
  [[ -z $missing ]] || { echo "still missing:" $missing "(tests that need them are skipped or fail)"; return 1; }
  echo "installed; torch $("$PY" -c 'import torch; print(torch.__version__)') kept"
}
export -f setup_deps

# --- running and reporting --------------------------------------------------------------------------------------------
declare -A STATUS SECS
RAN=()
STAMP=$(mktemp) && touch -d '-2 seconds' "$STAMP"

run_step() {  # run_step NAME BUDGET COMMAND
  local name=$1 budget=$2 cmd=$3 file="$RESULTS/gpu_${TAG}_$1.txt" t0 rc status shown
  shown=${cmd//\"\$PY\"/$PY}
  {
    echo "device: $DEVICE_NAME"
    echo "torch: $TORCH_VERSION"
    echo "command: $shown"
    echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "budget: $budget s${DRY:+ (dry run)}"
    echo "machine: $MACHINE"
    [[ -n $SMI ]] && echo "nvidia-smi: $SMI"
    echo
  } > "$file"
  echo
  echo "=== $name (budget ${budget} s): $shown"
  t0=$SECONDS
  timeout --signal=INT --kill-after=15 "$budget" bash -c "$cmd" < /dev/null 2>&1 | tee -a "$file"
  rc=${PIPESTATUS[0]}
  case $rc in
    0) status=ok ;;
    124|137) status=TIMEOUT ;;
    *) status="FAIL(rc=$rc)" ;;
  esac
  # a test group that passed nothing (all skipped, e.g. a missing package) is not a pass
  if [[ -z $DRY && $status == ok && $name == test_* ]] && ! grep -qE '[0-9]+ passed' "$file"; then status=SKIPPED; fi
  STATUS[$name]=$status SECS[$name]=$((SECONDS - t0))
  RAN+=("$name")
  echo "--- $name: $status after ${SECS[$name]} s (budget $budget s)" | tee -a "$file"
}

# Colab's GPU runtime runs torch 2.11.0+cu128: a result on another torch is still a result, but it is named as one.
COLAB_TORCH=2.11.0+cu128
colab_torch_note() {
  [[ $TORCH_VERSION == "$COLAB_TORCH" ]] || echo "NOTE: torch $TORCH_VERSION here, not Colab's $COLAB_TORCH: these results are for this torch"
}

row() { printf '%-22s %-13s %7s %7s  %s\n' "$@"; }

write_summary() {  # gpu_<TAG>_summary.txt: this call's rows, and the last rows of steps it did not run
  local file="$RESULTS/gpu_${TAG}_summary.txt" old="" now i n
  [[ -f $file ]] && old=$(cat "$file")
  now=$(date -u '+%Y-%m-%dT%H:%MZ')
  {
    echo "GPU check: $DEVICE_NAME, torch $TORCH_VERSION (bash benchmarks/gpu_check.sh)"
    colab_torch_note
    row step status seconds budget date
    for i in "${!NAMES[@]}"; do
      n=${NAMES[$i]}
      if [[ -n ${STATUS[$n]:-} ]]; then
        row "$n" "${STATUS[$n]}" "${SECS[$n]}" "${BUDGETS[$i]}" "$now"
      else
        grep -E "^$n +" <<< "$old" | tail -1
      fi
    done
  } > "$file.tmp" && mv "$file.tmp" "$file"
}

echo "GPU check on $DEVICE_NAME (torch $TORCH_VERSION, $PY)${DRY:+: DRY RUN}"
echo "results: $RESULTS/gpu_${TAG}_*.txt; Tiny Shakespeare: ${SHAKESPEARE:-NOT FOUND (the tests that train on it fail; pass --shakespeare PATH)}"
[[ -n $DRY ]] && { echo "dry run: the steps and their budgets:"; bash "$0" --list; }

for i in "${!NAMES[@]}"; do
  selected "${NAMES[$i]}" || continue
  if [[ -n $DRY ]]; then run_step "${NAMES[$i]}" "${BUDGETS[$i]}" "${DRYS[$i]}"
  else run_step "${NAMES[$i]}" "${BUDGETS[$i]}" "${CMDS[$i]}"; fi
done
if [[ -n $DRY ]]; then  # the time box itself: a 30 s command under a 2 s budget must come back as TIMEOUT
  NAMES+=(dry_timeout_selfcheck) BUDGETS+=(2)
  run_step dry_timeout_selfcheck 2 "sleep 30"
fi
write_summary

echo
echo "GPU check summary: $DEVICE_NAME, torch $TORCH_VERSION${DRY:+ (dry run)}"
colab_torch_note
row step status seconds budget
total_s=0 total_b=0 failed=0
for i in "${!NAMES[@]}"; do
  n=${NAMES[$i]}
  [[ -n ${STATUS[$n]:-} ]] || continue
  row "$n" "${STATUS[$n]}" "${SECS[$n]}" "${BUDGETS[$i]}"
  total_s=$((total_s + SECS[$n])) total_b=$((total_b + BUDGETS[i]))
  if [[ $n == dry_timeout_selfcheck ]]; then [[ ${STATUS[$n]} == TIMEOUT ]] || failed=1
  elif [[ ${STATUS[$n]} != ok ]]; then failed=1; fi
done
row total "" "$total_s" "$total_b"
[[ -n $DRY && ${STATUS[dry_timeout_selfcheck]:-} == TIMEOUT ]] && echo "time box works: the 2 s budget stopped a 30 s command (TIMEOUT above is expected)"
echo "raw output: $RESULTS/gpu_${TAG}_<step>.txt; all steps so far: $RESULTS/gpu_${TAG}_summary.txt"
if [[ -n $ARCHIVE ]]; then
  mapfile -t files < <(find "$RESULTS" -maxdepth 1 -type f -name "gpu_${TAG}_*" -newer "$STAMP" -printf '%f\n' | sort)
  tar -czf "$ARCHIVE" -C "$RESULTS" "${files[@]}" && echo "archive: $ARCHIVE (${#files[@]} files)"
fi
rm -f "$STAMP"
exit $failed
