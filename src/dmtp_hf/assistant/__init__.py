"""What runs at generation: drafters and their state, the decoding round, verification, target cache rollback,
statistics, and the entry points (``generate``, ``custom_generate``, the ``target.generate`` router)."""

from .accept.processing import TokenSelector
from .accept.verification import VERIFY_MODES, verify
from .candidate_generator import DMTPCandidateGenerator, generate_with_transformers_loop
from .decoding import speculative_decode
from .drafters.base import Drafter, DrafterWrapper, Proposal
from .drafters.dflash import DFlashDrafter
from .drafters.dmtp import DMTPDrafter
from .drafters.mtp import MTPDrafter
from .drafters.state import DFlashContext, MTPState, SlotKV
from .generate import DMTPGenerateOutput, as_drafter, dmtp_custom_generate, generate
from .router import install_generate_router, route_bound_targets
from .stats import SpecStats
from .target.step import TargetStep

__all__ = [
    "DFlashContext",
    "DFlashDrafter",
    "DMTPCandidateGenerator",
    "DMTPDrafter",
    "DMTPGenerateOutput",
    "Drafter",
    "DrafterWrapper",
    "MTPDrafter",
    "MTPState",
    "Proposal",
    "SlotKV",
    "SpecStats",
    "TargetStep",
    "TokenSelector",
    "VERIFY_MODES",
    "as_drafter",
    "dmtp_custom_generate",
    "generate",
    "generate_with_transformers_loop",
    "install_generate_router",
    "route_bound_targets",
    "speculative_decode",
    "verify",
]
