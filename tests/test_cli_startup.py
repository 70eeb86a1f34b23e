"""A newcomer's first commands: ``dmtp --help`` loads neither torch nor Transformers, ``import dmtp_hf`` loads no
torch, and the lazily loaded names still register the draft with the Auto classes and route a bound target.

Each check runs in a fresh interpreter: the test process itself has long imported torch."""

import json
import os
import subprocess
import sys
import textwrap


def run_python(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line, returned here."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_help_loads_neither_torch_nor_transformers():
    loaded = run_python(
        """
        import contextlib, io, json, sys
        from dmtp_hf.cli import build_parser, main
        parser = build_parser()
        helps = []
        for argv in (["--help"], ["eval", "--help"], ["bench", "--help"], ["convert", "--help"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                main(argv)
            helps.append(out.getvalue())
        print(json.dumps({"heavy": [m for m in ("torch", "transformers") if m in sys.modules], "helps": helps}))
        """
    )
    assert loaded["heavy"] == []
    top, evaluate, _, convert = loaded["helps"]
    assert "eval" in top and "bench" in top and "--strategies" in evaluate
    assert "dual" in convert and "hidden_residual" in convert  # the config's choices, listed without loading it


def test_import_dmtp_hf_loads_no_torch_until_a_name_is_used():
    loaded = run_python(
        """
        import json, sys
        import dmtp_hf
        before = "torch" in sys.modules
        names = sorted(dmtp_hf.__all__)
        listed = all(name in dir(dmtp_hf) for name in names)
        from dmtp_hf import DMTPDraftModel, generate
        print(json.dumps({"before": before, "listed": listed, "version": dmtp_hf.__version__,
                          "resolved": all(getattr(dmtp_hf, n) is not None for n in names)}))
        """
    )
    assert loaded == {"before": False, "listed": True, "version": loaded["version"], "resolved": True}


def test_draft_class_alone_registers_auto_classes_and_routes_a_bound_target():
    """Only ``from dmtp_hf import DMTPDraftModel``: the Auto classes know ``dmtp``, and a bound target's ``generate``
    runs the engine (the router is imported at the bind, not before)."""
    result = run_python(
        """
        import json, sys, tempfile
        import torch
        from dmtp_hf import DMTPDraftModel
        from transformers import AutoConfig, AutoModel, Qwen3Config, Qwen3ForCausalLM

        engine_before_bind = "dmtp_hf.assistant" in sys.modules
        shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, vocab_size=96)
        torch.manual_seed(0)
        target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=4, **shape)).eval()
        config = AutoConfig.for_model("dmtp", num_hidden_layers=1, num_target_layers=4, target_layer_ids=[0, 3],
                                      mask_token_id=95, anchor_layout="dflash", fusion="none", **shape)
        with tempfile.TemporaryDirectory() as folder:
            DMTPDraftModel(config).save_pretrained(folder)
            auto = type(AutoModel.from_pretrained(folder)).__name__
            draft = DMTPDraftModel.from_pretrained(folder, target=target).eval()
        prompt = torch.tensor([[5, 17, 42, 9, 77, 3, 64]])
        plain = target.generate(prompt, do_sample=False, max_new_tokens=12)
        out = target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=12,
                              return_dict_in_generate=True)
        print(json.dumps({"engine_before_bind": engine_before_bind, "config": type(config).__name__, "auto": auto,
                          "routed": hasattr(out, "spec_stats"), "same": torch.equal(out.sequences, plain)}))
        """
    )
    assert result == {
        "engine_before_bind": False,
        "config": "DMTPConfig",
        "auto": "DMTPDraftModel",
        "routed": True,
        "same": True,
    }


def test_registering_the_router_again_runs_it_once(monkeypatch):
    """``route_bound_targets`` (kept for callers) and the default hook name one function: it runs once per bind."""
    from dmtp_hf.assistant import router
    from dmtp_hf.modeling import binding

    monkeypatch.setattr(binding, "_BIND_HOOKS", list(binding.DEFAULT_BIND_HOOKS))
    router.route_bound_targets()
    assert binding._bind_hooks() == [router.install_generate_router]


SUBCOMMANDS = ("demo", "convert", "info", "export-mtp", "setup-target", "eval", "bench", "calibrate", "push")
DELEGATED = ("train", "regenerate", "extract")
HEAVY = ("torch", "transformers", "accelerate", "peft", "dmtp_hf.training.trainer")


def test_every_subcommand_help_answers_without_the_heavy_modules():
    """``dmtp train --help`` took 27-47 s on a loaded machine: it imported the training stack to build its parser.
    Each subcommand's ``--help`` now runs in a fresh interpreter quickly, importing none of the heavy modules (the
    robust check; the wall-clock bound is generous for a loaded 2-core machine)."""
    import time

    started = time.perf_counter()
    loaded = run_python(
        f"""
        import contextlib, io, json, sys, time
        from dmtp_hf.cli import main
        report = {{}}
        for command in {list(SUBCOMMANDS + DELEGATED)!r}:
            out = io.StringIO()
            start = time.perf_counter()
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                main([command, "--help"])
            report[command] = {{"help": out.getvalue(), "seconds": time.perf_counter() - start}}
        print(json.dumps({{"heavy": [m for m in {HEAVY!r} if m in sys.modules], "report": report}}))
        """
    )
    elapsed = time.perf_counter() - started
    assert loaded["heavy"] == []
    for command, entry in loaded["report"].items():
        assert f"dmtp {command}" in entry["help"] and "--" in entry["help"], command
        assert entry["seconds"] < 5, (command, entry["seconds"])
    assert "--set KEY=VALUE" in loaded["report"]["train"]["help"]
    assert "--threads" in loaded["report"]["eval"]["help"]
    assert elapsed < 60  # one interpreter for all of them (the imports above are the whole cost)


def test_a_mistyped_training_key_is_refused_with_a_suggestion_before_torch_loads(tmp_path):
    """``--set max_step=20`` was reported after 155 s (the trainer imported, the target loaded) and without a hint."""
    config = tmp_path / "run.yaml"
    config.write_text("target_model: bundled\ntrain_data: synthetic:4x16\noutput_dir: out\n")
    loaded = run_python(
        f"""
        import contextlib, io, json, sys
        from dmtp_hf.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["train", "--config", {str(config)!r}, "--set", "max_step=20"])
        print(json.dumps({{"code": code, "err": err.getvalue(), "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
        """
    )
    assert loaded["code"] == 2 and loaded["heavy"] == []
    assert "Unknown config key(s): 'max_step' (did you mean 'max_steps'?)" in loaded["err"]


def test_the_light_choices_are_the_draft_configs_own():
    """The training config validates against `dmtp_hf.choices` (no torch): the same names the draft config takes."""
    from dmtp_hf import choices
    from dmtp_hf.modeling import configuration_dmtp

    assert choices.MTP_HIDDEN_INPUTS == configuration_dmtp.MTP_HIDDEN_INPUTS
    assert (choices.ANCHOR_LAYOUTS, choices.FUSIONS) == (configuration_dmtp.ANCHOR_LAYOUTS, configuration_dmtp.FUSIONS)
