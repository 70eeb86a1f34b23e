"""Copy the trained drafts' final exports into the package (``src/dmtp_hf/bundled/models/``), atomically.

    python scripts/reproduce/bundle_drafts.py                 # outputs/drafts/{dmtp,dflash,dmtp-from-dflash}/final

Each bundled folder holds ``config.json``, ``model.safetensors`` (fp32, as trained) and ``training.json`` (steps,
samples, CPU time, last held-out metrics, the full training config), which the comparison report quotes.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dmtp_hf import DMTPDraftModel
from dmtp_hf.modeling.io import atomic_directory

REPO = Path(__file__).resolve().parents[2]
DRAFTS = {"dmtp": "dmtp", "dflash": "dflash", "dmtp-from-dflash": "dmtp_from_dflash"}
FILES = ("config.json", "model.safetensors", "training.json")


def main(argv: list[str] | None = None) -> int:
    """Copy and check every draft (it must load strictly with ``DMTPDraftModel.from_pretrained``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafts", type=Path, default=REPO / "outputs" / "drafts")
    parser.add_argument("--models", type=Path, default=REPO / "src" / "dmtp_hf" / "bundled" / "models")
    args = parser.parse_args(argv)
    for run, folder in DRAFTS.items():
        source = args.drafts / run / "final"
        missing = [name for name in FILES if not (source / name).is_file()]
        if missing:
            raise SystemExit(f"{source} lacks {missing}: train it first (scripts/reproduce/README.md §6)")
        DMTPDraftModel.from_pretrained(source)  # strict load: refuses a damaged export
        with atomic_directory(args.models / folder) as tmp:
            for name in FILES:
                shutil.copy2(source / name, tmp / name)
        size = sum(f.stat().st_size for f in (args.models / folder).iterdir()) / 1e6
        print(f"bundled {source} -> {args.models / folder} ({size:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
