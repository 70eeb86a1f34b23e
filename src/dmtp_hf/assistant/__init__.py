"""What runs at generation: drafters, the decoding round, verification, cache rollback, statistics."""

from .candidate_generator import DMTPCandidateGenerator, generate_with_transformers_loop
from .decoding import speculative_decode
from .drafters import (
    DFlashDrafter,
    DMTPDrafter,
    Drafter,
    DrafterWrapper,
    MTPDrafter,
    Proposal,
    TargetStep,
    TokenSelector,
)
from .generate import DMTPGenerateOutput, as_drafter, dmtp_custom_generate, generate, install_generate_router
from .stats import SpecStats
from .verification import VERIFY_MODES, verify

__all__ = [
    "DFlashDrafter",
    "DMTPCandidateGenerator",
    "DMTPDrafter",
    "DMTPGenerateOutput",
    "Drafter",
    "DrafterWrapper",
    "MTPDrafter",
    "Proposal",
    "SpecStats",
    "TargetStep",
    "TokenSelector",
    "VERIFY_MODES",
    "as_drafter",
    "dmtp_custom_generate",
    "generate",
    "generate_with_transformers_loop",
    "install_generate_router",
    "speculative_decode",
    "verify",
]
