"""dmtp-hf: DMTP speculative decoding for Hugging Face Transformers.

The target's native MTP head proposes the first draft token T1 of each round; a DFlash-style parallel drafter
proposes T2..T7 in one forward pass, conditioned on T1 and on the MTP hidden state that predicted it.
"""

from transformers import AutoConfig, AutoModel

from .modeling import DMTPConfig, DMTPDraftModel

__version__ = "0.1.0.dev0"

AutoConfig.register(DMTPConfig.model_type, DMTPConfig, exist_ok=True)
AutoModel.register(DMTPConfig, DMTPDraftModel, exist_ok=True)

__all__ = ["DMTPConfig", "DMTPDraftModel", "__version__"]
