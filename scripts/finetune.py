"""Train a DMTP (or DFlash) draft: ``accelerate launch scripts/finetune.py --config configs/tiny-dmtp.yaml``.

Also runs as ``python scripts/finetune.py --config X.yaml`` (one process). Override any config key with
``--set key=value`` (e.g. ``--set max_steps=100``). See `dmtp_hf.training.trainer` for the loop.
"""

import sys

from dmtp_hf.training.trainer import main

if __name__ == "__main__":
    sys.exit(main())
