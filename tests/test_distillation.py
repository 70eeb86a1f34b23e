"""Self-distillation data: the target's own greedy tokens as labels (`dmtp extract --target-labels`,
``labels: target``), and mixed training sets (``train_data: [a, "b*0.5"]``).

Everything runs on the tiny qwen3_5 target (vocabulary 128, hidden 32, 2 layers, random native MTP head), whose
greedy tokens almost never equal random text: a label read from the wrong place shows at once.
"""

from types import SimpleNamespace

import pytest
import torch

from dmtp_hf.assistant.target.loading import freeze, load_target
from dmtp_hf.modeling import load_native_mtp
from dmtp_hf.training import (
    FeatureExtractor,
    OfflineFeatureDataset,
    TokenizedDataset,
    TrainConfig,
    Trainer,
    anchor_scores,
    collate,
    extract_features,
    plan_blocks,
)
from dmtp_hf.training.data import mixed_dataset, parse_mix_item
from dmtp_hf.training.features import teacher_labels
from dmtp_hf.training.mtp_objective import MTPHeadObjective
from dmtp_hf_assets.tiny_targets import make_tiny_target

VOCAB, MASK = 128, 127


pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models are overhead-bound


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_target(make_tiny_target("qwen3_5", tmp_path_factory.mktemp("tiny") / "qwen3_5"))


@pytest.fixture(scope="module")
def mtp_head(target):
    return freeze(load_native_mtp(target))


def random_text(num: int, length: int, seed: int = 0) -> TokenizedDataset:
    """Random token sequences, every position supervised (teacher-forced text)."""
    g = torch.Generator().manual_seed(seed)
    return TokenizedDataset(
        [
            {"input_ids": torch.randint(0, VOCAB - 1, (length,), generator=g), "loss_mask": torch.ones(length).long()}
            for _ in range(num)
        ]
    )


def config(tmp_path, **overrides) -> TrainConfig:
    values = dict(
        target_model="unused",
        draft_config=dict(mask_token_id=MASK, target_layer_ids=[0, 1], num_hidden_layers=1, intermediate_size=64),
        train_data="unused",
        max_length=24,
        num_anchors=6,
        micro_batch_size=4,
        max_steps=4,
        learning_rate=3e-3,
        output_dir=str(tmp_path / "run"),
        save_every=0,
        eval_every=0,
        report_to="none",
        resume_from=None,
    )
    values.update(overrides)
    return TrainConfig.from_dict(values)


def test_target_labels_are_the_targets_own_greedy_tokens_online_and_offline(tmp_path, target):
    """``target_next`` at position t is argmax of the target's logits after x_0..x_t, for every position of every
    sample, whether computed in a padded batch, in LM-head chunks, or read back from shards."""
    data = random_text(5, 20)
    data.samples[2] = {k: v[:11] for k, v in data.samples[2].items()}  # ragged: padding inside a batch
    extractor = FeatureExtractor(target, [0, 1], None, target_labels=True, token_chunk=7)
    extract_features(extractor, data, tmp_path / "feats", batch_size=3, shard_size=2, progress=False)
    offline = OfflineFeatureDataset(tmp_path / "feats")
    assert offline.index["has_target_labels"]
    for i in range(len(data)):
        ids = data[i]["input_ids"]
        with torch.no_grad():
            greedy = target(ids[None]).logits[0].argmax(-1)  # [S]
        assert torch.equal(offline[i]["target_next"], greedy)
        assert (greedy[:-1] != ids[1:]).float().mean() > 0.9  # the labels are the target's, not the text's
    batch = collate([data[i] for i in range(3)])
    online = extractor(batch["input_ids"], batch["attention_mask"])["target_next"]
    for row in range(3):
        n = len(data[row]["input_ids"])
        assert torch.equal(online[row, :n], offline[row]["target_next"])


def test_teacher_labels_shift_the_target_tokens_onto_the_positions_they_predict():
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(teacher_labels(ids, torch.tensor([[60, 70, 80, 90]])), torch.tensor([[5, 60, 70, 80]]))
    assert teacher_labels(ids, None) is ids


def test_block_labels_and_head_labels_come_from_the_target(target, mtp_head):
    """With ``target_next``, every predicted slot's label (and the DFlash2 walk's predecessor, and T1's reference) is
    the target's token at that position; the head's label of pair t is the target's token after x_{<=t+1}."""
    data = random_text(2, 20, seed=1)
    batch = collate(list(data))
    extractor = FeatureExtractor(target, [0, 1], None, head_inputs=True, target_labels=True)
    features = extractor(batch["input_ids"], batch["attention_mask"])
    labels = teacher_labels(batch["input_ids"], features["target_next"])
    draft_config = SimpleNamespace(anchor_layout="dual", block_length=8, block_offset=0, first_predicted_slot=2)
    scores = anchor_scores(0, 0, 2, 20)
    plan = plan_blocks(batch["input_ids"], batch["loss_mask"], scores, draft_config, 4, 4.0, label_ids=labels)
    text_plan = plan_blocks(batch["input_ids"], batch["loss_mask"], scores, draft_config, 4, 4.0)
    assert torch.equal(plan.anchors, text_plan.anchors) and torch.equal(plan.valid, text_plan.valid)
    slots = plan.anchors[..., None] + 2 + torch.arange(6)  # absolute positions of the predicted slots
    rows = torch.arange(2)[:, None, None]
    assert torch.equal(plan.labels[plan.valid], labels[rows, slots.clamp(max=19)][plan.valid])
    assert torch.equal(plan.predecessors[plan.valid], labels[rows, (slots - 1).clamp(max=19)][plan.valid])
    assert torch.equal(plan.t1_labels, labels.gather(1, plan.anchors + 1))
    assert not torch.equal(plan.labels[plan.valid], text_plan.labels[plan.valid])

    objective = MTPHeadObjective(mtp_head)
    with torch.no_grad():
        distilled = objective(
            batch["input_ids"], batch["loss_mask"], features["head_hidden"], None, None, features["target_next"]
        )
        text = objective(batch["input_ids"], batch["loss_mask"], features["head_hidden"])
        expected = torch.nn.functional.cross_entropy(
            mtp_head.logits(distilled.g[:, :-2]).flatten(0, 1).float(), labels[:, 2:].flatten(), reduction="sum"
        )
    torch.testing.assert_close(distilled.ce_sum, expected, rtol=1e-5, atol=1e-4)
    assert distilled.ce_sum != pytest.approx(text.ce_sum.item(), rel=1e-3)


def test_labels_target_online_equals_offline_and_needs_extracted_labels(tmp_path, target):
    """``labels: target`` trains the same whether the labels are computed in the trainer or read from features, and
    offline features without them are refused by name."""
    data = random_text(8, 24, seed=2)
    extract_features(
        FeatureExtractor(target, [0, 1], None, target_labels=True), data, tmp_path / "with", progress=False
    )
    extract_features(FeatureExtractor(target, [0, 1], None), data, tmp_path / "without", progress=False)
    online = Trainer(
        config(tmp_path / "on", labels="target", anchor_layout="dflash"), target=target, train_dataset=data
    ).train()
    offline = Trainer(
        config(tmp_path / "off", labels="target", anchor_layout="dflash", train_data=str(tmp_path / "with")),
        target=target,
    ).train()
    text = Trainer(config(tmp_path / "txt", anchor_layout="dflash"), target=target, train_dataset=data).train()
    for a, b in zip(online, offline, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)
    assert online[0]["loss"] != pytest.approx(text[0]["loss"], rel=1e-3)
    trainer = Trainer(
        config(tmp_path / "bad", labels="target", anchor_layout="dflash", train_data=str(tmp_path / "without")),
        target=target,
    )
    with pytest.raises(ValueError, match="--target-labels"):
        trainer.train()


def test_mixing_weights_repeat_and_subsample_deterministically():
    a, b = random_text(4, 6, seed=3), random_text(10, 6, seed=4)
    mixed = mixed_dataset([(a, 2.0), (b, 0.5)], seed=7)
    assert len(mixed) == 8 + 5
    ids = [tuple(mixed[i]["input_ids"].tolist()) for i in range(len(mixed))]
    assert ids[:8] == [tuple(a[i]["input_ids"].tolist()) for i in range(4)] * 2
    from_b = {tuple(b[i]["input_ids"].tolist()) for i in range(10)}
    assert len(set(ids[8:])) == 5 and set(ids[8:]) <= from_b
    again = mixed_dataset([(a, 2.0), (b, 0.5)], seed=7)
    assert [tuple(again[i]["input_ids"].tolist()) for i in range(len(again))] == ids
    assert parse_mix_item("feats/x*0.25") == ("feats/x", 0.25) and parse_mix_item("feats/x") == ("feats/x", 1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        parse_mix_item("x*0")


def test_a_resumed_mixed_distillation_run_equals_an_uninterrupted_one(tmp_path, target):
    """Two feature directories mixed 1 : 0.5 with the target's labels; killed after a checkpoint and resumed, the
    head and the draft end bit-identical to an uninterrupted run."""
    for name, seed in (("a", 5), ("b", 6)):
        extractor = FeatureExtractor(target, [0, 1], None, head_inputs=True, target_labels=True)
        extract_features(extractor, random_text(8, 24, seed=seed), tmp_path / name, progress=False)
    mix = [str(tmp_path / "a"), f"{tmp_path / 'b'}*0.5"]

    def run(out, mode, kill_at=None):
        settings = dict(train_data=mix, labels="target", max_steps=5, save_every=2, resume_from="auto")
        if mode == "head":
            settings.update(train_mtp_head="only", mtp_retrofit=True, mtp_kl_weight=0.2)
        cfg = config(tmp_path / out, **settings)

        def killer(trainer, step, metrics):
            if step == kill_at:
                raise KeyboardInterrupt

        trainer = Trainer(cfg, target=target)
        trainer.train(callbacks=[killer])
        model = trainer.trained_head if mode == "head" else trainer.draft
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    for mode in ("head", "draft"):
        straight = run(f"{mode}-straight", mode)
        with pytest.raises(KeyboardInterrupt):
            run(f"{mode}-killed", mode, kill_at=3)
        resumed = run(f"{mode}-killed", mode)
        assert straight.keys() == resumed.keys()
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), mode
