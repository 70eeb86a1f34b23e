"""Checks on training data that must fail (or speak up) when the data loads, not steps into training.

* `check_token_ids`: pre-tokenized ids outside ``[0, vocab_size)`` are refused by file and line (the embedding
  lookup would otherwise raise a bare ``IndexError`` several steps in).
* `LengthReport`: how many records ``max_length`` truncated, and the share of tokens that cost, as one warning.
* `path_fingerprint`: a digest of a data file, stored with checkpoints (`data.data_fingerprints`) so that a resumed
  run notices when its data changed underneath it (`checkpoints.check_data_fingerprints`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["LengthReport", "check_token_ids", "path_fingerprint"]

logger = logging.getLogger(__name__)
_CHUNK = 1 << 20


def check_token_ids(input_ids: torch.Tensor, vocab_size: int | None, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` (``file:line``), the first id out of range and the vocabulary size when
    ``input_ids`` holds a negative id or, with ``vocab_size`` known, one ``>= vocab_size``."""
    if input_ids.numel() == 0:
        return
    bad = input_ids < 0
    if vocab_size is not None:
        bad |= input_ids >= vocab_size
    if not bool(bad.any()):
        return
    position = int(bad.nonzero()[0, 0])
    token = int(input_ids[position])
    where = f"{where}: token id {token} (position {position} of 'input_ids')"
    if vocab_size is None:
        raise ValueError(f"{where} is negative")
    raise ValueError(
        f"{where} is outside the vocabulary size {vocab_size} (ids 0 to {vocab_size - 1}); was the data tokenized "
        "for another model?"
    )


@dataclass
class LengthReport:
    """Counts what ``max_length`` cut off while a file loads; `warn` reports it once, or stays silent."""

    max_length: int | None
    records: int = 0
    tokens: int = 0
    truncated: int = 0
    lost_tokens: int = 0
    dropped: int = 0

    def add(self, length: int, dropped_by_truncation: bool) -> None:
        """Count one record of ``length`` tokens; ``dropped_by_truncation``: it only lost its trainable tokens to the
        cut (the whole record is then lost)."""
        self.records += 1
        self.tokens += length
        if self.max_length is None or length <= self.max_length:
            return
        self.truncated += 1
        self.lost_tokens += length if dropped_by_truncation else length - self.max_length
        self.dropped += int(dropped_by_truncation)

    def message(self, path: str | os.PathLike) -> str | None:
        """The warning text (None when nothing was truncated)."""
        if not self.truncated:
            return None
        share = self.lost_tokens / max(self.tokens, 1)
        text = (
            f"{path}: {self.truncated} of {self.records} records are longer than max_length={self.max_length} and were "
            f"truncated ({share:.1%} of the tokens lost)"
        )
        if self.dropped:
            text += f"; {self.dropped} of them kept no two consecutive supervised tokens and were dropped"
        return text

    def warn(self, path: str | os.PathLike) -> None:
        """Log the warning when anything was truncated."""
        if (text := self.message(path)) is not None:
            logger.warning(text)


def path_fingerprint(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` over a file's bytes (streamed). A feature directory (`dmtp extract`) is fingerprinted by its
    ``index.json`` and the names and sizes of its files: hashing hundreds of GB of hidden states would cost more than
    the check is worth, and a re-extraction rewrites the index anyway."""
    path = Path(path)
    digest = hashlib.sha256()
    if path.is_dir():
        digest.update((path / "index.json").read_bytes() if (path / "index.json").is_file() else b"")
        for file in sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")):
            digest.update(f"\0{file.name}\0{file.stat().st_size}".encode())
        return f"dir-sha256:{digest.hexdigest()}"
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"
