"""Training the native MTP head (alone, jointly with a DMTP draft, with LoRA), exact resume, and its export back
into the target's own checkpoint for every family (real tensor names and dtypes)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from test_training import make_config

from dmtp_hf.assistant.target.loading import load_target
from dmtp_hf.modeling.native_mtp import export_mtp_into_target, load_native_mtp, load_target_checkpoint
from dmtp_hf.modeling.native_mtp.export import head_checkpoint_tensors
from dmtp_hf.modeling.native_mtp.fp8 import dequantize_block_fp8, quantize_block_fp8
from dmtp_hf.modeling.native_mtp.loading import checkpoint_to_head_state_dict
from dmtp_hf.training import Trainer, synthetic_greedy_dataset
from dmtp_hf_assets.tiny_targets import FAMILIES, TINY_FP8_BLOCK, make_tiny_target, read_checkpoint_tensors

pytestmark = pytest.mark.usefixtures("one_thread")  # the tiny models are overhead-bound


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_target("qwen3_5", tmp_path_factory.mktemp("tiny") / "qwen3_5")


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


@pytest.fixture(scope="module")
def greedy_data(target):
    """The target's own greedy continuations: what the head must learn is the target's next-next token."""
    return synthetic_greedy_dataset(target, 48, 24, seed=3)


def head_config(tmp_path, target_dir, **overrides):
    values = dict(
        target_model=str(target_dir),
        train_mtp_head="only",
        micro_batch_size=8,
        max_steps=40,
        learning_rate=3e-3,
        eval_holdout=8,
        output_dir=str(tmp_path / "head"),
    )
    values.update(overrides)
    return make_config(tmp_path, **values)


def head_state(head) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in head.state_dict().items()}


def test_head_training_lowers_loss_raises_acceptance_and_exports(tmp_path, target, target_dir, greedy_data):
    config = head_config(tmp_path, target_dir, mtp_kl_weight=0.5)
    trainer = Trainer(config, target=target, train_dataset=greedy_data)
    before = trainer.evaluate()
    initial = head_state(trainer.mtp_head)
    target_before = {k: v.clone() for k, v in target.state_dict().items()}
    trainer.train()
    after = trainer.evaluate()
    assert after["mtp_loss"] < 0.8 * before["mtp_loss"], (before, after)
    assert after["mtp_acc"] > before["mtp_acc"] + 0.1, (before, after)  # teacher-forced first-candidate acceptance
    assert after["mtp_kl"] < before["mtp_kl"]
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in target_before.items())  # the target is frozen
    trained = head_state(trainer.mtp_head)
    assert any(not torch.equal(initial[k], trained[k]) for k in initial)
    # The exported head loads through the same path as a native one, exactly.
    exported = load_native_mtp(target, checkpoint=Path(config.output_dir) / "final_mtp_head")
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    record = json.loads((Path(config.output_dir) / "final_mtp_head" / "training.json").read_text())
    assert record["train_mtp_head"] == "only" and record["steps"] == 40


def test_head_training_resume_after_kill_is_exact(tmp_path, target, target_dir, greedy_data):
    def run(out, kill_at=None):
        config = head_config(tmp_path / out, target_dir, max_steps=6, save_every=2, eval_holdout=0, resume_from="auto")

        def killer(trainer, step, metrics):
            if step == kill_at:
                raise KeyboardInterrupt

        trainer = Trainer(config, target=target, train_dataset=greedy_data)
        trainer.train(callbacks=[killer])
        return trainer

    straight = head_state(run("straight").mtp_head)
    with pytest.raises(KeyboardInterrupt):
        run("killed", kill_at=3)  # checkpoint at step 2 written, step 3 lost
    resumed = run("killed")
    assert resumed.history[0]["step"] == 3
    for name, tensor in head_state(resumed.mtp_head).items():
        assert torch.equal(tensor, straight[name]), name


def test_a_weights_only_bf16_snapshot_resumes_the_step_schedule_and_weights(tmp_path, target, target_dir, greedy_data):
    """`dmtp train --snapshot`: the newest checkpoint without optimizer state, weights in bf16 (small enough to
    commit). A run resumed from it starts at the saved step with the draft and head at the bf16-rounded weights,
    the schedule's learning rate ramped up again from fresh AdamW moments, and the same data order (same loss)."""
    from dmtp_hf.training.checkpoints import weights_only_checkpoint
    from dmtp_hf.training.trainer import main as train_main

    def config(out, **extra):
        values = dict(
            train_mtp_head="joint", max_steps=8, save_every=4, eval_holdout=0, rewarm_steps=3, resume_from="auto"
        )
        return head_config(tmp_path / out, target_dir, **{**values, **extra})

    straight = Trainer(config("straight"), target=target, train_dataset=greedy_data)
    straight.train()
    at_step_4 = straight.checkpointer.root / "step-00000004"
    snapshot = weights_only_checkpoint(config("straight").output_dir, tmp_path / "committed")
    assert snapshot.name == "step-00000008"  # the newest
    snapshot = weights_only_checkpoint(at_step_4, tmp_path / "committed")
    assert sorted(p.name for p in snapshot.iterdir()) == ["model", "mtp_head", "trainer_state.json"]
    files = list(snapshot.glob("*/*.safetensors"))
    assert len(files) == 2 and all(
        {t.dtype for t in load_file(f).values() if t.is_floating_point()} == {torch.bfloat16} for f in files
    )

    resumed_config = config("resumed")
    (Path(resumed_config.output_dir) / "checkpoints").mkdir(parents=True)
    shutil.copytree(snapshot, Path(resumed_config.output_dir) / "checkpoints" / snapshot.name)
    resumed = Trainer(resumed_config, target=target, train_dataset=greedy_data)
    resumed.load_checkpoint(resumed.checkpointer.resume_point())
    full = Trainer(config("straight", resume_from=str(at_step_4)), target=target, train_dataset=greedy_data)
    full.load_checkpoint(at_step_4)
    assert resumed.step == full.step == 4 and resumed.rewarm_from == 4 and full.rewarm_from is None
    for live, exact in ((resumed.draft, full.draft), (resumed.trained_head, full.trained_head)):
        exact_weights = exact.state_dict()
        for name, tensor in live.state_dict().items():
            assert tensor.dtype == exact_weights[name].dtype, name  # fp32 masters, loaded from bf16
            assert torch.equal(tensor, exact_weights[name].to(torch.bfloat16).to(tensor.dtype)), name
    assert resumed.scheduler.get_last_lr() == full.scheduler.get_last_lr()
    assert not resumed.optimizer.state  # fresh moments

    history = Trainer(resumed_config, target=target, train_dataset=greedy_data).train()
    assert [h["step"] for h in history] == [5, 6, 7, 8]
    straight_step_5 = straight.history[4]
    assert history[0]["loss"] == pytest.approx(straight_step_5["loss"], rel=0.02)  # same batch, bf16-rounded weights
    # the ramp: the first resumed updates use 1/4, 1/2, 3/4 of the scheduled rate, then all of it
    scheduled = [h["lr"] for h in straight.history[4:]]
    assert [h["lr"] / s for h, s in zip(history, scheduled)] == pytest.approx([0.25, 0.5, 0.75, 1.0])

    # the CLI writes the same snapshot from a config
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(yaml.safe_dump(config("straight").to_dict()))
    assert train_main(["--config", str(yaml_file), "--snapshot", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "step-00000008" / "mtp_head").is_dir()


def test_head_lora_trains_and_merges(tmp_path, target, target_dir, greedy_data):
    config = head_config(
        tmp_path,
        target_dir,
        lora=True,
        lora_r=4,
        max_steps=8,
        eval_holdout=0,
        lora_target_modules=["projection", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    trainer = Trainer(config, target=target, train_dataset=greedy_data)
    initial = head_state(load_native_mtp(target, dtype=torch.float32))  # where training started
    trainer.train()
    merged = load_native_mtp(target, checkpoint=Path(config.output_dir) / "final_mtp_head")
    assert set(merged.state_dict()) == set(initial)  # plain head names: LoRA merged away
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, initial[k])]
    assert "projection.weight" in changed and any("q_proj" in k for k in changed)
    assert all("norm" not in k for k in changed)  # only the LoRA-targeted matrices moved


def test_joint_training_moves_draft_and_head(tmp_path, target, target_dir, greedy_data):
    config = head_config(tmp_path, target_dir, train_mtp_head="joint", max_steps=4, eval_holdout=8, mtp_loss_weight=0.5)
    trainer = Trainer(config, target=target, train_dataset=greedy_data)
    head_before, draft_before = head_state(trainer.mtp_head), head_state(trainer.draft)
    trainer.train()
    metrics = trainer.evaluate()
    assert {"loss", "accept_len", "mtp_loss", "mtp_acc"} <= set(metrics)
    assert any(not torch.equal(v, trainer.mtp_head.state_dict()[k]) for k, v in head_before.items())
    assert any(not torch.equal(v, trainer.draft.state_dict()[k]) for k, v in draft_before.items())
    assert (Path(config.output_dir) / "final" / "config.json").is_file()
    assert (Path(config.output_dir) / "final_mtp_head" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------------------------------------------
# Export into the target's own checkpoint


def mtp_names(path: Path, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    tensors = read_checkpoint_tensors(path)
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items() if name.startswith(prefix)}


@pytest.mark.parametrize(
    "family,options",
    [(family, {}) for family in FAMILIES] + [("deepseek_v3", {"fp8": True}), ("qwen3_5", {"sharded": True})],
)
def test_export_writes_the_targets_own_names_and_round_trips(tmp_path, family, options):
    source = make_tiny_target(family, tmp_path / "source", **options)
    target = load_target_checkpoint(source)
    head = load_native_mtp(target, dtype=torch.float32)
    with torch.no_grad():  # a "trained" head: every tensor moved
        for parameter in head.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    out = export_mtp_into_target(head, source, tmp_path / "out")

    prefix = head.checkpoint_prefix
    assert mtp_names(out, prefix) == mtp_names(source, prefix)  # same names, shapes and dtypes (FP8 included)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n for n, f in index.items() if f == "model-mtp.safetensors"} == set(mtp_names(source, prefix))
    old, new = read_checkpoint_tensors(source), read_checkpoint_tensors(out)
    assert {n for n in old if not n.startswith(prefix)} == {n for n in new if not n.startswith(prefix)}
    assert all(torch.equal(old[n], new[n]) for n in old if not n.startswith(prefix))  # the trunk is untouched
    assert (out / "config.json").read_bytes() == (source / "config.json").read_bytes()

    # What the target's checkpoint can hold of the head: its stored dtype, FP8 re-quantized per block.
    stored = {n.removeprefix(prefix): t for n, t in read_checkpoint_tensors(source).items() if n.startswith(prefix)}
    representable = {}
    for name, tensor in head_checkpoint_tensors(head, per_expert=any(".experts.0." in n for n in stored)).items():
        if stored[name].dtype == torch.float8_e4m3fn:
            representable[name] = dequantize_block_fp8(*quantize_block_fp8(tensor, TINY_FP8_BLOCK), TINY_FP8_BLOCK)
        else:
            representable[name] = tensor.to(stored[name].dtype).float()
    expected_state = {name: t.shape for name, t in head.state_dict().items()}
    expected, missing, _ = checkpoint_to_head_state_dict(representable, head.layout, expected_state)
    assert not missing
    loaded = load_native_mtp(load_target_checkpoint(out), dtype=torch.float32)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_export_refuses_a_head_of_another_target(tmp_path):
    source = make_tiny_target("deepseek_v3", tmp_path / "source")
    other = load_target_checkpoint(make_tiny_target("glm4_moe", tmp_path / "other"))
    head = load_native_mtp(other)
    with pytest.raises(ValueError, match="does not match the target"):
        export_mtp_into_target(head, source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_single_file_checkpoint_becomes_indexed_and_loads_in_transformers(tmp_path):
    source = make_tiny_target("qwen3_5", tmp_path / "source")
    with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
        assert any(name.startswith("mtp.") for name in handle.keys())
    target = load_target_checkpoint(source)
    out = export_mtp_into_target(load_native_mtp(target), source, tmp_path / "out")
    assert not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").is_file()
    reloaded = load_target_checkpoint(out)
    ids = torch.tensor([[3, 9, 27]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, target(ids).logits)


def test_offline_features_with_head_inputs_resume_and_train_the_head_like_online(
    tmp_path, target, target_dir, greedy_data
):
    from dmtp_hf.training import FeatureExtractor, OfflineFeatureDataset, extract_features

    extractor = FeatureExtractor(target, [0, 1], None, head_inputs=True)
    out = extract_features(extractor, greedy_data, tmp_path / "features", batch_size=8, shard_size=10, progress=False)
    first = {p.name: p.read_bytes() for p in sorted(out.glob("features-*.safetensors"))}
    assert len(first) == 5 and (out / "index.json").is_file()
    # An interrupted extraction: one shard and the index are missing; the rerun writes only those.
    (out / "features-00003.safetensors").unlink()
    (out / "index.json").unlink()
    stamps = {p.name: p.stat().st_mtime_ns for p in out.glob("features-*.safetensors")}
    extract_features(extractor, greedy_data, out, batch_size=8, shard_size=10, progress=False)
    assert {p.name: p.read_bytes() for p in sorted(out.glob("features-*.safetensors"))} == first
    assert all(out.joinpath(n).stat().st_mtime_ns == t for n, t in stamps.items())

    offline = OfflineFeatureDataset(out)
    weights = {}
    for name, data in {"online": greedy_data, "offline": offline}.items():
        # CE + KL: offline features give the KL term the target's distribution too (the post-norm head input)
        config = head_config(tmp_path / name, target_dir, max_steps=5, eval_holdout=0, mtp_kl_weight=0.5)
        trainer = Trainer(config, target=target, train_dataset=data)
        history = trainer.train()
        assert all(h["mtp_kl"] > 0 for h in history), name
        weights[name] = head_state(trainer.mtp_head)
    for key, value in weights["online"].items():
        torch.testing.assert_close(weights["offline"][key], value, rtol=1e-5, atol=1e-6)
