"""Which ``generate`` options speculative decoding keeps and which it refuses, decided before any work.

Every option either keeps its plain-``generate`` meaning exactly (tested against plain ``generate``:
docs/generate-options.md has the whole table) or is refused here with a message that names it and says what to do
instead. Nothing is ignored silently.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REFUSED_OPTIONS", "check_generate_options"]

# option -> (is it in use?, why it cannot be exact, what to do instead)
REFUSED_OPTIONS: dict[str, tuple[Any, str]] = {
    "num_beam_groups": (lambda v: v is not None and v > 1, "group beam search is beam search: see num_beams"),
    "constraints": (lambda v: bool(v), "constrained beam search is beam search: see num_beams"),
    "force_words_ids": (lambda v: bool(v), "force_words_ids selects constrained beam search: see num_beams"),
    "num_beams": (
        lambda v: v is not None and v > 1,
        "beam search keeps several hypotheses per row; speculative decoding verifies one continuation (stock "
        "Transformers refuses assisted beam search too). Decode greedily or by sampling, or call generate without "
        "assistant_model for beam search",
    ),
    "penalty_alpha": (
        lambda v: v is not None and v > 0,
        "contrastive search rescores top-k candidates with the model's hidden states at every step; decode without "
        "penalty_alpha, or without assistant_model",
    ),
    "dola_layers": (lambda v: v is not None, "DoLa contrasts layers at every step; drop dola_layers"),
    "guidance_scale": (
        lambda v: v is not None and v != 1,
        "classifier-free guidance runs a second, stateful forward of the target one token at a time; drop "
        "guidance_scale, or call generate without assistant_model",
    ),
    "prompt_lookup_num_tokens": (
        lambda v: v is not None,
        "prompt lookup is another drafter: pass either prompt_lookup_num_tokens or assistant_model",
    ),
    "use_mtp": (
        lambda v: bool(v),
        "use_mtp=True is Transformers' own MTP drafting: to draft with the MTP head alone pass the head (or "
        "dmtp_hf.generate(..., strategy='mtp')) as the assistant instead",
    ),
    "assistant_early_exit": (lambda v: v is not None, "early-exit drafting is another drafter: drop it"),
    "output_attentions": (
        lambda v: bool(v),
        "a verify attends over K + 1 positions at once, so per-step attention maps as plain generate returns "
        "them do not exist; decode without assistant_model to inspect attentions",
    ),
    "output_hidden_states": (
        lambda v: bool(v),
        "hidden states are computed for K + 1 positions per verify and partly discarded; decode without "
        "assistant_model to inspect them",
    ),
}


def check_generate_options(target, kwargs: dict[str, Any]) -> None:
    """Refuse, naming the option, any ``generate`` argument (or ``generation_config`` / the target's generation
    config field) that speculative decoding cannot honour exactly; also ``inputs_embeds``."""
    if kwargs.get("inputs_embeds") is not None:
        raise ValueError(
            "inputs_embeds is not supported with assistant_model: a speculative round feeds token ids (the draft "
            "reads the target's own embeddings of them). Pass input_ids."
        )
    config = kwargs.get("generation_config") or getattr(target, "generation_config", None)
    for name, (in_use, why) in REFUSED_OPTIONS.items():
        value = kwargs[name] if name in kwargs else getattr(config, name, None)
        if in_use(value):
            raise ValueError(f"{name}={value!r} is not supported with assistant_model: {why}.")
