"""Draft vocabularies (EAGLE-3's ``d2t``/``t2d``): the mapping, the checkpoint, lossless decoding, training."""

from __future__ import annotations

import pytest
import torch
from conftest import draft_for
from test_fast_path import Recorder
from test_lossless import TEMPERATURE, chi_square_p, exact_distribution, sample_rejection
from test_training import target_dir  # noqa: F401  (a saved tiny target, for the trainer)

from dmtp_hf import DMTPDraftModel
from dmtp_hf.assistant import DFlashDrafter, DMTPDrafter, speculative_decode
from dmtp_hf.modeling.draft_vocab import (
    IGNORE_INDEX,
    coverage,
    draft_token_ids,
    frequency_ranked_vocabulary,
    set_draft_vocabulary,
    to_draft_ids,
)


def test_mapping_is_eagle3s_layout_and_inverts():
    """``target = draft + d2t[draft]``, ``t2d`` marks the subset, labels outside it are ignored."""
    draft = DMTPDraftModel.__new__(DMTPDraftModel)  # only the buffers matter here
    torch.nn.Module.__init__(draft)
    from dmtp_hf.modeling.draft_vocab import register_draft_vocabulary

    register_draft_vocabulary(draft, 4, 10)
    set_draft_vocabulary(draft, [7, 2, 9, 3])
    assert draft.d2t.tolist() == [2, 2, 5, 6]  # ids 2, 3, 7, 9
    assert draft_token_ids(draft).tolist() == [2, 3, 7, 9]
    assert draft.t2d.nonzero().flatten().tolist() == [2, 3, 7, 9]
    assert to_draft_ids(draft, torch.tensor([9, 2, 4, 7])).tolist() == [3, 0, IGNORE_INDEX, 2]
    assert coverage(draft, [[2, 3, 4, 5]]) == 0.5
    with pytest.raises(ValueError, match="holds 4 tokens"):
        set_draft_vocabulary(draft, [1, 2, 3])


def test_frequency_ranking_keeps_the_always_tokens_and_reports_coverage():
    ids, stats = frequency_ranked_vocabulary([[5, 5, 5, 6, 6, 7], [5, 8]], size=3, vocab_size=10, always=[1])
    assert ids == [1, 5, 6]  # EOS first, then by count (ties by id)
    assert stats["coverage"] == pytest.approx(6 / 8)
    padded, _ = frequency_ranked_vocabulary([[4]], size=3, vocab_size=10)
    assert padded == [0, 1, 4]  # fewer distinct tokens than the size: filled by id


def test_subset_logits_are_the_full_heads_rows_and_scatter_with_minus_inf(targets):
    target = targets["deepseek_v3"]
    vocab = target.config.vocab_size
    full = draft_for(target)
    pruned = draft_for(target, draft_vocab_size=vocab // 4)
    pruned.load_state_dict(full.state_dict(), strict=False)
    set_draft_vocabulary(pruned, torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 4])
    hidden = torch.randn(2, 3, target.config.hidden_size)
    ids = draft_token_ids(pruned)
    reference = full.compute_logits(hidden)
    torch.testing.assert_close(pruned.compute_logits(hidden, subset=True), reference[..., ids])
    scattered = pruned.compute_logits(hidden)
    assert scattered.shape == reference.shape
    torch.testing.assert_close(scattered[..., ids], reference[..., ids])
    assert torch.isneginf(scattered[..., ~pruned.t2d]).all()


def test_checkpoint_round_trip_keeps_the_vocabulary_and_refuses_a_missing_one(tmp_path, targets):
    target = targets["qwen3_5"]
    draft = draft_for(target, draft_vocab_size=40)
    set_draft_vocabulary(draft, range(10, 50))
    draft.save_pretrained(tmp_path / "d")
    loaded = DMTPDraftModel.from_pretrained(tmp_path / "d")
    assert loaded.config.draft_vocab_size == 40
    assert torch.equal(loaded.d2t, draft.d2t) and torch.equal(loaded.t2d, draft.t2d)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(tmp_path / "d" / "model.safetensors"))
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool  # EAGLE-3's top-level keys
    save_file({k: v for k, v in weights.items() if k != "d2t"}, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        DMTPDraftModel.from_pretrained(tmp_path / "d")


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5"])
def test_greedy_output_is_plain_generates_with_a_draft_vocabulary(targets, family):
    """The target verifies over its whole vocabulary: a draft confined to a subset only loses acceptance."""
    target = targets[family]
    prompt = torch.tensor([[5, 17, 42, 9], [1, 5, 17, 42]])
    reference = target.generate(prompt, do_sample=False, max_new_tokens=24)
    plain = target.generate(prompt[:1], do_sample=False, max_new_tokens=24)
    used = torch.unique(reference)
    for layout in ["dual", "dflash"]:
        extra = {"anchor_layout": layout, "fusion": "none"} if layout == "dflash" else {}
        draft = draft_for(target, draft_vocab_size=used.numel(), **extra)
        set_draft_vocabulary(draft, used)  # the reference's own tokens: drafts can be accepted
        drafter = Recorder(DMTPDrafter(draft, draft.native_mtp) if layout == "dual" else DFlashDrafter(draft))
        out, stats = speculative_decode(target, prompt[:1], drafter, max_length=plain.shape[1])
        assert torch.equal(out, plain), layout
        # the draft's own candidates (DMTP: T2.., T1 is the native head's) are subset tokens, mapped to target ids
        first = 1 if layout == "dual" else 0
        assert drafter.proposals and all(torch.isin(p[:, first:], used).all() for p in drafter.proposals)
        out = target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=24)
        assert torch.equal(out, reference), layout


def test_sampled_output_keeps_the_targets_distribution_with_a_pruned_q(vocab6):
    """Rejection sampling with a draft over 3 of 6 tokens (q = 0 on the others): exact in distribution."""
    target, prompt, steps, runs = vocab6, torch.tensor([[1, 2, 0]]), 2, 700
    draft = draft_for(
        target, anchor_layout="dflash", fusion="none", num_candidates=3, target_layer_ids=[0], draft_vocab_size=3
    )
    set_draft_vocabulary(draft, [0, 2, 4])
    exact = exact_distribution(target, prompt, steps, TEMPERATURE)
    counts, accepted = sample_rejection(target, prompt, DFlashDrafter(draft), steps, runs, seed=5)
    assert accepted > runs // 20
    assert chi_square_p(counts, exact, runs) > 1e-3
    assert any(token in (1, 3, 5) for key in counts for token in key)  # tokens outside the subset still come out


@pytest.mark.parametrize("backbone", ["dflash", "dflash2"])
def test_training_from_scratch_builds_the_vocabulary_from_the_answers(tmp_path, target_dir, backbone):  # noqa: F811
    """``draft_config.draft_vocab_size``: the subset is the training answers' most frequent tokens (EOS in), the
    loss is finite (DFlash2: its selector's too, over the subset's top-k), and the exported checkpoint carries the
    mapping."""
    from test_dflash2 import SELECTOR
    from test_training import make_config, random_dataset

    from dmtp_hf.assistant.target.loading import load_target
    from dmtp_hf.training import Trainer

    config = make_config(tmp_path, max_steps=2, save_every=2)
    config.draft_config["draft_vocab_size"] = 24
    if backbone == "dflash2":
        config.draft_config.update(backbone="dflash2", dflash_config=dict(SELECTOR))
    data = random_dataset(8, 24)
    trainer = Trainer(config, target=load_target(target_dir), train_dataset=data)
    answers = torch.cat([item["input_ids"][item["loss_mask"].bool()] for item in data])
    most_common = torch.bincount(answers).argmax()
    assert trainer.draft.t2d[most_common] and int(trainer.draft.t2d.sum()) == 24
    assert 0 < trainer.draft_vocab_stats["coverage"] <= 1
    trainer.train()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.history if "loss" in h)
    final = DMTPDraftModel.from_pretrained(tmp_path / "run" / "final")
    assert torch.equal(final.t2d, trainer.draft.t2d.cpu())


def test_a_retrofitted_head_over_a_draft_vocabulary_round_trips_and_stays_lossless(tmp_path, targets):
    """An MTP head may predict over a subset too (``mtp_draft_vocab_size``): its logits are the LM head's rows of the
    subset (``-inf`` elsewhere), its head checkpoint keeps the mapping, a target export refuses it, and DMTP with it
    is still plain ``generate``."""
    from dmtp_hf.modeling.native_mtp import export_mtp_into_target, load_native_mtp, new_mtp_head, save_mtp_head

    target = targets["qwen3_5"]
    vocab = target.config.vocab_size
    head = new_mtp_head(target)
    g = torch.randn(2, 3, target.config.hidden_size)
    full = head.logits(g)
    subset = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[: vocab // 3]
    head.use_draft_vocabulary(subset.numel())
    set_draft_vocabulary(head, subset)
    ids = draft_token_ids(head)
    torch.testing.assert_close(head.logits(g, subset=True), full[..., ids])
    scattered = head.logits(g)
    torch.testing.assert_close(scattered[..., ids], full[..., ids])
    assert torch.isneginf(scattered[..., ~head.t2d]).all()

    save_mtp_head(head, tmp_path / "head", target)
    loaded = load_native_mtp(target, checkpoint=tmp_path / "head")
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    torch.testing.assert_close(loaded.logits(g), scattered)
    with pytest.raises(ValueError, match="draft vocabulary"):
        export_mtp_into_target(loaded, target.config._name_or_path, tmp_path / "exported")

    prompt = torch.tensor([[5, 17, 42, 9]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=16)
    draft = draft_for(target).bind(target, native_mtp=loaded)
    drafter = Recorder(DMTPDrafter(draft, loaded))
    out, _ = speculative_decode(target, prompt, drafter, max_length=plain.shape[1])
    assert torch.equal(out, plain)
    assert all(torch.isin(p[:, :1], ids).all() for p in drafter.proposals)  # T1: the head's subset only


def test_head_training_builds_its_vocabulary_and_saves_it(tmp_path, target_dir):  # noqa: F811
    from test_training import make_config

    from dmtp_hf.assistant.target.loading import load_target
    from dmtp_hf.modeling.native_mtp import load_native_mtp
    from dmtp_hf.training import Trainer, synthetic_greedy_dataset

    target = load_target(target_dir)
    data = synthetic_greedy_dataset(target, 16, 16, seed=3)
    config = make_config(
        tmp_path,
        target_model=str(target_dir),
        train_mtp_head="only",
        max_steps=2,
        save_every=2,
        mtp_draft_vocab_size=20,
        output_dir=str(tmp_path / "head"),
    )
    trainer = Trainer(config, target=target, train_dataset=data)
    assert int(trainer.mtp_head.t2d.sum()) == 20 and 0 < trainer.head_vocab_stats["coverage"] <= 1
    trainer.train()
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.history if "loss" in h)
    saved = load_native_mtp(target, checkpoint=tmp_path / "head" / "final_mtp_head")
    assert torch.equal(saved.t2d, trainer.mtp_head.t2d.cpu())
    with pytest.raises(ValueError, match="mtp_draft_vocab_size"):
        make_config(tmp_path, target_model=str(target_dir), mtp_draft_vocab_size=20)  # a frozen head


def test_a_new_vocabulary_of_another_size_replaces_the_cached_head_rows(targets):
    target = targets["qwen3_5"]
    from dmtp_hf.modeling.native_mtp import new_mtp_head

    head = new_mtp_head(target)
    g = torch.randn(1, target.config.hidden_size)
    full = head.logits(g)
    for size in (8, 16):  # the second vocabulary must not reuse the first's gathered rows
        head.use_draft_vocabulary(size)
        set_draft_vocabulary(head, range(size))
        torch.testing.assert_close(head.logits(g, subset=True), full[..., :size])


def test_a_dflash2_draft_over_a_draft_vocabulary_walks_subset_tokens_and_stays_lossless(targets):
    """DFlash2's walk picks among the top-k of the subset's logits: every candidate a subset token, output plain."""
    from test_dflash2 import dflash2_draft

    target = targets["qwen3_5"]
    prompt = torch.tensor([[5, 17, 42, 9]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=16)
    subset = torch.unique(torch.cat([plain[0], torch.arange(0, target.config.vocab_size, 3)]))
    for layout in ({"anchor_layout": "dflash", "fusion": "none"}, {}):
        draft = dflash2_draft(target, draft_vocab_size=subset.numel(), **layout)
        set_draft_vocabulary(draft, subset)
        drafter = DFlashDrafter(draft) if layout else DMTPDrafter(draft, draft.native_mtp)
        recorder = Recorder(drafter)
        out, _ = speculative_decode(target, prompt, recorder, max_length=plain.shape[1])
        assert torch.equal(out, plain), layout
        first = 0 if layout else 1  # DMTP's T1 is the native head's
        assert recorder.proposals and all(torch.isin(p[:, first:], subset).all() for p in recorder.proposals)


def test_engine_folders_carry_the_vocabularys_lm_head_rows_and_the_vllm_folder_the_head(tmp_path, targets):
    """A DFlash folder of a draft with a vocabulary holds the target LM head's rows of that vocabulary (vLLM keeps
    the first rows of a shared head otherwise), and refuses to be written unbound; the vLLM DMTP folder holds the
    DFlash tensors, the fusion, the head (with its own vocabulary's rows and ids) and the captured layers."""
    import json

    from safetensors.torch import load_file

    from dmtp_hf.modeling.engine_export import save_vllm_draft
    from dmtp_hf.modeling.native_mtp import new_mtp_head

    target = targets["qwen3_5"]
    vocab, layers = target.config.vocab_size, target.config.num_hidden_layers
    generator = torch.Generator().manual_seed(2)
    head = new_mtp_head(target)
    head.use_draft_vocabulary(vocab // 2)
    set_draft_vocabulary(head, torch.randperm(vocab, generator=generator)[: vocab // 2])
    draft = draft_for(target, draft_vocab_size=vocab // 4)
    set_draft_vocabulary(draft, torch.randperm(vocab, generator=generator)[: vocab // 4])
    dflash = draft_for(target, draft_vocab_size=vocab // 4, anchor_layout="dflash", fusion="none")
    set_draft_vocabulary(dflash, draft_token_ids(draft))
    dflash.save_pretrained(tmp_path / "dmtp-layout")
    with pytest.raises(ValueError, match="bind the draft first"):
        DMTPDraftModel.from_pretrained(tmp_path / "dmtp-layout").save_dflash(tmp_path / "unbound")
    dflash.save_dflash(tmp_path / "dflash")
    rows = target.get_output_embeddings().weight.detach()
    saved = load_file(tmp_path / "dflash" / "model.safetensors")
    assert torch.equal(saved["lm_head.weight"], rows[draft_token_ids(dflash)])

    draft.bind(target, native_mtp=head)
    save_vllm_draft(draft, head, tmp_path / "vllm")
    saved = load_file(tmp_path / "vllm" / "model.safetensors")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDMTPDraftModel"] and config["model_type"] == "qwen3"
    # the features end at the target's last layer (target_layer_ids [0, N - 1]): vLLM captures it once
    assert draft.config.target_layer_ids[-1] == layers - 1
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in draft.config.target_layer_ids]
    assert config["dmtp_config"]["mtp"]["draft_vocab_size"] == vocab // 2
    assert torch.equal(saved["lm_head.weight"], rows[draft_token_ids(draft)])
    assert torch.equal(saved["mtp.lm_head.weight"], rows[draft_token_ids(head)])
    assert torch.equal(saved["mtp.token_ids"], draft_token_ids(head))
    assert torch.equal(saved["fusion.proj.weight"], draft.fusion.proj.weight)
    assert torch.equal(saved["mtp.projection.weight"], head.projection.weight)
    assert not any(k.startswith("fusion.") for k in load_file(tmp_path / "dflash" / "model.safetensors"))
