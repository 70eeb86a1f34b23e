#!/usr/bin/env bash
# The bundled drafts' training data: the bundled target's own greedy answers to the stdlib code requests and the
# two-turn chats of outputs/corpus (build_corpus.py), written to outputs/drafts/regen_train.jsonl. Resumable (rerun
# to continue; --limit counts the whole file). About 40 minutes on 2 CPU cores.
#
#     bash scripts/reproduce/regenerate_bundled.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
DMTP=${DMTP:-.venv/bin/dmtp}
T=${TARGET:-assets/dmtp_hf_assets/models/target}
OUT=${OUT:-outputs/drafts/regen_train.jsonl}
[ -f outputs/corpus/train_code_chat.jsonl ] || ${PY:-.venv/bin/python} scripts/reproduce/build_corpus.py --out outputs/corpus
mkdir -p "$(dirname "$OUT")"
$DMTP regenerate --target $T --input outputs/corpus/train_code_chat.jsonl --output "$OUT" \
    --batch-size 16 --max-new-tokens 256 --limit 2400
$DMTP regenerate --target $T --input outputs/corpus/train_chat_2turn.jsonl --output "$OUT" \
    --batch-size 16 --max-new-tokens 256 --limit 3200
