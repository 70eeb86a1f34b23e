"""Which ``generate`` options speculative decoding keeps and which it refuses, decided before any work.

Every option either keeps its plain-``generate`` meaning exactly (tested against plain ``generate``:
docs/generate-options.md has the whole table) or is refused here with a message that names it and says what to do
instead. Nothing is ignored silently: that includes the options of Transformers' own assisted decoding
(``num_assistant_tokens``, ``assistant_confidence_threshold``, ...), which size a drafter this engine does not run;
they are refused when set to anything but Transformers' defaults (which ``generate`` fills in for every call).
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

__all__ = ["REFUSED_OPTIONS", "check_generate_options"]

# Inside `generate` Transformers fills every unset field with these, so a call that never named an option still
# shows its default to `dmtp_custom_generate`: only a value other than the default can be the caller's.
_TRANSFORMERS_DEFAULTS = GenerationConfig._get_default_generation_params()


def _set_to_other_than_default(name: str):
    """Whether a value of option ``name`` was set to something else than Transformers' default (None: unset)."""
    default = _TRANSFORMERS_DEFAULTS.get(name)
    return lambda value: value is not None and value != default


# What Transformers' own assisted decoding reads to size and stop its drafter's rounds. A DMTP round drafts the
# draft's K candidates in one pass and verifies them (or `verify_length` of them) in one target forward: these would
# change nothing, and "nothing is ignored" (docs/generate-options.md).
_ASSISTED_DECODING = (
    "Transformers' own assisted decoding sizes its drafter's rounds with it; a DMTP round drafts the draft's K "
    "candidates in one pass, so it would change nothing. For fewer draft tokens per round pass "
    "dmtp_hf.generate(..., verify_length=N) (a fixed width, at most K) or verify_length='auto'"
)

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
    "num_assistant_tokens": (_set_to_other_than_default("num_assistant_tokens"), _ASSISTED_DECODING),
    "num_assistant_tokens_schedule": (_set_to_other_than_default("num_assistant_tokens_schedule"), _ASSISTED_DECODING),
    "assistant_confidence_threshold": (
        _set_to_other_than_default("assistant_confidence_threshold"),
        "Transformers' own assisted decoding stops drafting when its drafter's confidence falls below it; a DMTP "
        "round drafts all K candidates in one pass, so it would change nothing. verify_length='auto' "
        "(dmtp_hf.generate) verifies, per round, as many candidates as the draft's calibrated confidence pays for",
    ),
    "assistant_lookbehind": (
        _set_to_other_than_default("assistant_lookbehind"),
        "it aligns a drafter with another tokenizer (universal assisted decoding); a DMTP draft reads the target's "
        "own tokens, so it would change nothing: drop it",
    ),
    "target_lookbehind": (
        _set_to_other_than_default("target_lookbehind"),
        "it aligns a drafter with another tokenizer (universal assisted decoding); a DMTP draft reads the target's "
        "own tokens, so it would change nothing: drop it",
    ),
    "max_matching_ngram_size": (
        lambda v: v is not None,
        "it sizes prompt lookup (prompt_lookup_num_tokens), another drafter, so it would change nothing: drop it",
    ),
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
