#!/usr/bin/env bash
# `verify_length="auto"` with prompt lookup competing (dmtp:auto) against the draft alone under auto
# (dmtp:auto-draft), plain generate, prompt lookup alone (Transformers' prompt lookup, the bench's peer) and fixed
# widths (dmtp:1, dmtp:2, dmtp = all K), per SmolLM2 set and on the bundled target, at batch sizes 1 and 2, three
# interleaved repeats, on a quiet machine and with a burner on one core switched on and off every 5 s (a load that
# changes during the run). Tables by scripts/reproduce/lookup_auto_report.py.
#
#   bash scripts/reproduce/lookup_auto.sh [smollm2|bundled|all]     (all: about two hours on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../.."
WHAT=${1:-all}
OUT=${OUT:-reports/performance/lookup}
DMTP=.venv/bin/dmtp
CORPUS=outputs/corpus/bench
[ -f "$CORPUS/code_question.jsonl" ] || .venv/bin/python scripts/reproduce/build_corpus.py --out outputs/corpus
STRATEGIES=dmtp,dmtp:1,dmtp:2,dmtp:auto-draft,dmtp:auto
COMMON=(--limit 2 --max-new-tokens 64 --batch-sizes 1,2 --repeats 3 --no-progress)
mkdir -p "$OUT"

for load in quiet changing; do
  LOAD=()
  [ "$load" = changing ] && LOAD=(--burner 1 --burner-period 5)
  if [ "$WHAT" = smollm2 ] || [ "$WHAT" = all ]; then
    for set in gsm8k humaneval mt_bench alpaca; do
      $DMTP bench --bundle smollm2 --strategies $STRATEGIES --datasets $set "${COMMON[@]}" "${LOAD[@]}" \
        --output-dir "$OUT/smollm2-$set-$load"
    done
    for kind in code chat; do
      $DMTP bench --bundle smollm2 --strategies $STRATEGIES --datasets none \
        --prompts "$CORPUS/${kind}_question.jsonl" "${COMMON[@]}" "${LOAD[@]}" --output-dir "$OUT/smollm2-heldout_$kind-$load"
    done
  fi
  if [ "$WHAT" = bundled ] || [ "$WHAT" = all ]; then
    $DMTP bench --strategies $STRATEGIES --datasets none --prompts "$CORPUS/code_question.jsonl" \
      --prompts "$CORPUS/chat_question.jsonl" "${COMMON[@]}" "${LOAD[@]}" --output-dir "$OUT/bundled-$load"
  fi
done
