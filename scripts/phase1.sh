#!/usr/bin/env bash
# Phase 1 end to end on CPU: Tiny Shakespeare -> char tokenizer -> tiny GPT -> samples + loss plot.
#   bash scripts/phase1.sh [PATH_TO_tinyshakespeare.txt] [RUN_DIR]
# Without a path the canonical file is downloaded (checksum-verified, cached in ~/.cache/gptlib).
# Re-running resumes (or, when finished, just samples again).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
RUN_DIR="${2:-runs/phase1}"
if [ "${1:-}" != "" ]; then
    TEXT="$1"  # any local text file (the shared Tiny Shakespeare copy, or your own)
else
    TEXT="$(python -m gptlib fetch-shakespeare)"  # download once, verify sha256, cache
fi
python -m gptlib tokenize --input "$TEXT" --tokenizer char --out "$RUN_DIR/data"
python -m gptlib train --data "$RUN_DIR/data" --preset phase1 --run-dir "$RUN_DIR"
python -m gptlib sample --run-dir "$RUN_DIR" --prompt "ROMEO:" --max-new-tokens 300 --temperature 0.8
echo
echo "run directory: $RUN_DIR (loss curve: $RUN_DIR/loss.png, metrics: $RUN_DIR/metrics.jsonl, samples: $RUN_DIR/samples.md)"
