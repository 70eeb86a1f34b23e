"""Train a DMTP (or DFlash) draft: ``accelerate launch scripts/finetune.py --config configs/example-dmtp.yaml``.

Also runs as ``python scripts/finetune.py --config X.yaml`` (one process). Override any config key with
``--set key=value`` (e.g. ``--set max_steps=100``). See `dmtp_hf.training.trainer` for the loop. Ctrl-C saves a
resumable checkpoint, says where in one line and exits 0, under ``accelerate launch`` too; the same command resumes.
"""

import os
import sys

# On a shared CPU, OpenMP threads waiting for a descheduled sibling must sleep rather than spin (several times
# faster there); harmless elsewhere. It has to be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from dmtp_hf.training.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
