"""A conversation continued with its cache: each turn passes the previous turn's cache and the whole conversation so
far, as chat applications do with plain ``generate``. The engine prefills only the uncached tail and leaves the cache
as plain ``generate`` leaves it, so every turn is token-identical to plain ``generate`` turn after turn, on a hybrid
linear-attention target (Qwen3.5) and a full-attention one (DeepSeek-V3), at batch size 1 and 2; sampled turns keep
the target's distribution.
"""

import pytest
import torch
from conftest import draft_for
from test_lossless import TEMPERATURE, chi_square_p, exact_distribution
from transformers import StaticCache

from dmtp_hf.assistant import DMTPDrafter, MTPDrafter, speculative_decode
from dmtp_hf_assets.tiny_targets import load_tiny_target, make_tiny_target


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per family: the tiny target and a DMTP draft bound to its native MTP head."""
    out = {}
    for family in ("qwen3_5", "deepseek_v3"):
        target = load_tiny_target(make_tiny_target(family, tmp_path_factory.mktemp(family)))
        out[family] = (target, draft_for(target, num_candidates=4))
    return out


def new_tokens(rows: int, length: int, seed: int, vocab: int) -> torch.Tensor:
    """A user turn: ``[rows, length]`` random token ids."""
    return torch.randint(3, vocab - 2, (rows, length), generator=torch.Generator().manual_seed(seed))


def conversation(
    target, assistant, rows: int, turns: int = 3, cache=None, **generate_kwargs
) -> list[tuple[torch.Tensor, int]]:
    """``turns`` turns, each continuing the previous turn's cache: per turn, (sequences, cache length after it).

    Turn 1 is a left-padded batch (rows of different lengths) and starts ``cache`` (``None``: the one ``generate``
    makes); every later turn appends a user turn to the whole conversation so far, with the attention mask plain
    ``generate`` implies (generated tokens visible)."""
    vocab = target.config.get_text_config().vocab_size
    ids = new_tokens(rows, 9, 0, vocab)
    mask = torch.ones_like(ids)
    if rows > 1:
        ids[1, :4], mask[1, :4] = 0, 0  # row 1 is shorter: left padding
    kwargs, out = dict(generate_kwargs), []
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    for turn in range(turns):
        result = target.generate(ids, attention_mask=mask, cache=cache, return_dict_in_generate=True, **kwargs)
        cache = result.cache
        out.append((result.sequences, int(cache.get_seq_length())))
        user = new_tokens(rows, 3 + turn, 100 + turn, vocab)
        generated = result.sequences.shape[1] - ids.shape[1]
        mask = torch.cat([mask, torch.ones(rows, generated + user.shape[1], dtype=mask.dtype)], dim=1)
        ids = torch.cat([result.sequences, user], dim=1)
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
@pytest.mark.parametrize("rows", [1, 2])
def test_three_turns_each_continuing_the_cache_equal_plain_generate(models, family, rows):
    target, draft = models[family]
    greedy = dict(do_sample=False, max_new_tokens=12)
    plain = conversation(target, None, rows, **greedy)
    # an EOS that row 0 produces early in plain decoding: rows then finish at different turns' steps (padding after
    # EOS is part of the conversation plain generate continues)
    eos = int(plain[0][0][0, -8])
    plain = conversation(target, None, rows, eos_token_id=eos, pad_token_id=0, **greedy)
    ours = conversation(target, draft, rows, eos_token_id=eos, pad_token_id=0, **greedy)
    for turn, ((plain_ids, plain_cached), (our_ids, our_cached)) in enumerate(zip(plain, ours, strict=True)):
        assert torch.equal(our_ids, plain_ids), f"turn {turn + 1}"
        assert our_cached == plain_cached, f"turn {turn + 1}: the cache holds {our_cached}, plain's {plain_cached}"
    assert any((ids == eos).any() for ids, _ in plain)  # some turn really stopped a row at EOS


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_three_turns_continuing_a_static_cache_equal_plain_generate(models, family):
    """A ``StaticCache`` continued turn after turn (batch size 1) by every drafting strategy and width: the prefill
    of a later turn reads how many tokens the cache holds, which a static layer keeps in a tensor the prefill itself
    advances. Static caches at batch size 2 are refused by name."""
    target, draft = models[family]
    greedy = dict(do_sample=False, max_new_tokens=12, pad_token_id=0)

    def static_cache() -> StaticCache:
        return StaticCache(config=target.config, max_cache_len=128)

    eos = int(conversation(target, None, 1, turns=1, cache=static_cache(), **greedy)[0][0][0, -8])  # row 0 ends early
    plain = conversation(target, None, 1, cache=static_cache(), eos_token_id=eos, **greedy)
    assistants = {
        "dmtp": (draft, None),
        "mtp": (MTPDrafter(draft.native_mtp, 2), "auto"),
        "dflash": (draft_for(target, anchor_layout="dflash", num_candidates=4), 0),
    }
    for name, (assistant, width) in assistants.items():
        ours = conversation(
            target, assistant, 1, cache=static_cache(), eos_token_id=eos, dmtp_verify_length=width, **greedy
        )
        for turn, ((plain_ids, plain_cached), (our_ids, our_cached)) in enumerate(zip(plain, ours, strict=True)):
            assert torch.equal(our_ids, plain_ids), f"{name}, turn {turn + 1}"
            assert our_cached == plain_cached, f"{name}, turn {turn + 1}: {our_cached} cached, plain {plain_cached}"
    with pytest.raises(NotImplementedError, match="batch size 1"):
        conversation(target, draft, 2, turns=1, cache=static_cache(), **greedy)


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3"])
def test_a_sampled_turn_after_a_cached_prefix_has_the_targets_distribution(tmp_path, family):
    """The cache holds the conversation's first 2 tokens (a plain prefill); each run samples 2 tokens after the
    5-token prompt with rejection verification: the continuations follow the target's exact distribution."""
    target = load_tiny_target(make_tiny_target(family, tmp_path / family, vocab_size=6))
    with torch.no_grad():
        target.lm_head.weight.mul_(6.0)
    target.generation_config.eos_token_id = None
    draft = draft_for(target, num_candidates=3, num_hidden_layers=1, target_layer_ids=[0])
    drafter = DMTPDrafter(draft, draft.native_mtp)
    prompt, steps, runs = torch.tensor([[1, 2, 0, 3, 4]]), 2, 400
    exact = exact_distribution(target, prompt, steps, TEMPERATURE)
    counts, accepted = {}, 0
    torch.manual_seed(7)
    for _ in range(runs):
        with torch.no_grad():
            cache = target(prompt[:, :2], use_cache=True).past_key_values
        out, stats = speculative_decode(
            target,
            prompt,
            drafter,
            max_length=prompt.shape[1] + steps,
            do_sample=True,
            logits_processor=TEMPERATURE,
            verify_mode="rejection",
            cache=cache,
        )
        assert cache.get_seq_length() == prompt.shape[1] + steps - 1  # the tail only was prefilled
        key = tuple(out[0, prompt.shape[1] :].tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(stats.hist[1:]) > 0
    assert accepted > runs // 20
    assert chi_square_p(counts, exact, runs) > 1e-3


def test_a_cache_holding_the_whole_prompt_is_refused_by_name(models):
    target, draft = models["deepseek_v3"]
    ids = new_tokens(1, 6, 0, target.config.vocab_size)
    with torch.no_grad():
        cache = target(ids, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="already holds 6 positions, but input_ids has 6 tokens"):
        target.generate(ids, cache=cache, assistant_model=draft, max_new_tokens=4, do_sample=False)
