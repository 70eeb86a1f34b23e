"""Test helpers shared across the project: tiny random targets in real checkpoint layouts."""

from .tiny_targets import (
    FAMILIES,
    load_tiny_target,
    make_tiny_llama,
    make_tiny_target,
    mtp_ignore_patterns,
    read_checkpoint_tensors,
    tiny_target_config,
)

__all__ = [
    "FAMILIES",
    "load_tiny_target",
    "make_tiny_llama",
    "make_tiny_target",
    "mtp_ignore_patterns",
    "read_checkpoint_tensors",
    "tiny_target_config",
]
