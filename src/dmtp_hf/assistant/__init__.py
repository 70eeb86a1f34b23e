"""What runs at generation: drafters and their state, the decoding round, verification, target cache rollback,
statistics, and the entry points (``generate``, ``custom_generate``, the ``target.generate`` router)."""

from .candidate_generator import DMTPCandidateGenerator, generate_with_transformers_loop
from .decoding import speculative_decode
from .drafter_state import DFlashContext, MTPState, SlotKV
from .drafters import DFlashDrafter, DMTPDrafter, Drafter, DrafterWrapper, MTPDrafter, Proposal
from .generate import DMTPGenerateOutput, as_drafter, dmtp_custom_generate, generate
from .processing import TokenSelector
from .router import install_generate_router, route_bound_targets
from .stats import SpecStats
from .target_step import TargetStep
from .verification import VERIFY_MODES, verify

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
