"""dmtp-hf: DMTP speculative decoding for Hugging Face Transformers.

The target's native MTP head proposes the first draft token T1 of each round; a DFlash-style parallel drafter
proposes T2..T7 in one forward pass, conditioned on T1 and on the MTP hidden state that predicted it.

```python
target = AutoModelForCausalLM.from_pretrained(target_path)
dmtp = DMTPDraftModel.from_pretrained(draft_path, target=target)   # binds the native MTP head
out = target.generate(**inputs, assistant_model=dmtp, max_new_tokens=256)
```
"""

from transformers import AutoConfig, AutoModel

from .assistant import (
    DFlashDrafter,
    DMTPCandidateGenerator,
    DMTPDrafter,
    DMTPGenerateOutput,
    MTPDrafter,
    SpecStats,
    dmtp_custom_generate,
    generate,
    generate_with_transformers_loop,
    install_generate_router,
    route_bound_targets,
    speculative_decode,
)
from .modeling import (
    DMTPConfig,
    DMTPDraftModel,
    MissingMTPTensorsError,
    NativeMTPHead,
    NoNativeMTPError,
    UnsupportedMTPFamilyError,
    load_native_mtp,
)

__version__ = "0.1.0.dev0"

AutoConfig.register(DMTPConfig.model_type, DMTPConfig, exist_ok=True)
AutoModel.register(DMTPConfig, DMTPDraftModel, exist_ok=True)
# Binding a draft to a target routes that target's `generate(assistant_model=...)` into the engine (router.py).
route_bound_targets()

__all__ = [
    "DFlashDrafter",
    "DMTPCandidateGenerator",
    "DMTPConfig",
    "DMTPDraftModel",
    "DMTPDrafter",
    "DMTPGenerateOutput",
    "MTPDrafter",
    "MissingMTPTensorsError",
    "NativeMTPHead",
    "NoNativeMTPError",
    "SpecStats",
    "UnsupportedMTPFamilyError",
    "__version__",
    "dmtp_custom_generate",
    "generate",
    "generate_with_transformers_loop",
    "install_generate_router",
    "load_native_mtp",
    "speculative_decode",
]
