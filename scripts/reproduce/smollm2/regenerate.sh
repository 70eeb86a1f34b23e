#!/usr/bin/env bash
# Regenerate the SmolLM2 training answers with the target itself (greedy, batched, resumable: rerun to continue).
# Usage: bash scripts/reproduce/smollm2/regenerate.sh [TARGET_DIR] [PROMPTS_DIR] [OUT_DIR]
#
# Sets grow together in stages (every set to 250 records, then 500, ...), so an interrupted run still holds a
# balanced mix. The last step shuffles everything with a fixed seed and holds out a random split (split.py).
set -euo pipefail
cd "$(dirname "$0")/../../.."
TARGET=${1:-outputs/smollm2/target}
PROMPTS=${2:-outputs/smollm2/prompts}
OUT=${3:-outputs/smollm2/regenerated}
mkdir -p "$OUT"
# Start from what earlier sessions committed (snapshot.sh): a file here is resumed, never overwritten.
DATA=scripts/reproduce/smollm2/data
for set in math code chat magpie; do
  if [ ! -s "$OUT/train_$set.jsonl" ] && [ -f "$DATA/regenerated_$set.jsonl.gz" ]; then
    zcat "$DATA/regenerated_$set.jsonl.gz" > "$OUT/train_$set.jsonl"
  fi
done
# Records per set (environment variables override): about 6,500 in all, close to the evaluation mix of math,
# code and chat/instructions.
declare -A LIMIT=([math]=${MATH_LIMIT:-2000} [code]=${CODE_LIMIT:-2000} [chat]=${CHAT_LIMIT:-1000}
                  [magpie]=${MAGPIE_LIMIT:-1200})
declare -A TOKENS=([math]=192 [code]=192 [chat]=128 [magpie]=192)  # chat: two short turns per record
STAGES=${STAGES:-"250 500 1000 1500 2000"}
# SETS="math code" and SETS="chat magpie" run as two jobs (one core each); the split then waits for a run over all
SETS=${SETS:-"math code chat magpie"}
for stage in $STAGES; do
  for set in $SETS; do
    limit=$(( stage < LIMIT[$set] ? stage : LIMIT[$set] ))
    .venv/bin/dmtp regenerate --target "$TARGET" --input "$PROMPTS/train_$set.jsonl" --output "$OUT/train_$set.jsonl" \
      --batch-size "${BATCH_SIZE:-32}" --max-new-tokens "${TOKENS[$set]}" --limit "$limit"
  done
done
[ "$SETS" = "math code chat magpie" ] || exit 0
.venv/bin/python scripts/reproduce/smollm2/split.py --inputs "$OUT"/train_{math,code,chat,magpie}.jsonl \
  --train "$OUT/train_all.jsonl" --heldout "$OUT/heldout.jsonl" --heldout-size "${HELDOUT:-256}"
