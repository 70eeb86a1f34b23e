"""The names a draft's config accepts for its anchor layout, its fusion and the MTP head's hidden input.

They live in a module that imports nothing, so that the ``dmtp`` parser lists them as choices without loading torch
or Transformers (``dmtp --help`` stays fast); :mod:`dmtp_hf.modeling.configuration_dmtp` validates against them.
"""

__all__ = ["ANCHOR_LAYOUTS", "FUSIONS", "MTP_HIDDEN_INPUTS"]

ANCHOR_LAYOUTS = ("dflash", "single", "dual")
FUSIONS = ("none", "hidden_residual", "residual", "replace")
# Which target hidden the MTP head reads; the training config checks it without loading the draft's config class
# (`dmtp train` refuses a bad config before torch loads). Equal to `configuration_dmtp.MTP_HIDDEN_INPUTS` (tested).
MTP_HIDDEN_INPUTS = ("post_norm", "pre_norm")
