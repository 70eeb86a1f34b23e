#!/usr/bin/env bash
# Continued training of the SmolLM2 retrofitted head (then the drafts) on self-distillation data
# (scripts/reproduce/smollm2/distill.sh): labels are the target's own greedy tokens (`labels: target`), evaluated on
# the 256 held-out regenerated answers. Resumable: rerun the same command to continue a run.
#
#     bash scripts/reproduce/smollm2/distill_train.sh head-regenerated   # the bundled 2,400-step head, + regenerated answers
#     bash scripts/reproduce/smollm2/distill_train.sh head-mix           # the same budget, + teacher-forced text (1 : 0.5 : 0.5)
#
# The two runs measure the mixing ratio: same start, steps and learning rate, held-out top-1 accuracy of the head
# (`eval/mtp_acc` in the run's TensorBoard log and training.json). STEPS overrides the budget (default 600).
set -euo pipefail
cd "$(dirname "$0")/../../.."
F=outputs/smollm2/features-distill
STEPS=${STEPS:-600}
run=${1:?usage: distill_train.sh head-regenerated|head-mix}
case $run in
  head-regenerated) data="[$F/regenerated]" ;;
  head-mix) data="[$F/regenerated, '$F/code-text*0.5', '$F/chat-text*0.5']" ;;
  *) echo "unknown run $run" >&2; exit 2 ;;
esac
mkdir -p outputs/smollm2/distill
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/dmtp train --config configs/smollm2-mtp-head.yaml \
  --set "train_data=$data" --set labels=target --set eval_data=$F/heldout --set eval_holdout=0 \
  --set mtp_init_from=src/dmtp_hf/bundled/models/smollm2/mtp_head --set max_steps="$STEPS" \
  --set learning_rate=0.0005 --set eval_every=100 --set save_every=100 \
  --set output_dir=outputs/smollm2/distill/$run
