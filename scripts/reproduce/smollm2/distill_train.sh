#!/usr/bin/env bash
# Continued training of the SmolLM2 retrofitted head (then the drafts) on self-distillation data: labels are the
# target's own greedy tokens (`labels: target`), evaluated on the 256 held-out regenerated answers. Resumable: rerun
# the same command to continue a run.
#
#     bash scripts/reproduce/smollm2/distill_train.sh head-regenerated   # the bundled 2,400-step head, + regenerated answers
#     bash scripts/reproduce/smollm2/distill_train.sh head-mix           # the same budget, + teacher-forced text (1 : 0.5 : 0.5)
#     bash scripts/reproduce/smollm2/distill_train.sh head-mix-online    # head-mix read from the JSONL files, no extraction
#     bash scripts/reproduce/smollm2/distill_train.sh dmtp|dmtp-d2       # the drafts again, conditioned on that head
#     bash scripts/reproduce/smollm2/distill_train.sh snapshot|restore   # keep runs in the repository across sessions
#
# head-regenerated and head-mix read offline features (scripts/reproduce/smollm2/distill.sh, hours of extraction
# that a fresh disk loses); head-mix-online runs the frozen target in each step instead (about 4x the step time, but
# nothing to extract), so it is the run that spans sessions: `snapshot` commits its newest checkpoint (bf16, no
# optimizer state) to scripts/reproduce/smollm2/checkpoints/distill-<run>/, `restore` puts it back to resume from.
# The runs measure the mixing ratio: same start, learning rate and schedule, held-out top-1 accuracy of the head
# (`eval/mtp_acc` in the run's TensorBoard log and training.json). STEPS overrides the budget.
#
# dmtp and dmtp-d2 train DMTP and DMTP(D2) exactly as configs/smollm2-dmtp.yaml and smollm2-dmtp-d2.yaml (the
# bundled drafts' data, 2,400 steps and settings: offline features of run.sh's step 4), only conditioned on the
# distilled head (head-mix-online's export, frozen), so that the comparison isolates the head.
set -euo pipefail
cd "$(dirname "$0")/../../.."
F=outputs/smollm2/features-distill
J=outputs/smollm2/regenerated
C=outputs/corpus
RUNS="head-regenerated head-mix head-mix-online dmtp dmtp-d2"
HEAD=outputs/smollm2/distill/head-mix-online/final_mtp_head
KEEP=scripts/reproduce/smollm2/checkpoints
run=${1:?usage: distill_train.sh head-regenerated|head-mix|head-mix-online|snapshot|restore}
settings() {  # settings RUN: the run's config file (CONFIG) and --set arguments (SETTINGS)
  local data eval=$F/heldout steps=${STEPS:-600} every=100
  CONFIG=configs/smollm2-mtp-head.yaml
  case $1 in
    dmtp|dmtp-d2) CONFIG=configs/smollm2-$1.yaml
      SETTINGS=(--set mtp_init_from=$HEAD --set output_dir=outputs/smollm2/distill/$1)
      return ;;
    head-regenerated) data="[$F/regenerated]" ;;
    head-mix) data="[$F/regenerated, '$F/code-text*0.5', '$F/chat-text*0.5']" ;;
    head-mix-online) data="[$J/train_all.jsonl, '$C/train_code_chat.jsonl*0.5', '$C/train_chat.jsonl*0.5']"
      eval=$J/heldout.jsonl steps=${STEPS:-1200} every=200 ;;
    *) echo "unknown run $1" >&2; exit 2 ;;
  esac
  SETTINGS=(--set "train_data=$data" --set labels=target --set eval_data=$eval --set eval_holdout=0
    --set mtp_init_from=assets/dmtp_hf_assets/models/smollm2/mtp_head --set max_steps="$steps"
    --set learning_rate=0.0005 --set eval_every=$every --set save_every=$every
    --set output_dir=outputs/smollm2/distill/$1)
}
case $run in
  snapshot)
    for r in $RUNS; do
      compgen -G "outputs/smollm2/distill/$r/checkpoints/step-*" >/dev/null || continue
      settings "$r" && rm -rf "$KEEP/distill-$r.new"
      .venv/bin/dmtp train --config "$CONFIG" "${SETTINGS[@]}" --snapshot "$KEEP/distill-$r.new" >/dev/null
      rm -rf "${KEEP:?}/distill-$r" && mv "$KEEP/distill-$r.new" "$KEEP/distill-$r"
      echo "$r: $(basename "$KEEP/distill-$r"/step-*) ($(du -sh "$KEEP/distill-$r" | cut -f1))"
    done ;;
  restore)
    for r in $RUNS; do
      out=outputs/smollm2/distill/$r/checkpoints
      if ! compgen -G "$out/step-*" >/dev/null && compgen -G "$KEEP/distill-$r/step-*" >/dev/null; then
        mkdir -p "$out" && cp -r "$KEEP/distill-$r"/step-* "$out/" && echo "$r: restored into $out"
      fi
    done ;;
  dmtp|dmtp-d2)
    # the head they read: head-mix-online's export (a restored run that has reached its last step only exports it)
    [ -f "$HEAD/config.json" ] || bash "$0" head-mix-online
    settings "$run" && mkdir -p outputs/smollm2/distill
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/dmtp train --config "$CONFIG" "${SETTINGS[@]}" ;;
  *)
    settings "$run" && mkdir -p outputs/smollm2/distill
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/dmtp train --config "$CONFIG" "${SETTINGS[@]}" ;;
esac
