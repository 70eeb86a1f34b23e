"""Copy trained exports into the package (``assets/dmtp_hf_assets/models/``), atomically, after a strict load check.

    python scripts/reproduce/bundle_drafts.py                 # outputs/drafts/{dmtp,dflash,dmtp-from-dflash}/final
    python scripts/reproduce/bundle_drafts.py --set tuned     # the tuned MTP head and the DMTP draft adapted to it
    python scripts/reproduce/bundle_drafts.py --set d2        # the DFlash2 and DMTP(D2) drafts
    python scripts/reproduce/bundle_drafts.py --set smollm2   # outputs/smollm2/{mtp_head,dflash,dmtp} -> models/smollm2
    python scripts/reproduce/bundle_drafts.py --set smollm2-d2  # outputs/smollm2/{dflash2,dmtp_d2} -> models/smollm2
    python scripts/reproduce/bundle_drafts.py --set smollm2-d2 --only dflash2  # one folder of a set
    python scripts/reproduce/bundle_drafts.py --set smollm2-distilled  # the self-distilled head and the DMTP drafts
                                                                       # retrained on it (smollm2/distill_train.sh)

Each bundled folder holds ``config.json``, ``model.safetensors`` and ``training.json`` (steps, samples, CPU time,
last held-out metrics, the full training config), which the comparison report quotes. The bundled drafts stay fp32
(as trained); the SmolLM2 ones are stored in bfloat16 to keep the package small (its drafts are larger), and load
in the target's dtype.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dmtp_hf import DMTPDraftModel
from dmtp_hf.modeling.io import atomic_directory

REPO = Path(__file__).resolve().parents[2]
OUTPUTS = REPO / "outputs"
FILES = ("config.json", "model.safetensors", "training.json")
# set -> [(export folder, bundled folder name, kind)]; kind "draft" or "head"
SETS = {
    "drafts": [
        (OUTPUTS / "drafts" / "dmtp" / "final", "dmtp", "draft"),
        (OUTPUTS / "drafts" / "dflash" / "final", "dflash", "draft"),
        (OUTPUTS / "drafts" / "dmtp-from-dflash" / "final", "dmtp_from_dflash", "draft"),
    ],
    "tuned": [
        (OUTPUTS / "drafts" / "mtp_head" / "final_mtp_head", "mtp_head_tuned", "head"),
        (OUTPUTS / "drafts" / "dmtp_tuned" / "final", "dmtp_tuned", "draft"),
    ],
    "d2": [
        (OUTPUTS / "drafts" / "dflash2" / "final", "dflash2", "draft"),
        (OUTPUTS / "drafts" / "dmtp_d2" / "final", "dmtp_d2", "draft"),
    ],
    "smollm2": [
        (OUTPUTS / "smollm2" / "mtp_head" / "final_mtp_head", "smollm2/mtp_head", "head"),
        (OUTPUTS / "smollm2" / "dflash" / "final", "smollm2/dflash", "draft"),
        (OUTPUTS / "smollm2" / "dmtp" / "final", "smollm2/dmtp", "draft"),
    ],
    "smollm2-d2": [
        (OUTPUTS / "smollm2" / "dflash2" / "final", "smollm2/dflash2", "draft"),
        (OUTPUTS / "smollm2" / "dmtp_d2" / "final", "smollm2/dmtp_d2", "draft"),
    ],
    # the head continued on self-distillation data and the two DMTP drafts retrained on it; they replace the
    # scratch-trained head and DMTP drafts (DFlash and DFlash2 read no head and stay)
    "smollm2-distilled": [
        (OUTPUTS / "smollm2" / "distill" / "head-mix-online" / "final_mtp_head", "smollm2/mtp_head", "head"),
        (OUTPUTS / "smollm2" / "distill" / "dmtp" / "final", "smollm2/dmtp", "draft"),
        (OUTPUTS / "smollm2" / "distill" / "dmtp-d2" / "final", "smollm2/dmtp_d2", "draft"),
    ],
}
BF16_SETS = {"smollm2", "smollm2-d2", "smollm2-distilled"}


def _check(source: Path, kind: str) -> None:
    """Refuse a damaged export: drafts load strictly; heads carry their config and tensors."""
    if kind == "draft":
        DMTPDraftModel.from_pretrained(source)
    elif "dmtp_mtp_head" not in json.loads((source / "config.json").read_text()):
        raise SystemExit(f"{source} is not an MTP head checkpoint (no dmtp_mtp_head in config.json)")


def _copy(source: Path, destination: Path, bf16: bool) -> None:
    with atomic_directory(destination) as tmp:
        for name in FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, tmp / name)
        if bf16:
            tensors = load_file(str(source / "model.safetensors"))
            tensors = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            config = json.loads((tmp / "config.json").read_text())
            if "dmtp_mtp_head" in config:
                config["dmtp_mtp_head"]["dtype"] = "bfloat16"
            else:
                config["dtype"] = "bfloat16"
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Copy and check every export of the chosen set."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", dest="name", default="drafts", choices=sorted(SETS))
    parser.add_argument("--models", type=Path, default=REPO / "assets" / "dmtp_hf_assets" / "models")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="only these folders of the set (e.g. dflash2)")
    args = parser.parse_args(argv)
    entries = SETS[args.name]
    if args.only:
        entries = [entry for entry in entries if Path(entry[1]).name in args.only]
        if not entries:
            raise SystemExit(
                f"--only {args.only}: the set {args.name} has {[Path(e[1]).name for e in SETS[args.name]]}"
            )
    for source, folder, kind in entries:
        missing = [name for name in FILES[:2] if not (source / name).is_file()]
        if missing:
            raise SystemExit(f"{source} lacks {missing}: train it first (scripts/reproduce/README.md)")
        _check(source, kind)
        bf16 = args.name in BF16_SETS
        _copy(source, args.models / folder, bf16=bf16)
        if bf16 and kind == "draft":
            DMTPDraftModel.from_pretrained(args.models / folder)  # the converted copy loads too
        size = sum(f.stat().st_size for f in (args.models / folder).iterdir()) / 1e6
        print(f"bundled {source} -> {args.models / folder} ({size:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
