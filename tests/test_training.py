"""Training: data rendering, features, objective, trainer (resume, DDP equivalence, DFlash init, LoRA, frozen parts).

Everything runs on the tiny qwen3_5 target (vocab 128, hidden 32, 2 layers, random native MTP head).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.utils import set_seed
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tk_decoders
from transformers import PreTrainedTokenizerFast

from dmtp_hf import DMTPDraftModel
from dmtp_hf.assistant.target.loading import freeze, load_target
from dmtp_hf.modeling import load_native_mtp
from dmtp_hf.training import (
    ChatRenderer,
    DMTPTrainingObjective,
    FeatureExtractor,
    OfflineFeatureDataset,
    StepSchedule,
    TokenizedDataset,
    TrainConfig,
    Trainer,
    anchor_scores,
    build_attention_masks,
    build_draft,
    collate,
    extract_features,
    load_dataset_records,
    plan_blocks,
    regenerate,
    summarize_metrics,
)
from dmtp_hf.training.features import precompute_features
from dmtp_hf.training.regenerate import completed_ids
from dmtp_hf_assets.tiny_targets import make_tiny_target

REPO = Path(__file__).resolve().parents[1]
VOCAB, MASK = 128, 127


pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models are overhead-bound


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_target("qwen3_5", tmp_path_factory.mktemp("tiny") / "qwen3_5")


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


@pytest.fixture(scope="module")
def mtp_head(target):
    return freeze(load_native_mtp(target))


def random_dataset(num: int, length: int, seed: int = 0, prompt: int = 0) -> TokenizedDataset:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(num):
        mask = torch.ones(length, dtype=torch.long)
        mask[:prompt] = 0
        samples.append({"input_ids": torch.randint(0, VOCAB - 1, (length,), generator=g), "loss_mask": mask})
    return TokenizedDataset(samples)


def make_config(tmp_path, **overrides) -> TrainConfig:
    values = dict(
        target_model="unused",
        anchor_layout="dual",
        fusion="residual",
        draft_config=dict(mask_token_id=MASK, target_layer_ids=[0, 1], num_hidden_layers=1, intermediate_size=64),
        train_data="unused",
        max_length=32,
        num_anchors=8,
        micro_batch_size=4,
        max_steps=4,
        learning_rate=3e-3,
        warmup_ratio=0.1,
        output_dir=str(tmp_path / "run"),
        save_every=0,
        eval_every=0,
        report_to="none",
        resume_from=None,
        log_every=1,
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


def draft_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------------------------------
# Data


QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
GENERATION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ message['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tokenizer():
    """A ~100-token BPE tokenizer (fits the tiny target's 128-row vocabulary) with a Qwen-style chat template."""
    tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = tk_decoders.Metaspace()
    corpus = ["hello there how are you", "the cat sat on the mat", "user assistant system", "I am fine thanks"] * 10
    alphabet = list("abcdefghijklmnopqrstuvwxyzIH?!.,\n") + ["▁"]
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=SPECIALS, initial_alphabet=alphabet)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN_TEMPLATE
    )
    assert len(fast) <= MASK
    return fast


CHAT = [
    {"role": "system", "content": "be nice"},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "hi how are you"},
    {"role": "user", "content": "fine"},
    {"role": "assistant", "content": "the cat sat"},
]


def supervised_text(tokenizer, sample) -> str:
    ids = sample["input_ids"][sample["loss_mask"].bool()]
    return tokenizer.decode(ids, skip_special_tokens=False).replace("▁", " ")


@pytest.mark.parametrize("thinking", [None, False])
def test_incremental_mask_covers_assistant_turns_and_end_of_turn_only(tokenizer, thinking):
    renderer = ChatRenderer(tokenizer, enable_thinking=thinking)
    assert renderer.mask_strategy == "incremental"
    sample = renderer(CHAT)
    text, spans = renderer.assistant_char_spans(CHAT)
    assert [text[s:e] for s, e in spans] == ["hi how are you<|im_end|>\n", "the cat sat<|im_end|>\n"]
    got = supervised_text(tokenizer, sample)
    for word in ["hi", "how", "are", "you", "cat", "sat"]:
        assert word in got
    assert got.count("<|im_end|>") == 2  # end of each assistant turn
    for header in ["<|im_start|>", "assistant", "user", "hello", "fine", "nice"]:
        assert header not in got
    # token level: every supervised token lies inside an assistant span, and the header tokens are not supervised
    ids, mask = sample["input_ids"], sample["loss_mask"].bool()
    im_start, im_end = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert not mask[ids == im_start].any()
    assert mask[ids == im_end].sum() == 2 and (~mask[ids == im_end]).sum() == 3  # system/user turns unsupervised
    if thinking is False:  # the template's empty think block belongs to the prompt header, not the response
        assert "<think>" not in got


def test_generation_template_mask_matches_incremental(tokenizer):
    gen_tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=GENERATION_TEMPLATE,
    )
    generation = ChatRenderer(gen_tok)
    assert generation.mask_strategy == "generation"
    incremental = ChatRenderer(gen_tok, mask_strategy="incremental")
    a, b = generation(CHAT), incremental(CHAT)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["loss_mask"], b["loss_mask"])
    assert a["loss_mask"].sum() > 0


def test_jsonl_formats_and_errors(tmp_path, tokenizer):
    path = tmp_path / "data.jsonl"
    sharegpt = {"conversations": [{"from": "human", "value": "hello"}, {"from": "gpt", "value": "the cat sat"}]}
    openai = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "the cat sat"}]}
    tokenized = {"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}
    path.write_text("\n".join(json.dumps(r) for r in [sharegpt, openai, tokenized]) + "\n")
    data = load_dataset_records(path, tokenizer=tokenizer, max_length=64)
    assert len(data) == 3
    assert torch.equal(data[0]["input_ids"], data[1]["input_ids"])  # same conversation, both formats
    assert torch.equal(data[0]["loss_mask"], data[1]["loss_mask"])
    assert data[2]["input_ids"].tolist() == [1, 2, 3, 4]

    path.write_text(json.dumps(openai) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"data.jsonl:2: invalid JSON"):
        load_dataset_records(path, tokenizer=tokenizer)
    path.write_text(json.dumps(openai) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl:2: turn 0 has unknown role 'robot'"):
        load_dataset_records(path, tokenizer=tokenizer)
    path.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"data.jsonl:1: no 'messages' or 'conversations'"):
        load_dataset_records(path, tokenizer=tokenizer)


def test_regenerate_is_batched_greedy_and_resumable(tmp_path, tokenizer, target):
    source = tmp_path / "in.jsonl"
    records = [
        {"id": "a", "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "old"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "the cat"}]},
        {
            "id": "c",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "x"},
                {"role": "user", "content": "how are you"},
                {"role": "assistant", "content": "y"},
            ],
        },
    ]
    source.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    out = tmp_path / "out.jsonl"
    assert regenerate(target, tokenizer, source, out, batch_size=2, max_new_tokens=4, limit=2, progress=False) == 2
    with open(out, "a") as f:
        f.write('{"id": "c", "messa')  # a killed run leaves a partial line
    assert completed_ids(out) == {"a", "b"}
    assert regenerate(target, tokenizer, source, out, batch_size=2, max_new_tokens=4, progress=False) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b", "c"]
    assert [m["role"] for m in rows[2]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert rows[2]["messages"][1]["content"] != "x" and rows[1]["messages"][-1]["role"] == "assistant"
    # greedy: the first assistant turn of 'c' equals an unbatched greedy generation from the target
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    ref = target.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert rows[2]["messages"][1]["content"] == tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------------
# Objective


def tiny_draft(target, layout="dual", fusion="residual", seed=0, **kw) -> DMTPDraftModel:
    config = make_config(Path("/tmp"), anchor_layout=layout, fusion=fusion)
    torch.manual_seed(seed)
    draft = build_draft(config, target)
    if draft.fusion is not None:
        with torch.no_grad():
            for p in draft.fusion.parameters():
                p.add_(torch.randn_like(p) * 0.05)  # non-zero fusion so that fusion bugs change the loss
    return draft


@pytest.mark.parametrize("layout", ["dflash", "single", "dual"])
def test_block_plan_labels_weights_and_anchor_validity(layout, target):
    config = tiny_draft(target, layout, "none" if layout == "dflash" else "residual").config
    ids = torch.arange(20)[None].repeat(2, 1) + 100  # token = 100 + position
    loss_mask = torch.ones_like(ids)
    loss_mask[0, :6] = 0  # prompt
    loss_mask[1, 12:] = 0  # padding
    plan = plan_blocks(ids, loss_mask, anchor_scores(0, 0, 2, 20), config, num_anchors=50, loss_decay_gamma=4.0)
    anchors, keep = plan.anchors, plan.keep
    kept0, kept1 = anchors[0][keep[0]], anchors[1][keep[1]]
    low = 0 if layout == "dflash" else 1
    assert kept0.tolist() == list(range(6, 19))  # loss_mask on a and a+1, a <= S-2
    assert kept1.tolist() == list(range(low, 11))
    first = config.first_predicted_slot + config.block_offset  # offset of the first predicted slot from a
    expected = anchors[..., None] + first + torch.arange(plan.labels.shape[-1])
    in_range = expected < 20
    assert torch.equal(plan.labels[in_range], (expected + 100)[in_range])  # label = token at the slot's position
    decay = torch.exp(-torch.arange(plan.labels.shape[-1]) / 4.0)
    assert torch.allclose(plan.weights[0, 0], decay)  # first kept block: every slot valid, weight exp(-(j-1)/g)
    assert plan.labels.shape[-1] == (7 if layout == "dflash" else 6)
    assert not plan.weights[~keep].any()  # padding blocks carry no weight
    assert not plan.valid[~in_range].any()


def test_masks_strict_context_and_flex_equals_sdpa(target, mtp_head):
    data = random_dataset(2, 24)
    batch = collate([data[0], data[1]])
    features = FeatureExtractor(target, [0, 1], mtp_head)(batch["input_ids"], batch["attention_mask"])
    draft = tiny_draft(target)
    plan = plan_blocks(batch["input_ids"], batch["loss_mask"], anchor_scores(0, 1, 2, 24), draft.config, 6, 4.0)
    masks = build_attention_masks(draft, plan.anchors, plan.keep, 24)["full_attention"]  # [B, 1, Q, K]
    a = int(plan.anchors[0, 0])
    assert masks[0, 0, 0, a - 1] and not masks[0, 0, 0, a]  # strict kv < anchor
    assert masks[0, 0, 0, 24 : 24 + 8].all() and not masks[0, 0, 0, 24 + 8 :].any()  # own block only
    objective = DMTPTrainingObjective(draft)
    losses = {}
    for attn in ["sdpa", "flex_attention"]:  # flex has no CPU backward in torch 2.13: compare forwards
        draft.set_attn_implementation(attn)
        with torch.no_grad():
            losses[attn] = objective(batch["input_ids"], plan=plan, **features).loss
    torch.testing.assert_close(losses["flex_attention"], losses["sdpa"], rtol=1e-5, atol=1e-5)
    # the BlockMask evaluates the same rule: densified, it equals the SDPA mask
    block_mask = build_attention_masks(draft, plan.anchors, plan.keep, 24)["full_attention"]
    dense = block_mask.to_dense().bool()  # [B, 1, ceil(Q/128), ceil(K/128)] of 128x128 blocks: all partial here
    assert dense.any()
    q_len, kv_len = masks.shape[-2:]
    assert block_mask.mask_mod is not None
    b, q, k = torch.meshgrid(torch.arange(2), torch.arange(q_len), torch.arange(kv_len), indexing="ij")
    evaluated = block_mask.mask_mod(b, torch.zeros_like(b), q, k)
    assert torch.equal(evaluated, masks[:, 0])


def test_extraction_batches_by_length_and_keeps_dataset_order(tmp_path, target, mtp_head):
    """Batches are formed from samples of similar length (less padding); shards still hold samples in dataset order,
    each with the features it has when extracted alone."""
    data = random_dataset(7, 24, seed=3)
    for i, n in enumerate([24, 5, 19, 7, 24, 11, 6]):
        data.samples[i] = {k: v[:n] for k, v in data.samples[i].items()}
    extractor = FeatureExtractor(target, [0, 1], mtp_head)
    calls = []
    real_call = FeatureExtractor.__call__

    def recording(self, input_ids, attention_mask=None):
        calls.append(input_ids.shape[1])
        return real_call(self, input_ids, attention_mask)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(FeatureExtractor, "__call__", recording)
        extract_features(extractor, data, tmp_path / "feats", batch_size=2, shard_size=7, progress=False)
    assert calls == [6, 11, 24, 24]  # sorted: (5, 6), (7, 11), (19, 24), (24,); in dataset order: 24, 19, 24, 24
    offline = OfflineFeatureDataset(tmp_path / "feats")
    for i in range(len(data)):
        alone = extractor(data[i]["input_ids"][None], torch.ones(1, len(data[i]["input_ids"]), dtype=torch.long))
        assert torch.equal(offline[i]["input_ids"], data[i]["input_ids"])
        torch.testing.assert_close(offline[i]["context"], alone["context"][0], rtol=1e-4, atol=1e-5)
        # the head's pair at the last position reads the next token, padding in a batch: it predicts nothing
        torch.testing.assert_close(offline[i]["mtp_hidden"][:-1], alone["mtp_hidden"][0, :-1], rtol=1e-4, atol=1e-5)
        assert torch.equal(offline[i]["mtp_token"][:-1], alone["mtp_token"][0, :-1])


def test_online_and_offline_features_give_the_same_loss(tmp_path, target, mtp_head):
    data = random_dataset(5, 24)
    data.samples[1] = {k: v[:17] for k, v in data.samples[1].items()}  # ragged lengths: padding in batches
    extractor = FeatureExtractor(target, [0, 1], mtp_head)
    extract_features(extractor, data, tmp_path / "feats", batch_size=2, shard_size=2, progress=False)
    offline = OfflineFeatureDataset(tmp_path / "feats")
    assert len(offline) == 5 and len(offline.index["shards"]) == 3
    draft = tiny_draft(target)
    objective = DMTPTrainingObjective(draft)
    rows = [0, 1, 3]
    online_batch = collate([data[i] for i in rows])
    offline_batch = collate([offline[i] for i in rows])
    assert torch.equal(online_batch["input_ids"], offline_batch["input_ids"])
    online_features = extractor(online_batch["input_ids"], online_batch["attention_mask"])
    plan = plan_blocks(
        online_batch["input_ids"], online_batch["loss_mask"], anchor_scores(3, 0, 3, 24), draft.config, 8, 4.0
    )
    with torch.no_grad():
        online = objective(online_batch["input_ids"], plan=plan, **online_features)
        offline_out = objective(
            offline_batch["input_ids"],
            plan=plan,
            **{k: offline_batch[k] for k in ("context", "mtp_hidden", "mtp_token")},
        )
    torch.testing.assert_close(offline_out.loss, online.loss, rtol=1e-5, atol=1e-6)
    assert summarize_metrics([online]) == pytest.approx(summarize_metrics([offline_out]), rel=1e-5)
    # the trainer consumes the feature directory directly
    trainer = Trainer(
        make_config(tmp_path, max_steps=1, train_data=str(tmp_path / "feats"), micro_batch_size=2), target=target
    )
    assert trainer.train()[0]["loss"] > 0


def test_the_frozen_head_on_offline_head_inputs_trains_a_draft_like_online_features(tmp_path, target, mtp_head):
    """Features holding only the head's inputs: the trainer runs the frozen head itself, its guess only at anchors."""
    extractor = FeatureExtractor(target, [0, 1], mtp_head)
    head_inputs = FeatureExtractor(target, [0, 1], None, head_inputs=True)  # what `dmtp extract --head-inputs` writes
    # Sequences the head predicts: x_{t+2} is its own guess, so T1 is accepted at every anchor (a misplaced guess
    # would show in accept_len).
    samples = random_dataset(6, 2, seed=1).samples
    with torch.no_grad():
        for sample in samples:
            ids = sample["input_ids"][None]
            while ids.shape[1] < 24:
                hidden = head_inputs(ids)["head_hidden"]
                guess = extractor.mtp_features(ids, hidden)["mtp_token"][:, -2:-1]  # g_{n-2}: predicts x_n
                ids = torch.cat([ids, guess], dim=1)
            sample.update(input_ids=ids[0], loss_mask=torch.ones(24, dtype=torch.long))
    data = TokenizedDataset(samples)
    ids = collate([data[i] for i in range(3)])["input_ids"]
    hidden = head_inputs(ids)["head_hidden"]
    everywhere = extractor.mtp_features(ids, hidden)["mtp_token"]
    positions = torch.tensor([[0, 5, 9], [2, 3, 20], [0, 0, 17]])
    at_anchors = extractor.mtp_features(ids, hidden, token_positions=positions)["mtp_token"]
    assert torch.equal(at_anchors.gather(1, positions), everywhere.gather(1, positions))
    assert (at_anchors >= 0).sum() == 8 and (at_anchors.scatter(1, positions, -1) == -1).all()

    extract_features(head_inputs, data, tmp_path / "feats", batch_size=2, shard_size=3, progress=False)
    histories = {}
    for name, train_data in {"online": data, "offline": OfflineFeatureDataset(tmp_path / "feats")}.items():
        config = make_config(tmp_path / name, max_steps=3, micro_batch_size=2)
        histories[name] = Trainer(config, target=target, train_dataset=train_data).train()
    assert all(h["accept_len"] > 1.9 for h in histories["online"])  # T1 accepted in (nearly) every block
    for online, offline in zip(histories["online"], histories["offline"], strict=True):
        for key in ("loss", "accept_len", "accept_len_tf", "acc_1"):
            assert offline[key] == pytest.approx(online[key], rel=1e-4, abs=1e-6), key


# ----------------------------------------------------------------------------------------------------
# Trainer


@pytest.mark.parametrize("layout", ["dflash", "dual"])
def test_training_drives_loss_down_and_acceptance_up(tmp_path, target, mtp_head, layout):
    """Memorise 8 random sequences: loss falls and the simulated acceptance rises; frozen parts stay frozen."""
    data = precompute_features(FeatureExtractor(target, [0, 1], mtp_head), random_dataset(8, 32))
    frozen_before = {
        n: p.detach().clone() for n, p in list(target.named_parameters()) + list(mtp_head.named_parameters())
    }
    config = make_config(
        tmp_path,
        anchor_layout=layout,
        max_steps=150,
        micro_batch_size=8,
        num_anchors=16,
        learning_rate=1e-2,
        warmup_ratio=0.05,
    )
    trainer = Trainer(config, target=target, train_dataset=data, eval_dataset=data)
    start = trainer.evaluate()
    history = trainer.train()
    end = trainer.evaluate()
    assert end["loss"] < 0.5 * start["loss"], (start, end)
    assert end["accept_len_tf"] > start["accept_len_tf"] + 3.0, (start, end)
    assert end["acc_1"] > 0.6
    assert history[-1]["loss"] < history[0]["loss"]
    # frozen: no gradient, bit-identical weights (target incl. embedding and LM head, MTP head)
    for name, p in list(trainer.frozen_parameters().items()):
        assert not p.requires_grad and p.grad is None, name
    after = dict(list(target.named_parameters()) + list(mtp_head.named_parameters()))
    assert all(torch.equal(after[n], v) for n, v in frozen_before.items())
    # the exported draft loads as a plain DMTPDraftModel
    loaded = DMTPDraftModel.from_pretrained(Path(config.output_dir) / "final", target=target)
    assert all(torch.equal(v, trainer.draft.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_resume_after_kill_gives_the_same_weights(tmp_path, target):
    data = random_dataset(12, 24)

    def run(out, kill_at=None):
        config = make_config(tmp_path, output_dir=str(tmp_path / out), max_steps=6, save_every=2, resume_from="auto")

        def killer(trainer, step, metrics):
            if step == kill_at:
                raise KeyboardInterrupt

        trainer = Trainer(config, target=target, train_dataset=data)
        trainer.train(callbacks=[killer])
        return trainer

    uninterrupted = draft_weights(run("straight").draft)
    with pytest.raises(KeyboardInterrupt):
        run("killed", kill_at=3)  # checkpoint at step 2 written, step 3 lost
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["step-00000002"]
    resumed = run("killed")
    assert resumed.history[0]["step"] == 3  # resumed at step 2
    weights = draft_weights(resumed.draft)
    assert all(torch.equal(weights[k], v) for k, v in uninterrupted.items())
    # the exported record counts the killed run's time too (checkpointed) and says what produced the weights
    record = json.loads((tmp_path / "killed" / "final" / "training.json").read_text())
    assert record["steps"] == 6 and record["train_samples"] == 12 and record["anchor_layout"] == "dual"
    checkpoints = sorted((tmp_path / "killed" / "checkpoints").iterdir())
    first = json.loads((checkpoints[0] / "trainer_state.json").read_text())
    assert 0 < first["train_seconds"] < record["train_seconds"]


def test_dflash_checkpoint_with_zero_fusion_starts_at_dflash_with_t1_loss(tmp_path, target, mtp_head):
    dflash = tiny_draft(target, "dflash", "none", seed=3)
    dflash.save_dflash(tmp_path / "dflash")
    dmtp = DMTPDraftModel.from_pretrained(
        tmp_path / "dflash", anchor_layout="dual", fusion="residual", num_candidates=7
    ).bind(target)
    plain = DMTPDraftModel.from_pretrained(
        tmp_path / "dflash", anchor_layout="dual", fusion="none", num_candidates=7
    ).bind(target)
    assert dmtp.fusion.is_noop()
    data = random_dataset(4, 24)
    order, _ = StepSchedule(4, 4, 1, seed=42).micro_batches(0)[0]  # the trainer's first batch and anchors
    batch = collate([data[i] for i in order])
    features = FeatureExtractor(target, [0, 1], mtp_head)(batch["input_ids"], batch["attention_mask"])
    plan = plan_blocks(batch["input_ids"], batch["loss_mask"], anchor_scores(42, 0, 4, 32), dmtp.config, 8, 4.0)
    with torch.no_grad():
        fused = DMTPTrainingObjective(dmtp)(batch["input_ids"], plan=plan, **features).loss
        with_t1 = DMTPTrainingObjective(plain)(batch["input_ids"], plan=plan, **features).loss
    assert torch.equal(fused, with_t1)

    # Continued fine-tuning from the DFlash checkpoint: the first step's loss is exactly that loss (same anchors),
    # then the residual fusion learns (it receives gradient through the zero-initialised projection).
    config = make_config(tmp_path, init_from=str(tmp_path / "dflash"), max_steps=3, micro_batch_size=4, max_length=32)
    trainer = Trainer(config, target=target, train_dataset=data)
    history = trainer.train()
    assert history[0]["loss"] == pytest.approx(float(with_t1), rel=1e-6, abs=0)
    assert not trainer.draft.fusion.is_noop()


def test_lora_trains_and_merged_checkpoint_loads_as_plain_draft(tmp_path, target):
    tiny_draft(target, "dflash", "none", seed=4).save_dflash(tmp_path / "dflash")
    data = random_dataset(8, 24)
    config = make_config(tmp_path, init_from=str(tmp_path / "dflash"), lora=True, lora_r=4, max_steps=3)
    trainer = Trainer(config, target=target, train_dataset=data)
    model = trainer.accelerator.unwrap_model(trainer.objective).model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("fusion" in n for n in trainable)
    assert not any(n.endswith("fc.weight") or "base_layer" in n for n in trainable)
    trainer.train()
    merged = DMTPDraftModel.from_pretrained(Path(config.output_dir) / "final", target=target)
    assert type(merged) is DMTPDraftModel and not merged.fusion.is_noop()
    batch = collate([data[i] for i in range(4)])
    features = trainer.extractor(batch["input_ids"], batch["attention_mask"])
    plan = plan_blocks(batch["input_ids"], batch["loss_mask"], anchor_scores(1, 0, 4, 32), merged.config, 8, 4.0)
    with torch.no_grad():
        lora_loss = DMTPTrainingObjective(model)(batch["input_ids"], plan=plan, **features).loss
        merged_loss = DMTPTrainingObjective(merged)(batch["input_ids"], plan=plan, **features).loss
    torch.testing.assert_close(merged_loss, lora_loss, rtol=1e-5, atol=1e-6)


def launch(command: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    """Run an `accelerate launch` (about 12 s here); one that never ends is killed with its ranks, and the test fails
    with what they printed (the run ends on every rank together, `Trainer.end_run`)."""
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)  # the launcher and both ranks
        stdout, stderr = process.communicate()
        pytest.fail(f"accelerate launch did not end in {timeout} s\nstdout: {stdout[-3000:]}\nstderr: {stderr[-9000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_accelerate_launch_two_processes_matches_one(tmp_path, target_dir):
    data = random_dataset(8, 24)
    data_file = tmp_path / "train.jsonl"
    data_file.write_text("\n".join(json.dumps({k: v.tolist() for k, v in s.items()}) for s in data.samples) + "\n")
    values = make_config(
        tmp_path,
        target_model=str(target_dir),
        train_data=str(data_file),
        micro_batch_size=2,
        max_steps=3,
        output_dir=str(tmp_path / "ddp"),
    ).to_dict()
    config_file = tmp_path / "ddp.yaml"
    config_file.write_text(yaml.safe_dump(values))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(REPO / "configs" / "accelerate" / "ddp_cpu.yaml"),
        str(REPO / "scripts" / "finetune.py"),
        "--config",
        str(config_file),
        "--set",
        "save_every=2",
        "--set",
        "resume_from=auto",
    ]
    result = launch(command, env)
    assert result.returncode == 0, result.stderr[-12000:]  # both ranks' tracebacks
    assert "trained 3 steps on 2 process(es)" in result.stdout  # really distributed (gloo), printed once
    straight = DMTPDraftModel.from_pretrained(tmp_path / "ddp" / "final").state_dict()
    # Exact resume with 2 processes: drop what came after the step-2 checkpoint and run again.
    shutil.rmtree(tmp_path / "ddp" / "final")
    for later in (tmp_path / "ddp" / "checkpoints").glob("step-0000000[3-9]"):
        shutil.rmtree(later)
    result = launch(command, env)
    assert result.returncode == 0 and "resumed from" in result.stdout, result.stderr[-12000:]
    resumed = DMTPDraftModel.from_pretrained(tmp_path / "ddp" / "final").state_dict()
    assert all(torch.equal(resumed[k], v) for k, v in straight.items())

    # one process, same global batch (4 = 2 processes x 2)
    single = make_config(
        tmp_path,
        target_model=str(target_dir),
        train_data=str(data_file),
        micro_batch_size=4,
        max_steps=3,
        output_dir=str(tmp_path / "single"),
    )
    Trainer(single).train()
    two = DMTPDraftModel.from_pretrained(tmp_path / "ddp" / "final").state_dict()
    one = DMTPDraftModel.from_pretrained(tmp_path / "single" / "final").state_dict()
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, rtol=1e-5, atol=1e-6)
    set_seed(single.seed)  # what the trainer does before building the draft
    initial = build_draft(single, load_target(target_dir)).state_dict()
    assert not torch.equal(initial["fc.weight"], one["fc.weight"])  # the runs did train


# `python -c` that makes its stdin (a pseudo-terminal) the controlling terminal of its new session, then runs the
# rest of its argv: `accelerate launch` as a shell runs it in a terminal, in the terminal's foreground process group.
IN_A_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def test_ctrl_c_in_a_terminal_under_accelerate_launch_saves_and_exits_0_quietly(tmp_path, target_dir):
    """Ctrl-C typed while `accelerate launch scripts/finetune.py` trains (the terminal sends SIGINT to its whole
    foreground process group): the trainer saves a resumable checkpoint and says so in one line; neither it nor the
    launcher prints a traceback, and `accelerate launch` exits 0 (it used to raise KeyboardInterrupt itself, then
    CalledProcessError for the child's status 130)."""
    import re
    import threading

    pytest.importorskip("termios")
    data_file = tmp_path / "train.jsonl"
    samples = random_dataset(8, 24).samples
    data_file.write_text("\n".join(json.dumps({k: v.tolist() for k, v in s.items()}) for s in samples) + "\n")
    values = make_config(
        tmp_path,
        target_model=str(target_dir),
        train_data=str(data_file),
        micro_batch_size=2,
        max_steps=10**6,
        output_dir=str(tmp_path / "run"),
    ).to_dict()
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(values))
    command = [
        sys.executable,
        "-c",
        IN_A_TERMINAL,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--cpu",
        str(REPO / "scripts" / "finetune.py"),
        "--config",
        str(tmp_path / "run.yaml"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": ""}
    terminal, its_side = os.openpty()
    process = subprocess.Popen(
        command,
        env=env,
        stdin=its_side,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    os.close(its_side)
    stdout: list[str] = []
    stderr: list[str] = []
    readers = [
        threading.Thread(target=lambda lines=lines, pipe=pipe: lines.extend(iter(pipe.readline, "")), daemon=True)
        for lines, pipe in ((stdout, process.stdout), (stderr, process.stderr))
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any("train:" in line and "loss=" in line for line in stderr):  # a step is done
            assert process.poll() is None and time.monotonic() < deadline, "".join(stderr)[-6000:]
            time.sleep(0.1)
        os.write(terminal, b"\x03")  # Ctrl-C
        process.wait(timeout=120)
        for reader in readers:
            reader.join(timeout=10)
    finally:
        os.close(terminal)  # a hang-up for whatever is left in the terminal's session
        if process.poll() is None:
            os.killpg(process.pid, 9)
    out, err = "".join(stdout), "".join(stderr)
    assert process.returncode == 0, err[-6000:]
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in err, err[-6000:]
    saved = [line for line in (out + err).splitlines() if "checkpoint" in line]
    assert len(saved) == 1, saved
    match = re.fullmatch(
        r"SIGINT: stopped at step (\d+), resumable checkpoint in (\S+) \(rerun the same command to continue\)", saved[0]
    )
    assert match and Path(match[2]) == tmp_path / "run" / "checkpoints" / f"step-{int(match[1]):08d}", saved
    assert (Path(match[2]) / "trainer_state.json").is_file()


def test_gradient_accumulation_and_checkpointing_match_one_big_batch(tmp_path, target):
    data = random_dataset(8, 24)
    weights = {}
    for name, overrides in {
        "big": dict(micro_batch_size=4),
        "accumulated": dict(micro_batch_size=2, gradient_accumulation_steps=2, gradient_checkpointing=True),
        "chunked_logits": dict(micro_batch_size=4, logits_chunk_size=5),  # LM head over 5 slots at a time
    }.items():
        config = make_config(tmp_path, output_dir=str(tmp_path / name), max_steps=3, **overrides)
        trainer = Trainer(config, target=target, train_dataset=data)
        trainer.train()
        weights[name] = draft_weights(trainer.draft)
    for key, value in weights["big"].items():
        torch.testing.assert_close(weights["accumulated"][key], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weights["chunked_logits"][key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["example-dmtp", "example-dflash"])
def test_example_configs_list_every_field(name):
    import dataclasses

    path = REPO / "configs" / f"{name}.yaml"
    config = TrainConfig.from_yaml(path)
    assert set(yaml.safe_load(path.read_text())) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert config.anchor_layout == ("dual" if name == "example-dmtp" else "dflash")
    with pytest.raises(ValueError, match="Unknown config key"):
        TrainConfig.from_yaml(path, ["learning_rat=0.1"])


def test_train_config_names_the_key_of_every_bad_setting(tmp_path):
    base = {"target_model": "t", "train_data": "d", "output_dir": str(tmp_path)}
    assert TrainConfig.from_dict({**base, "max_grad_norm": 1}).max_grad_norm == 1.0  # YAML's 1 is a valid float
    bad = {
        "learning_rat": "Unknown config key",
        "micro_batch_size": ("2", "micro_batch_size"),
        "anchor_layout": ("triple", "anchor_layout"),
        "lora": ("yes", "lora"),
        "num_anchors": (0, "num_anchors must be >= 1"),
    }
    for key, expected in bad.items():
        value, message = (1, expected) if isinstance(expected, str) else expected
        with pytest.raises(ValueError, match=message):
            TrainConfig.from_dict({**base, key: value})
    with pytest.raises(ValueError, match="output_dir"):
        TrainConfig.from_dict({"target_model": "t", "train_data": "d"})
    with pytest.raises(ValueError, match="joint"):
        TrainConfig.from_dict({**base, "train_mtp_head": "joint", "anchor_layout": "dflash"})


DFLASH2 = {
    "backbone": "dflash2",
    "dflash_config": {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 8, "selector_top_k": 4},
}


@pytest.mark.parametrize("layout", ["dflash", "dual"])
def test_dflash2_trains_from_dflash_weights_starting_exactly_at_dflash(tmp_path, target, mtp_head, layout):
    """DFlash weights loaded as a DFlash2 backbone: identity convolutions and a zero selector, so the first step's
    draft loss is DFlash's (plus the selector's, which only the selector weight scales); then the convolutions and
    the selector learn, the loss falls, and the checkpoint reloads exactly (LoRA merged, resume exact)."""
    fusion = "none" if layout == "dflash" else "residual"
    dflash = tiny_draft(target, "dflash", "none", seed=5)
    dflash.save_dflash(tmp_path / "dflash")
    data = precompute_features(FeatureExtractor(target, [0, 1], mtp_head), random_dataset(8, 32))
    common = dict(
        init_from=str(tmp_path / "dflash"),
        anchor_layout=layout,
        fusion=fusion,
        max_steps=120,
        micro_batch_size=8,
        num_anchors=16,
        learning_rate=1e-2,
        warmup_ratio=0.05,
    )
    plain = Trainer(
        make_config(tmp_path / "plain", selector_loss_weight=0.0, **common),
        target=target,
        train_dataset=data,
        eval_dataset=data,
    )
    config = make_config(tmp_path / "d2", draft_config=DFLASH2, selector_loss_weight=0.0, **common)
    d2 = Trainer(config, target=target, train_dataset=data, eval_dataset=data)
    assert d2.draft.config.backbone == "dflash2" and not d2.draft.candidate_selector.successor_codebook.any()
    before = d2.evaluate()
    assert before["loss"] == pytest.approx(plain.evaluate()["loss"], rel=1e-6)  # DFlash2 at init == DFlash
    trained = Trainer(
        make_config(tmp_path / "d2-trained", draft_config=DFLASH2, **common),
        target=target,
        train_dataset=data,
        eval_dataset=data,
    )
    start = trained.evaluate()
    trained.train()
    after = trained.evaluate()
    assert after["loss"] < 0.6 * start["loss"] and after["acc_1"] > start["acc_1"]
    draft = trained.draft
    assert draft.candidate_selector.successor_codebook.abs().sum() > 0
    assert (draft.layers[0].attention_conv.kernel_projection.weight != 0).any()
    loaded = DMTPDraftModel.from_pretrained(tmp_path / "d2-trained" / "run" / "final", target=target)
    assert loaded.config.backbone == "dflash2"
    assert all(torch.equal(v, draft.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_dflash2_from_scratch_with_lora_and_exact_resume(tmp_path, target):
    data = random_dataset(12, 24)
    draft_config = {**make_config(tmp_path).draft_config, **DFLASH2}

    def run(out, kill_at=None, **extra):
        config = make_config(
            tmp_path,
            draft_config=draft_config,
            anchor_layout="dflash",
            fusion="none",
            output_dir=str(tmp_path / out),
            max_steps=4,
            save_every=2,
            resume_from="auto",
            **extra,
        )

        def killer(trainer, step, metrics):
            if step == kill_at:
                raise KeyboardInterrupt

        trainer = Trainer(config, target=target, train_dataset=data)
        trainer.train(callbacks=[killer])
        return trainer

    straight = draft_weights(run("straight").draft)
    with pytest.raises(KeyboardInterrupt):
        run("killed", kill_at=3)
    resumed = draft_weights(run("killed").draft)
    assert all(torch.equal(resumed[k], v) for k, v in straight.items())
    lora = run("lora", lora=True, lora_r=4)
    merged = DMTPDraftModel.from_pretrained(tmp_path / "lora" / "final", target=target)
    assert merged.config.backbone == "dflash2" and type(merged) is DMTPDraftModel
    assert lora.history[-1]["loss"] == lora.history[-1]["loss"]  # finite


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_resumable_checkpoint_and_stops(tmp_path, target, signal_name, capsys):
    import signal

    from dmtp_hf.training.interruptions import TrainingInterrupted

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under nohup or a background job, the default otherwise
    data = random_dataset(12, 24)

    def run(out, signal_at=None):
        config = make_config(tmp_path, output_dir=str(tmp_path / out), max_steps=6, save_every=4, resume_from="auto")

        def send(trainer, step, metrics):
            if step == signal_at:
                signal.raise_signal(getattr(signal, signal_name))  # what Ctrl-C or a scheduler's preemption does

        trainer = Trainer(config, target=target, train_dataset=data)
        trainer.train(callbacks=[send])
        return trainer

    straight = draft_weights(run("straight").draft)
    with pytest.raises(TrainingInterrupted, match=rf"{signal_name}: stopped at step 3, resumable checkpoint") as stop:
        run("stopped", signal_at=3)  # the periodic checkpoint would come at step 4: step 3 is saved on the signal
    assert stop.value.exit_code == 128 + getattr(signal, signal_name)
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["step-00000003"]
    assert signal.getsignal(signal.SIGINT) == before  # handlers restored
    resumed = run("stopped")
    assert resumed.history[0]["step"] == 4
    weights = draft_weights(resumed.draft)
    assert all(torch.equal(weights[k], v) for k, v in straight.items())


def test_the_end_of_a_run_says_what_it_did_counting_the_sessions_it_resumed(tmp_path, target, capsys):
    """The last lines of a run: its steps and wall time, the interrupted session's included; the final checkpoint to
    load or push; the held-out metrics of the final weights (evaluated at the last step, not the last multiple of
    eval_every)."""
    import re
    import signal

    from dmtp_hf.training.interruptions import TrainingInterrupted

    data = random_dataset(8, 24)
    config = make_config(tmp_path, max_steps=5, save_every=0, eval_every=2, resume_from="auto")

    def interrupt(trainer, step, metrics):
        if step == 3:
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(TrainingInterrupted):
        Trainer(config, target=target, train_dataset=data, eval_dataset=data).train(callbacks=[interrupt])
    first = json.loads((tmp_path / "run" / "checkpoints" / "step-00000003" / "trainer_state.json").read_text())
    assert first["sessions"] == 1 and first["train_seconds"] > 0
    capsys.readouterr()
    trainer = Trainer(config, target=target, train_dataset=data, eval_dataset=data)
    trainer.train()
    out = capsys.readouterr().out
    summary = re.search(
        r"^trained 5 steps on 1 process\(es\) in ([\d.]+)s \(2 sessions; this one: steps 4-5 in ([\d.]+)s\)$", out, re.M
    )
    assert summary, out
    # the total is the checkpointed time, the first session's included
    assert float(summary[1]) == pytest.approx(trainer.train_seconds, abs=0.05)
    assert float(summary[2]) == pytest.approx(trainer.train_seconds - first["train_seconds"], abs=0.05)
    final = tmp_path / "run" / "final"
    assert (
        f"final checkpoint: {final} (DMTPDraftModel.from_pretrained(path, target=target) loads it, `dmtp push " in out
    )
    metrics = trainer.last_eval
    assert metrics["step"] == 5 and metrics == {"step": 5, **trainer.evaluate()}
    accuracy = "/".join(f"{metrics[f'acc_{j}']:.2f}" for j in range(1, trainer.draft.config.num_candidates))
    expected = (
        f"final eval (step 5): loss {metrics['loss']:.4f}, acc {accuracy}, accept_len {metrics['accept_len']:.2f}, "
        f"accept_len_tf {metrics['accept_len_tf']:.2f}"
    )
    assert expected in out.splitlines()
    record = json.loads((final / "training.json").read_text())
    assert record["sessions"] == 2 and record["last_eval"]["step"] == 5


def test_resume_refuses_changed_settings_unless_allowed(tmp_path, target):
    data = random_dataset(8, 24)
    base = dict(output_dir=str(tmp_path / "run"), max_steps=2, save_every=2, resume_from="auto")
    Trainer(make_config(tmp_path, **base), target=target, train_dataset=data).train()
    longer = dict(base, max_steps=4)
    with pytest.raises(ValueError, match=r"learning_rate: 0\.003 -> 0\.001.*max_steps: 2 -> 4.*allow_config_change"):
        Trainer(make_config(tmp_path, **longer, learning_rate=1e-3), target=target, train_dataset=data).train()
    trainer = Trainer(
        make_config(tmp_path, **longer, allow_config_change=True, log_every=2), target=target, train_dataset=data
    )
    trainer.train()
    assert trainer.step == 4 and trainer.history[0]["step"] == 3
    # LM-head chunking only trades memory for speed: a run resumes with another chunk size as it is
    chunked = Trainer(
        make_config(tmp_path, **dict(longer, max_steps=6), allow_config_change=True), target=target, train_dataset=data
    )
    chunked.train()  # saved: max_steps 6 (allowed once), now only the chunking differs
    Trainer(
        make_config(tmp_path, **dict(longer, max_steps=6), logits_chunk_size=5), target=target, train_dataset=data
    ).train()


def test_bf16_target_trains_fp32_masters_and_exports_in_the_targets_dtype(tmp_path, target_dir):
    """A draft bound to a bf16 target (binding casts it) trains fp32 weights with fp32 Adam moments under bf16
    autocast; the resumable checkpoint keeps them, the final export is in the target's dtype."""
    bf16_target = load_target(target_dir, dtype=torch.bfloat16)
    config = make_config(tmp_path, max_steps=2, save_every=2, mixed_precision="bf16")
    trainer = Trainer(config, target=bf16_target, train_dataset=random_dataset(8, 24))
    assert all(p.dtype == torch.float32 for p in trainer.draft.parameters())
    trainer.train()
    state = Path(config.output_dir) / "checkpoints" / "step-00000002" / "state"
    weights = next(iter(state.glob("model*.safetensors")))
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(weights)).values()} == {torch.float32}
    optimizer = torch.load(state / "optimizer.bin", weights_only=False)
    moments = [v for s in optimizer["state"].values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    final = Path(config.output_dir) / "final"
    assert {t.dtype for t in load_file(str(final / "model.safetensors")).values()} == {torch.bfloat16}
    assert DMTPDraftModel.from_pretrained(final, dtype="auto").dtype == torch.bfloat16


def test_sharded_evaluation_runs_the_same_number_of_forwards_on_every_process():
    """Under FSDP / ZeRO-3 every forward gathers weights from all processes: a process with one batch fewer would
    leave the others waiting forever. Every process runs ceil(batches / P) forwards; the extra ones are dropped."""
    from dmtp_hf.training.schedule import eval_batches

    for num_batches, processes in [(3, 2), (5, 4), (1, 3), (4, 2)]:
        plans = [eval_batches(num_batches, processes, rank) for rank in range(processes)]
        assert len({len(plan) for plan in plans}) == 1  # the same number of forward calls everywhere
        real = sorted(b for plan in plans for b, is_real in plan if is_real)
        assert real == list(range(num_batches))  # every batch counted once
