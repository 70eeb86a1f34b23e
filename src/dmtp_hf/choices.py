"""The names a draft's config accepts for its anchor layout and its fusion.

They live in a module that imports nothing, so that the ``dmtp`` parser lists them as choices without loading torch
or Transformers (``dmtp --help`` stays fast); :mod:`dmtp_hf.modeling.configuration_dmtp` validates against them.
"""

__all__ = ["ANCHOR_LAYOUTS", "FUSIONS"]

ANCHOR_LAYOUTS = ("dflash", "single", "dual")
FUSIONS = ("none", "hidden_residual", "residual", "replace")
