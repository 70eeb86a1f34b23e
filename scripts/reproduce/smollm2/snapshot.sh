#!/usr/bin/env bash
# Keep the expensive SmolLM2 data in the repository, so a regeneration can span sessions: the Magpie requests and
# every regenerated answer so far, gzipped into scripts/reproduce/smollm2/data/. regenerate.sh starts from them.
# Usage: bash scripts/reproduce/smollm2/snapshot.sh [PROMPTS_DIR] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../../.."
PROMPTS=${1:-outputs/smollm2/prompts}
OUT=${2:-outputs/smollm2/regenerated}
DATA=scripts/reproduce/smollm2/data
mkdir -p "$DATA"
[ -f "$PROMPTS/train_magpie.jsonl" ] && gzip -9 -n -c "$PROMPTS/train_magpie.jsonl" > "$DATA/prompts_magpie.jsonl.gz"
for set in math code chat magpie; do
  if [ -f "$OUT/train_$set.jsonl" ]; then
    # complete lines only (a run may be appending right now): drop anything after the last newline
    perl -0777 -pe 's/[^\n]*\z//' "$OUT/train_$set.jsonl" | gzip -9 -n > "$DATA/regenerated_$set.jsonl.gz"
  fi
done
for f in "$DATA"/*.gz; do echo "$f: $(zcat "$f" | wc -l) records"; done
