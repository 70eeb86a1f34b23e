#!/usr/bin/env bash
# The measurements of reports/performance/README.md ("Verification that never costs more than it earns"), on CPU:
# calibration of the drafts, fixed K against verify_length=auto (eval, B = 1, and bench, B = 1, 2, 4), block against
# rejection verification at temperature 1, and the compiled verify. Bundled target, then SmolLM2 (`make smollm2`).
#
#   bash scripts/reproduce/verify_widths.sh [bundled|smollm2|compiled|all]   (default all; about 2.5 hours in all)
#   CALIBRATE=0 ... skips the calibration (the bundled drafts ship with theirs); T1=0 skips the temperature-1 runs.
#   bash scripts/reproduce/verify_widths.sh smollm2-calibration   only calibrates the SmolLM2 drafts (run.sh step 5)
#
# Calibration prompts are held-out code items 101-200 and chat items 61-121 of the corpus' bench files; the
# evaluations use the first 20 (eval) or 8 (bench) of each, so the two never overlap.
set -euo pipefail
cd "$(dirname "$0")/../.."
WHAT=${1:-all}
OUT=${OUT:-outputs/performance}
DMTP=.venv/bin/dmtp
CORPUS=outputs/corpus/bench
mkdir -p "$OUT"
[ -f "$CORPUS/code_question.jsonl" ] || .venv/bin/python scripts/reproduce/build_corpus.py --out outputs/corpus
sed -n 101,200p "$CORPUS/code_question.jsonl" > "$OUT/calibration_code.jsonl"
sed -n 61,121p "$CORPUS/chat_question.jsonl" > "$OUT/calibration_chat.jsonl"
HELD_OUT=(--datasets none --prompts "$CORPUS/code_question.jsonl" --prompts "$CORPUS/chat_question.jsonl")
CALIBRATION=(--datasets none --prompts "$OUT/calibration_code.jsonl" --prompts "$OUT/calibration_chat.jsonl")

if [ "$WHAT" = bundled ] || [ "$WHAT" = all ]; then
  # Each fit is stored in its draft's config.json (what auto reads); MTP-k strategies use raw confidence.
  [ "${CALIBRATE:-1}" = 0 ] || $DMTP calibrate --strategies dmtp,dflash,dflash2,dmtp-d2 "${CALIBRATION[@]}" --limit 40 --max-new-tokens 128 \
    --write --output-dir "$OUT/bundled/calibration" --no-progress
  FIXED_AND_AUTO=dmtp,dmtp:auto,dflash,dflash:auto,dmtp-d2,dmtp-d2:auto,dflash2,dflash2:auto,mtp1,mtp1:auto,mtp4,mtp4:auto
  $DMTP eval --strategies "$FIXED_AND_AUTO" "${HELD_OUT[@]}" --limit 20 --max-new-tokens 128 \
    --output-dir "$OUT/bundled/eval" --no-progress
  $DMTP bench --strategies dmtp,dmtp:auto,dflash,dflash:auto,mtp1,mtp1:auto "${HELD_OUT[@]}" --limit 8 \
    --max-new-tokens 128 --batch-sizes 1,2,4 --output-dir "$OUT/bundled/bench" --no-progress
  for mode in rejection block; do
    [ "${T1:-1}" = 0 ] && break
    $DMTP eval --strategies dmtp,dflash,dmtp-d2,dflash2,mtp4 "${HELD_OUT[@]}" --limit 20 --max-new-tokens 128 \
      --temperature 1 --verify-mode "$mode" --seed 0 --no-baseline --output-dir "$OUT/bundled/t1_$mode" --no-progress
  done
fi

SMOL=(--bundle smollm2)
calibrate_smollm2() {  # about 9 minutes on 2 cores for the four drafts
  $DMTP calibrate "${SMOL[@]}" --strategies dmtp,dflash,dflash2,dmtp-d2 "${CALIBRATION[@]}" --limit 10 \
    --max-new-tokens 96 --write --output-dir "$OUT/smollm2/calibration" --no-progress
}
if [ "$WHAT" = smollm2-calibration ]; then
  calibrate_smollm2
  exit 0
fi

if [ "$WHAT" = smollm2 ] || [ "$WHAT" = all ]; then
  [ "${CALIBRATE:-1}" = 0 ] || calibrate_smollm2
  $DMTP eval "${SMOL[@]}" --strategies dmtp,dmtp:auto,dflash,dflash:auto,mtp1,mtp1:auto \
    --datasets gsm8k,humaneval,mt_bench,alpaca --limit 4 --max-new-tokens 96 --output-dir "$OUT/smollm2/eval" \
    --no-progress
  $DMTP bench "${SMOL[@]}" --strategies dmtp,dmtp:auto,dflash:auto,mtp1:auto --datasets gsm8k,mt_bench --limit 4 \
    --max-new-tokens 64 --batch-sizes 1,2,4 --output-dir "$OUT/smollm2/bench" --no-progress
fi

if [ "$WHAT" = compiled ] || [ "$WHAT" = all ]; then
  .venv/bin/python scripts/bench_compiled_verify.py --threads 1 --prompts 6 --repeats 7 \
    --output "$OUT/compiled_bundled.json"
fi
