"""Drafters: one module per strategy (``dmtp.py``, ``dflash.py``, ``mtp.py``), what they share (``base.py``) and
their state between rounds (``state.py``: the MTP head's K/V and the DFlash context, on slots; ``cuda_graphs.py``).

The engine's own modules import the submodules directly (a pushed repo's generated code needs that); this package
re-exports the public names.
"""

from .base import CandidateWalk, Drafter, DrafterWrapper, Proposal, StatefulDrafter, block_candidates
from .dflash import DFlashDrafter
from .dmtp import DMTPDrafter
from .mtp import MTPDrafter
from .state import DFlashContext, MTPState, SlotKV

__all__ = [
    "CandidateWalk",
    "DFlashContext",
    "DFlashDrafter",
    "DMTPDrafter",
    "Drafter",
    "DrafterWrapper",
    "MTPDrafter",
    "MTPState",
    "Proposal",
    "SlotKV",
    "StatefulDrafter",
    "block_candidates",
]
