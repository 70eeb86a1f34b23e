"""Hub-native repos: a pushed folder works with only ``transformers`` (remote code + ``custom_generate``), and with
the package installed; the card's header is valid Hub metadata and its usage snippets run."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM, AutoTokenizer

from dmtp_hf import DMTPDraftModel
from dmtp_hf.bundled import default_paths
from dmtp_hf.cli import main

# Runs a script in an interpreter where `dmtp_hf` cannot be imported, offline, with a private module cache.
BLOCK_DMTP = textwrap.dedent(
    """
    import importlib.abc, sys

    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "dmtp_hf" or name.startswith("dmtp_hf."):
                raise ImportError(f"{name} is blocked: this test runs with only transformers installed")

    sys.meta_path.insert(0, Refuse())
    """
)


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """The bundled DMTP draft pushed to a local folder (no upload)."""
    folder = tmp_path_factory.mktemp("hub") / "dmtp-repo"
    paths = default_paths(("target", "dmtp"))
    argv = [
        "push",
        str(paths["dmtp"]),
        "org/bundled-dmtp",
        "--local-dir",
        str(folder),
        "--no-upload",
        "--target",
        "org/target",
        "--training-data",
        "the target's regenerated answers",
    ]
    assert main(argv) == 0
    return folder, paths["target"]


def run_without_package(script: str, tmp_path: Path, *args: str) -> str:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "HF_HOME": str(tmp_path / "hf-home"),
    }
    env.pop("PYTHONPATH", None)
    run = subprocess.run(
        [sys.executable, "-c", BLOCK_DMTP + textwrap.dedent(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run.stdout


def test_the_folder_holds_its_own_code(pushed):
    folder, _ = pushed
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_dmtp.DMTPConfig",
        "AutoModel": "modeling_dmtp.DMTPDraftModel",
    }
    assert (folder / "configuration_dmtp.py").is_file() and (folder / "modeling_dmtp.py").is_file()
    generate = folder / "custom_generate" / "generate.py"
    assert generate.is_file() and "def generate(model" in generate.read_text()
    requirements = (folder / "custom_generate" / "requirements.txt").read_text()
    assert re.search(r"^torch>=\d+\.\d+$", requirements, re.M) and re.search(
        r"^transformers>=5\.24,<5\.25$", requirements, re.M
    )
    for file in [*folder.glob("*.py"), *(folder / "custom_generate").glob("*.py")]:
        text = file.read_text()
        assert not re.search(r"^\s*(from|import)\s+dmtp_hf", text, re.M), f"{file.name} imports the package"
        assert not re.search(r"^\s*from\s+\.\.", text, re.M), f"{file.name} has a parent-relative import"


def test_only_transformers_remote_code_and_custom_generate_are_lossless(pushed, tmp_path):
    folder, target_path = pushed
    script = """
        import sys, torch
        from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer
        folder, target_path = sys.argv[1], sys.argv[2]
        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
        tokenizer = AutoTokenizer.from_pretrained(target_path)
        tokenizer.padding_side = "left"
        draft = AutoModel.from_pretrained(folder, trust_remote_code=True)
        assert type(draft).__module__.startswith("transformers_modules"), type(draft).__module__
        chats = ["hello, how are you?", "Write the Python function `quote` of the `shlex` module.", "any pets?"]
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                               add_generation_prompt=True) for c in chats]
        for rows in (1, 3):
            inputs = tokenizer(texts[:rows], return_tensors="pt", padding=True, add_special_tokens=False)
            plain = target.generate(**inputs, do_sample=False, max_new_tokens=40)
            ours = target.generate(**inputs, custom_generate=folder, trust_remote_code=True, assistant_model=draft,
                                   do_sample=False, max_new_tokens=40)
            assert torch.equal(plain, ours), (rows, plain, ours)
        assert not any(name.startswith("dmtp_hf") for name in sys.modules)
        print("lossless without dmtp_hf")
    """
    assert "lossless without dmtp_hf" in run_without_package(script, tmp_path, str(folder), str(target_path))


def test_with_the_package_the_folder_needs_no_remote_code(pushed):
    folder, target_path = pushed
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    draft = DMTPDraftModel.from_pretrained(folder, target=target)
    assert type(draft) is DMTPDraftModel
    prompt = torch.tensor([[1, 314, 202, 3313, 15, 701]])
    plain = target.generate(prompt, do_sample=False, max_new_tokens=30)
    assert torch.equal(target.generate(prompt, assistant_model=draft, do_sample=False, max_new_tokens=30), plain)


def test_card_header_is_hub_metadata_and_its_snippets_run(pushed, tmp_path):
    folder, target_path = pushed
    card = ModelCard.load(folder / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "dmtp-hf" and data["pipeline_tag"] == "text-generation"
    assert data["base_model"] == "org/target" and data["license"] == "apache-2.0"
    assert {"speculative-decoding", "dmtp", "dflash", "mtp"} <= set(data["tags"])
    snippets = re.findall(r"```python\n(.*?)```", card.text, re.S)
    assert len(snippets) == 2
    local = [
        s.replace('"org/target"', repr(str(target_path)))
        .replace('"org/bundled-dmtp"', repr(str(folder)))
        .replace("max_new_tokens=256", "max_new_tokens=24")
        for s in snippets
    ]
    installed, remote = local
    namespace: dict = {}
    exec(compile(installed, "card-snippet-installed", "exec"), namespace)  # the package path, in process
    assert namespace["out"].shape[1] > namespace["inputs"]["input_ids"].shape[1]
    assert "print(" in remote and "lossless" not in remote
    run_without_package(remote, tmp_path)  # the remote-code path, without the package


def test_tokenizer_still_loads(pushed):
    _, target_path = pushed
    assert AutoTokenizer.from_pretrained(target_path).chat_template
