#!/usr/bin/env bash
# Keep the SmolLM2 training runs in the repository, so that they can span sessions whose disks are not kept: each
# run's newest checkpoint as bf16 weights without optimizer state (`dmtp train --snapshot`, ~9 MB per run), in
# scripts/reproduce/smollm2/checkpoints/<run>/step-N.
#
#     bash scripts/reproduce/smollm2/training_snapshot.sh           # save (while runs train, or after)
#     bash scripts/reproduce/smollm2/training_snapshot.sh restore   # put them back where the runs resume from
#
# `restore` copies a saved step into outputs/smollm2/<run>/checkpoints/ only where that run has no checkpoint, so
# rerunning the run's `dmtp train` command continues from it (fresh AdamW moments, learning rate ramped up again over
# `rewarm_steps`; docs/scaling.md). A finished run resumes at its last step and only writes its final export again.
set -euo pipefail
cd "$(dirname "$0")/../../.."
KEEP=scripts/reproduce/smollm2/checkpoints
output_dir() { .venv/bin/python -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['output_dir'])" "$1"; }
for run in mtp-head dflash dmtp dflash2 dmtp-d2; do
  config=configs/smollm2-$run.yaml
  out=$(output_dir "$config")
  if [ "${1:-save}" = restore ]; then
    if ! compgen -G "$out/checkpoints/step-*" >/dev/null && compgen -G "$KEEP/$run/step-*" >/dev/null; then
      mkdir -p "$out/checkpoints" && cp -r "$KEEP/$run"/step-* "$out/checkpoints/"
      echo "$run: restored $(basename "$KEEP/$run"/step-*) into $out/checkpoints"
    fi
  elif compgen -G "$out/checkpoints/step-*" >/dev/null; then
    rm -rf "$KEEP/$run.new"
    .venv/bin/dmtp train --config "$config" --snapshot "$KEEP/$run.new" >/dev/null
    rm -rf "${KEEP:?}/$run" && mv "$KEEP/$run.new" "$KEEP/$run"
    echo "$run: $(basename "$KEEP/$run"/step-*) ($(du -sh "$KEEP/$run" | cut -f1))"
  fi
done
