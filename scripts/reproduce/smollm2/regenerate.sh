#!/usr/bin/env bash
# Regenerate the SmolLM2 training answers with the target itself (greedy, resumable: rerun to continue).
# Usage: bash scripts/reproduce/smollm2/regenerate.sh [TARGET_DIR] [PROMPTS_DIR] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../../.."
TARGET=${1:-outputs/smollm2/target}
PROMPTS=${2:-outputs/smollm2/prompts}
OUT=${3:-outputs/smollm2/regenerated}
mkdir -p "$OUT"
# Records per set: CPU time (about 20 s per code record, 2 cores shared with training) caps code and chat here.
declare -A LIMIT=([math]=${MATH_LIMIT:-800} [code]=${CODE_LIMIT:-128} [chat]=${CHAT_LIMIT:-64})
for set in math code chat; do
  .venv/bin/dmtp regenerate --target "$TARGET" --input "$PROMPTS/train_$set.jsonl" --output "$OUT/train_$set.jsonl" \
    --batch-size 16 --max-new-tokens 192 --limit "${LIMIT[$set]}"
done
cat "$OUT"/train_{math,code,chat}.jsonl > "$OUT/train_all.jsonl"
echo "done: $(wc -l < "$OUT/train_all.jsonl") records"
