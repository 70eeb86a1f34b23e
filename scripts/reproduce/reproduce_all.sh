#!/usr/bin/env bash
# Rebuild every bundled model from scratch and rerun the comparison, on CPU (see README.md here for each step and
# its measured time; about 5 hours on 2 cores, most of it the target's pretraining).
#
#     bash scripts/reproduce/reproduce_all.sh            # uses .venv (make install creates it)
#
# Every step is resumable: rerun the script after an interruption and finished steps are skipped or continued
# (pretraining, regeneration and draft training resume from their checkpoints / output files).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
DMTP=${DMTP:-.venv/bin/dmtp}
export OMP_WAIT_POLICY=PASSIVE TOKENIZERS_PARALLELISM=false
T=outputs/target/model

# 1. corpus (Python stdlib source + chitchat-dataset from PyPI) and 2. tokenizer
$PY scripts/reproduce/build_corpus.py --out outputs/corpus --cache outputs/corpus_cache
$PY scripts/reproduce/train_tokenizer.py --corpus outputs/corpus --out outputs/tokenizer

# 3. the target: Qwen3.5 architecture with a native MTP head, LM + 0.3 MTP loss, from scratch (resumable)
mkdir -p outputs/target
$PY scripts/reproduce/pretrain_target.py --out outputs/target --preset small --seq-len 512 --batch-size 4 \
    --max-steps 2000 --lr 2e-3 --warmup-steps 50 --mtp-weight 0.3 --seed 0 >> outputs/target/train.log 2>&1
$PY scripts/reproduce/check_target.py --model $T --prompts 10 --save outputs/target/check.json
mkdir -p assets/dmtp_hf_assets/models/target
cp $T/* assets/dmtp_hf_assets/models/target/
T=assets/dmtp_hf_assets/models/target

# 4. training data for the drafts: the target's own greedy answers (resumable)
TARGET=$T bash scripts/reproduce/regenerate_bundled.sh

# 5. the drafts: DFlash and DMTP in parallel (one core each), then DMTP continued from DFlash (2 processes)
OMP_NUM_THREADS=1 $DMTP train --config configs/bundled-dflash.yaml > outputs/drafts/train-dflash.log 2>&1 &
OMP_NUM_THREADS=1 $DMTP train --config configs/bundled-dmtp.yaml > outputs/drafts/train-dmtp.log 2>&1 &
wait
OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES= $PY -m accelerate.commands.launch --multi_gpu --num_processes 2 \
    --num_machines 1 --mixed_precision no --dynamo_backend no scripts/finetune.py \
    --config configs/bundled-dmtp-from-dflash.yaml --set micro_batch_size=2 > outputs/drafts/train-from-dflash.log 2>&1
$PY scripts/reproduce/bundle_drafts.py

# 5b. the target's own MTP head tuned on the same data (target frozen), then the DMTP draft adapted to it
$DMTP train --config configs/bundled-mtp-head.yaml > outputs/drafts/train-mtp-head.log 2>&1
$DMTP train --config configs/bundled-dmtp-tuned.yaml > outputs/drafts/train-dmtp-tuned.log 2>&1
$PY scripts/reproduce/bundle_drafts.py --set tuned

# 5c. the DFlash2 backbone: DFlash2 (as DFlash) and DMTP(D2) on the tuned head (as the tuned DMTP), in parallel
OMP_NUM_THREADS=1 $DMTP train --config configs/bundled-dflash2.yaml > outputs/drafts/train-dflash2.log 2>&1 &
OMP_NUM_THREADS=1 $DMTP train --config configs/bundled-dmtp-d2.yaml > outputs/drafts/train-dmtp-d2.log 2>&1 &
wait
$PY scripts/reproduce/bundle_drafts.py --set d2

# 6. the comparison: reports/bundled/ (README.md, eval.json/md, bench.json, plots)
$PY scripts/reproduce/compare.py
