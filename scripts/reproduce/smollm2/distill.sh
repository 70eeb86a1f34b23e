#!/usr/bin/env bash
# Self-distillation data for the SmolLM2 head and drafts: offline features whose labels are the target's own greedy
# next tokens (`dmtp extract --target-labels`), over
#   - the regenerated answers (train_all.jsonl; there the labels equal the text) and their held-out split, and
#   - teacher-forced public text: the corpus's stdlib code requests answered by the real source, and its human
#     chitchat conversations (scripts/reproduce/DATA_SOURCES.md), truncated at 384 tokens.
# One prefill gives a sample's features and labels, no decode: about 200 tokens per second per core on an AVX2 core.
# Every set is resumable shard by shard (rerun to continue). PROCS processes of one core each (default 1).
#
#     bash scripts/reproduce/smollm2/distill.sh             # after run.sh's steps 1-2 (target, corpus, answers)
#     PROCS=2 bash scripts/reproduce/smollm2/distill.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
PROCS=${PROCS:-1}
OUT=outputs/smollm2
FEATURES=$OUT/features-distill
export OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false

extract() {  # extract NAME DATA
  [ -f "$FEATURES/$1/index.json" ] && return 0
  $PY -m accelerate.commands.launch --num_processes "$PROCS" --num_machines 1 --mixed_precision no \
    --dynamo_backend no $([ "$PROCS" -gt 1 ] && echo --multi_gpu) -m dmtp_hf.cli extract --target $OUT/target \
    --data "$2" --output "$FEATURES/$1" --target-layer-ids 1,14,27 --no-mtp --head-inputs --target-labels \
    --max-length 384 --batch-size 8 --shard-size 128 --dtype bfloat16
}

extract heldout $OUT/regenerated/heldout.jsonl        # 256 regenerated answers never trained on: eval_data
extract regenerated $OUT/regenerated/train_all.jsonl  # 5,944 regenerated answers
extract code-text outputs/corpus/train_code_chat.jsonl  # 4,256 stdlib functions, as written by people
extract chat-text outputs/corpus/train_chat.jsonl       # 3,896 human conversations
