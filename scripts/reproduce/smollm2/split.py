"""Shuffle regenerated sets together with a fixed seed and hold out a random split.

Usage::

    .venv/bin/python scripts/reproduce/smollm2/split.py --inputs a.jsonl b.jsonl --train train_all.jsonl \\
        --heldout heldout.jsonl --heldout-size 256
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path


def main() -> None:
    """Write ``--train`` (shuffled, held-out records removed) and ``--heldout``; print the mix of each."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", nargs="+", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--heldout", required=True)
    parser.add_argument("--heldout-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows = []
    for path in args.inputs:  # train_<set>.jsonl: the set is recorded with each record (for the mix)
        kind = Path(path).stem.removeprefix("train_")
        rows += [{"set": kind, **json.loads(line)} for line in Path(path).read_text().splitlines() if line.strip()]
    rows.sort(key=lambda row: row["id"])  # the shuffle depends only on the records, not on completion order
    random.Random(args.seed).shuffle(rows)
    heldout, train = rows[: args.heldout_size], rows[args.heldout_size :]
    for path, part in ((args.train, train), (args.heldout, heldout)):
        with open(path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in part)
        mix = Counter(row["set"] for row in part)
        print(f"{path}: {len(part)} records {dict(sorted(mix.items()))}")


if __name__ == "__main__":
    main()
