"""Scale-out: regeneration through an OpenAI-compatible server, distributed feature extraction, accelerate
configs for multi-process training."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from chat_endpoint import chat_endpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from dmtp_hf.bundled import default_paths
from dmtp_hf.training.regenerate import EndpointError, regenerate, regenerate_endpoint

REPO = Path(__file__).resolve().parents[1]
CHATS = [
    {"id": "a", "messages": [{"role": "user", "content": "hello, how are you?"}]},
    {"id": "b", "messages": [{"role": "user", "content": "Write the Python function `quote` of the `shlex` module."}]},
    {
        "id": "c",
        "messages": [
            {"role": "user", "content": "any pets?"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "what are their names?"},
        ],
    },
]


@pytest.fixture(scope="module")
def bundled_target():
    path = default_paths(("target",))["target"]
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def server(bundled_target):
    target, tokenizer = bundled_target
    http = chat_endpoint(target, tokenizer, name="bundled")
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{http.server_address[1]}"
    http.shutdown()
    http.server_close()


def write_chats(path: Path, rows=CHATS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def read(path: Path) -> dict:
    return {r["id"]: r["messages"] for r in map(json.loads, path.read_text().splitlines())}


def test_endpoint_regeneration_equals_local_regeneration(server, bundled_target, tmp_path):
    target, tokenizer = bundled_target
    data = write_chats(tmp_path / "chats.jsonl")
    regenerate(target, tokenizer, data, tmp_path / "local.jsonl", batch_size=1, max_new_tokens=32, progress=False)
    written = regenerate_endpoint(
        server, data, tmp_path / "remote.jsonl", model="bundled", concurrency=2, max_tokens=32, progress=False
    )
    assert written == 3
    assert read(tmp_path / "remote.jsonl") == read(tmp_path / "local.jsonl")
    assert read(tmp_path / "remote.jsonl")["c"][3]["role"] == "assistant"  # two turns regenerated in order
    # Resumable: nothing left to do, nothing written again.
    assert regenerate_endpoint(server, data, tmp_path / "remote.jsonl", progress=False, max_tokens=32) == 0


def test_endpoint_failures_name_the_record_and_the_server_message(server, tmp_path):
    bad = write_chats(tmp_path / "bad.jsonl", [{"id": "broken", "messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(EndpointError, match="record 'broken'.*404"):
        regenerate_endpoint(server + "/nowhere", bad, tmp_path / "out.jsonl", retries=1, progress=False)
    assert not (tmp_path / "out.jsonl").read_text()  # no half record


def test_dmtp_serve_is_gone_and_says_where_serving_went(capsys):
    from dmtp_hf.cli import main

    assert main(["serve", "--target", "bundled"]) == 2
    assert "python -m vllm.entrypoints.openai.api_server" in capsys.readouterr().err


def test_two_extraction_processes_write_the_same_features_as_one(tmp_path):
    data = write_chats(
        tmp_path / "chats.jsonl",
        [
            {
                "id": str(i),
                "messages": [
                    {"role": "user", "content": f"question {i}"},
                    {"role": "assistant", "content": f"an answer number {i}"},
                ],
            }
            for i in range(12)
        ],
    )
    common = [
        "extract",
        "--target",
        "bundled",
        "--data",
        str(data),
        "--target-layer-ids",
        "1,3",
        "--head-inputs",
        "--shard-size",
        "2",
        "--batch-size",
        "2",
        "--dtype",
        "keep",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    one = subprocess.run(
        [sys.executable, "-m", "dmtp_hf.cli", *common, "--output", str(tmp_path / "one")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--multi_gpu",
        "-m",
        "dmtp_hf.cli",
    ]
    two = subprocess.run(
        [*launch, *common, "--output", str(tmp_path / "two")], env=env, capture_output=True, text=True, timeout=600
    )
    assert two.returncode == 0, two.stderr[-3000:]
    shards = sorted(p.name for p in (tmp_path / "one").glob("features-*.safetensors"))
    assert len(shards) == 6 and shards == sorted(p.name for p in (tmp_path / "two").glob("features-*.safetensors"))
    for name in shards:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    index_one, index_two = (json.loads((tmp_path / d / "index.json").read_text()) for d in ("one", "two"))
    assert index_one == index_two


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO / "configs" / "accelerate").glob("*.yaml")))
def test_accelerate_configs_parse_and_build_their_plugins(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(REPO / "configs" / "accelerate" / f"{name}.yaml"))
    assert config.num_processes >= 1 and config.mixed_precision in ("no", "bf16")
    if config.distributed_type.value == "FSDP":
        from accelerate.utils import FullyShardedDataParallelPlugin

        fsdp = config.fsdp_config
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=fsdp["fsdp_version"],
            reshard_after_forward=fsdp["fsdp_reshard_after_forward"],
            state_dict_type=fsdp["fsdp_state_dict_type"],
        )
        assert plugin.fsdp_version == 2 and fsdp["fsdp_transformer_layer_cls_to_wrap"] == "DMTPDecoderLayer"
    if config.distributed_type.value == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] in (2, 3)
