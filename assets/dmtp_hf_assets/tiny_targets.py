"""Tiny random target checkpoints in each family's real on-disk layout, native MTP tensors included.

`make_tiny_target` builds the trunk with the family's Transformers class from a tiny config, ``save_pretrained``s
it, then writes the MTP tensors into the safetensors file(s) under the family's real key names and shapes:

=================  ==============================  =========================================================
family             trunk (as saved)                 MTP tensors
=================  ==============================  =========================================================
``qwen3_5``        ``Qwen3_5ForConditionalGeneration``  ``mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}``,
                   (``model.language_model.*``,    ``mtp.layers.0.*`` (gated full attention + dense MLP)
                   tiny vision tower, tied head)
``qwen3_5_moe``    ``Qwen3_5MoeForConditionalGeneration``  same names; fused experts
                   (untied head)                    ``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``
``qwen3_next``     ``Qwen3NextForCausalLM``        ``mtp.*``; per-expert ``mlp.experts.{e}.{gate,up,down}_proj``
``deepseek_v3``    ``DeepseekV3ForCausalLM``       ``model.layers.{N}.{enorm,hnorm,eh_proj,shared_head.norm}``,
                                                    MLA + MoE block, ``shared_head.head`` / ``embed_tokens`` copies
``glm4_moe``       ``Glm4MoeForCausalLM``          same names as DeepSeek, GQA + partial RoPE + MoE block
``mimo``           ``Qwen2ForCausalLM`` (config     ``model.mtp_layers.0.{token_layernorm,hidden_layernorm,``
                   ``architectures=[MiMoForCausalLM]``)  ``input_proj,final_layernorm}`` + Qwen2 block
=================  ==============================  =========================================================

Hybrid trunks (Qwen3.5, Qwen3-Next) have one linear-attention (GatedDeltaNet) and one full-attention layer; MoE
trunks have 4 experts. Every MTP tensor is random (seeded), norms included (``offset + 0.3 * randn`` with offset 0
for the zero-centred Qwen norms and 1 otherwise), so a loader that forgets the ``1 + w`` convention, swaps the
concat order or reads the embedding/LM-head *copies* (written as independent random tensors here, unlike the real
releases where they equal the trunk's) gives different logits.

``make_tiny_target(..., vllm_kernels=True)`` shapes the same layouts for vLLM's CPU kernels (`VLLM_KERNEL_SHAPES`):
attention heads of 32 (its CPU attention takes head sizes from 32 up), DeepSeek's MLA latent of 512 + 64 (the CPU MLA
decode kernel's only shape) and GatedDeltaNet heads of 128 (the CPU GDN kernel's); hidden size 64; the hybrid Qwen
trunks with three linear-attention layers to one full-attention layer (vLLM's KV cache groups then keep a drafter's
layers together). DeepSeek-V3's
config always names its router as the release does (``topk_method="noaux_tc"``, sigmoid scores): vLLM builds the
``e_score_correction_bias`` it loads from that.

Loading back: ``AutoModelForCausalLM.from_pretrained(path)`` works for every family (MiMo's config keeps
``model_type="qwen2"`` so that no remote code is needed; real MiMo-7B says ``"mimo"``, handled by the layout
resolver through ``architectures``). Transformers hard-codes the MTP ignore regex of DeepSeek-V3 (``layers.61``) and
GLM (``layers.92``/``layers.46``), so at tiny depth the MTP keys are reported as unexpected; `load_tiny_target`
temporarily points the class's ``_keys_to_ignore_on_load_unexpected`` at the tiny depth and leaves the same pattern
on the returned instance, which also lets Transformers' own ``MtpModel.from_pretrained`` find the MTP tensors.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

from dmtp_hf.modeling.native_mtp.fp8 import quantize_block_fp8
from dmtp_hf.modeling.native_mtp.loading import load_target_checkpoint, mtp_ignore_patterns  # noqa: F401 (re-export)

__all__ = [
    "FAMILIES",
    "VLLM_KERNEL_SHAPES",
    "continue_into_dmtp",
    "load_tiny_target",
    "make_tiny_dflash_draft",
    "make_tiny_target",
    "mtp_ignore_patterns",
    "read_checkpoint_tensors",
    "tiny_target_config",
    "tiny_tokenizer",
]

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "deepseek_v3", "glm4_moe", "mimo")
# Families whose RMSNorm is zero-centred (x_hat * (1 + w)); their random norms are centred on 0, the others on 1.
_ZERO_CENTRED = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# Block size written into the tiny FP8 checkpoints (real releases use [128, 128], larger than the tiny matrices).
TINY_FP8_BLOCK = (16, 16)

_VOCAB, _HIDDEN = 128, 32
# Text-config fields that shape each family for vLLM's CPU kernels (module docstring): still tiny, hidden size 64.
_QWEN_KERNEL_SHAPES = {
    # three linear-attention layers to one full-attention layer, as the releases: vLLM's hybrid KV cache groups
    # hold as many layers of each kind, so a drafter's attention layers (a DFlash block, an MTP head) share one
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
}
VLLM_KERNEL_SHAPES: dict[str, dict[str, int]] = {
    "qwen3_5": _QWEN_KERNEL_SHAPES,
    "qwen3_5_moe": _QWEN_KERNEL_SHAPES,
    "qwen3_next": _QWEN_KERNEL_SHAPES,
    "deepseek_v3": {
        "hidden_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "head_dim": 64,  # Transformers' rotary size for DeepSeek (= qk_rope_head_dim)
        "qk_nope_head_dim": 32,
        "qk_head_dim": 96,
        "v_head_dim": 32,
    },
    "glm4_moe": {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32},
    "mimo": {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1},
}
_TINY_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": _HIDDEN,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 16,
}


def tiny_target_config(family: str) -> PreTrainedConfig:
    """The tiny config of ``family``'s target (vocab 128, hidden 32, 2 layers)."""
    common = {"vocab_size": _VOCAB, "hidden_size": _HIDDEN, "initializer_range": 0.1, "max_position_embeddings": 512}
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        qwen = {
            **common,
            "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"],
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "mtp_num_hidden_layers": 1,
            "mtp_use_dedicated_embeddings": False,
        }
        moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
        moe["shared_expert_intermediate_size"] = 16
        if family == "qwen3_next":
            from transformers import Qwen3NextConfig

            rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
            return Qwen3NextConfig(**qwen, **moe, intermediate_size=64, rope_parameters=rope)
        # mRoPE as in the real checkpoints (text-only use: the three position rows are equal).
        rope = {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        }
        if family == "qwen3_5":
            from transformers import Qwen3_5Config

            text = {**qwen, "intermediate_size": 64, "rope_parameters": rope, "tie_word_embeddings": True}
            return Qwen3_5Config(text_config=text, vision_config=dict(_TINY_VISION), tie_word_embeddings=True)
        from transformers import Qwen3_5MoeConfig

        text = {**qwen, **moe, "rope_parameters": rope, "tie_word_embeddings": False}
        return Qwen3_5MoeConfig(text_config=text, vision_config=dict(_TINY_VISION), tie_word_embeddings=False)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config

        return DeepseekV3Config(
            **common,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=8,
            qk_rope_head_dim=8,
            v_head_dim=8,
            num_nextn_predict_layers=1,
            # the releases' router, as vLLM reads it (Transformers' DeepSeek-V3 always routes this way)
            topk_method="noaux_tc",
            scoring_func="sigmoid",
        )
    if family == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(
            **common,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            use_qk_norm=True,
            attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            num_nextn_predict_layers=1,
        )
    if family == "mimo":
        from transformers import Qwen2Config

        return Qwen2Config(
            **common,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_nextn_predict_layers=1,
        )
    raise ValueError(f"Unknown tiny target family {family!r}; choose one of {FAMILIES}")


def _target_class(family: str) -> type[PreTrainedModel]:
    import transformers

    name = {
        "qwen3_5": "Qwen3_5ForConditionalGeneration",
        "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
        "qwen3_next": "Qwen3NextForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "glm4_moe": "Glm4MoeForCausalLM",
        "mimo": "Qwen2ForCausalLM",
    }[family]
    return getattr(transformers, name)


def _mtp_block_config(text_config: PreTrainedConfig) -> PreTrainedConfig:
    """One full-attention layer, MoE where the family has it (written independently of the loader on purpose)."""
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"]
    if hasattr(config, "first_k_dense_replace"):
        config.first_k_dense_replace = 0
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    return config


def _random_like(name: str, tensor: torch.Tensor, norm_offset: float, generator: torch.Generator) -> torch.Tensor:
    noise = torch.randn(tensor.shape, generator=generator)
    if tensor.ndim == 1 and "norm" in name and name.endswith("weight"):
        return norm_offset + 0.3 * noise
    if tensor.ndim == 1:  # biases, router correction bias
        return 0.1 * noise
    return noise / math.sqrt(tensor.shape[-1])  # fan-in scaling keeps activations O(1)


def _mtp_tensors(family: str, text_config: PreTrainedConfig, decoder_layer_class: type, seed: int) -> dict:
    """Random MTP tensors of ``family`` under its real checkpoint names."""
    generator = torch.Generator().manual_seed(seed + 1)
    norm_offset = 0.0 if family in _ZERO_CENTRED else 1.0
    hidden, vocab = text_config.hidden_size, text_config.vocab_size
    block = decoder_layer_class(_mtp_block_config(text_config), 0)
    block_tensors = {}
    for name, tensor in block.state_dict().items():
        tensor = _random_like(name, tensor, norm_offset, generator)
        if name.endswith("experts.gate_up_proj") and family != "qwen3_5_moe":
            # Per-expert layout (DeepSeek/GLM/Qwen3-Next releases): gate rows first in the fused tensor.
            base, intermediate = name[: -len("gate_up_proj")], tensor.shape[1] // 2
            for expert in range(tensor.shape[0]):
                block_tensors[f"{base}{expert}.gate_proj.weight"] = tensor[expert, :intermediate].clone()
                block_tensors[f"{base}{expert}.up_proj.weight"] = tensor[expert, intermediate:].clone()
        elif name.endswith("experts.down_proj") and family != "qwen3_5_moe":
            base = name[: -len("down_proj")]
            for expert in range(tensor.shape[0]):
                block_tensors[f"{base}{expert}.down_proj.weight"] = tensor[expert].clone()
        else:
            block_tensors[name] = tensor

    def norm() -> torch.Tensor:
        return norm_offset + 0.3 * torch.randn(hidden, generator=generator)

    projection = torch.randn(hidden, 2 * hidden, generator=generator) / math.sqrt(2 * hidden)
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        prefix = "mtp."
        specific = {
            "fc.weight": projection,
            "pre_fc_norm_embedding.weight": norm(),
            "pre_fc_norm_hidden.weight": norm(),
            "norm.weight": norm(),
        }
        block_prefix = "layers.0."
    elif family in ("deepseek_v3", "glm4_moe"):
        prefix = f"model.layers.{text_config.num_hidden_layers}."
        specific = {
            "enorm.weight": norm(),
            "hnorm.weight": norm(),
            "eh_proj.weight": projection,
            "shared_head.norm.weight": norm(),
            # Copies of the shared embedding / head in the real releases; independent noise here (see module doc).
            "shared_head.head.weight": torch.randn(vocab, hidden, generator=generator),
            "embed_tokens.weight": torch.randn(vocab, hidden, generator=generator),
        }
        block_prefix = ""
    else:  # mimo
        prefix = "model.mtp_layers.0."
        specific = {
            "token_layernorm.weight": norm(),
            "hidden_layernorm.weight": norm(),
            "input_proj.weight": projection,
            "final_layernorm.weight": norm(),
        }
        block_prefix = ""
    tensors = {prefix + name: tensor for name, tensor in specific.items()}
    tensors.update({prefix + block_prefix + name: tensor for name, tensor in block_tensors.items()})
    return {name: tensor.to(torch.float32).contiguous() for name, tensor in tensors.items()}


def _is_fp8_candidate(name: str, tensor: torch.Tensor) -> bool:
    # Linear weights of the MTP layer; norms, the MoE router and the embedding/head copies stay high precision.
    skip = ("norm", "mlp.gate.weight", "embed_tokens", "shared_head.head")
    return tensor.ndim == 2 and name.endswith(".weight") and not any(part in name for part in skip)


def read_checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (single-file or sharded) safetensors checkpoint directory, by name."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
    tensors = {}
    for file in files or ["model.safetensors"]:
        with safe_open(str(path / file), framework="pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def _write_checkpoint(path: Path, trunk: dict, mtp: dict, sharded: bool) -> None:
    for old in [*path.glob("*.safetensors"), *path.glob("model.safetensors.index.json")]:
        old.unlink()
    metadata = {"format": "pt"}
    if not sharded:
        save_file({**trunk, **mtp}, str(path / "model.safetensors"), metadata=metadata)
        return
    # Three shards like a real release: the first holds trunk tensors only, the MTP tensors straddle the last two.
    trunk_names, mtp_names = list(trunk), list(mtp)
    half_trunk, half_mtp = len(trunk_names) // 2, len(mtp_names) // 2
    groups = [trunk_names[:half_trunk], trunk_names[half_trunk:] + mtp_names[:half_mtp], mtp_names[half_mtp:]]
    tensors = {**trunk, **mtp}
    weight_map, total_size = {}, 0
    for index, names in enumerate(groups, start=1):
        shard = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: tensors[name] for name in names}, str(path / shard), metadata=metadata)
        for name in names:
            weight_map[name] = shard
            total_size += tensors[name].numel() * tensors[name].element_size()
    index_data = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index_data, indent=2))


def make_tiny_target(
    family: str,
    directory: str | Path,
    *,
    seed: int = 0,
    sharded: bool = False,
    fp8: bool = False,
    with_mtp: bool = True,
    config_overrides: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    text_overrides: dict[str, Any] | None = None,
    vllm_kernels: bool = False,
) -> Path:
    """Write a tiny random ``family`` target checkpoint, native MTP tensors included, and return its path.

    Args:
        family: One of `FAMILIES`.
        directory: Where to write (created if needed); the checkpoint is written directly into it.
        seed: Seeds the trunk and the MTP tensors (the build is deterministic).
        sharded: Write three shards plus ``model.safetensors.index.json`` (first shard: trunk only; MTP tensors
            split over the last two).
        fp8: Store the MTP layer's linear weights as block-scaled float8_e4m3fn with ``*.weight_scale_inv`` and add
            ``quantization_config`` (``weight_block_size`` `TINY_FP8_BLOCK`) to ``config.json``, as the DeepSeek/GLM
            FP8 releases do.
        with_mtp: Write the MTP tensors (False: a target checkpoint without an MTP head).
        config_overrides: Extra keys merged into the saved (text) config, e.g. ``{"num_nextn_predict_layers": 0}``.
        vocab_size: Build the model with this vocabulary instead of 128 (e.g. a tiny vocab for exact-distribution
            sampling tests).
        text_overrides: Text-config fields changed *before* the model is built (e.g. a bigger hidden size for
            benchmarks); unlike ``config_overrides`` they shape the weights.
        vllm_kernels: Shape the attention for vLLM's CPU kernels (`VLLM_KERNEL_SHAPES`); ``text_overrides`` win.
    """
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_target_config(family)
    overrides = {**(VLLM_KERNEL_SHAPES[family] if vllm_kernels else {}), **(text_overrides or {})}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    text_config = config.get_text_config(decoder=True)
    for key, value in overrides.items():
        setattr(text_config, key, value)
        if key == "vocab_size" and text_config is not config:
            config.vocab_size = value
    torch.manual_seed(seed)
    model = _target_class(family)(config).eval()
    model.save_pretrained(path)

    text_config = model.config.get_text_config(decoder=True)
    decoder_layer_class = type(model.get_decoder().layers[-1])
    mtp = _mtp_tensors(family, text_config, decoder_layer_class, seed) if with_mtp else {}
    if fp8:
        quantized = {}
        for name, tensor in mtp.items():
            if _is_fp8_candidate(name, tensor):
                quantized[name], quantized[name + "_scale_inv"] = quantize_block_fp8(tensor, TINY_FP8_BLOCK)
            else:
                quantized[name] = tensor
        mtp = quantized
    trunk = read_checkpoint_tensors(path)
    _write_checkpoint(path, trunk, mtp, sharded)

    config_file = path / "config.json"
    saved = json.loads(config_file.read_text())
    target = saved["text_config"] if "text_config" in saved else saved
    target.update(config_overrides or {})
    if family == "mimo":
        # `save_pretrained` writes the trunk class; the release names its own (remote-code) architecture.
        saved["architectures"] = ["MiMoForCausalLM"]
    if fp8:
        saved["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(TINY_FP8_BLOCK),
        }
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True))
    return path


def load_tiny_target(path: str | Path, **kwargs: Any) -> PreTrainedModel:
    """A tiny target checkpoint loaded for tests (`dmtp_hf.modeling.native_mtp.load_target_checkpoint`)."""
    return load_target_checkpoint(path, **kwargs)


def _tiny_draft_config(target: str | Path, **overrides: Any):
    """A one-layer draft's config for the tiny target at ``target``: its features are the target's first and last
    layers, its attention heads of 32 with the target's number of KV heads (vLLM's CPU kernels take heads of 32 and
    up, and its hybrid KV cache groups keep a drafter's layers with the target's full-attention layers when their
    shapes match)."""
    from dmtp_hf import DMTPConfig

    text = load_target_checkpoint(target).config.get_text_config()
    return DMTPConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=2 * text.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=min(2, getattr(text, "num_key_value_heads", 1) or 1),
        head_dim=32,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=[0, text.num_hidden_layers - 1],
        mask_token_id=text.vocab_size - 1,
        **overrides,
    )


def make_tiny_dflash_draft(target: str | Path, directory: str | Path, *, seed: int = 1) -> Path:
    """A random DFlash draft for the tiny target at ``target`` in z-lab's layout (``DFlashDraftModel``, what z-lab
    publishes), one block layer shaped for vLLM's CPU kernels (`_tiny_draft_config`)."""
    from dmtp_hf import DMTPDraftModel

    torch.manual_seed(seed)
    path = Path(directory)
    DMTPDraftModel(_tiny_draft_config(target, anchor_layout="dflash", fusion="none")).save_dflash(path)
    return path


def continue_into_dmtp(
    target: str | Path, dflash: str | Path, directory: str | Path, *, steps: int = 3, seed: int = 0
) -> Path:
    """The path from a DFlash checkpoint to a DMTP draft, in miniature: the DFlash draft at ``dflash`` continued as a
    dual-anchor DMTP draft with the residual fusion (zero at the start: DFlash conditioned on T1) for ``steps``
    training steps on random tokens, the target's own MTP head frozen (`dmtp_hf.training.Trainer`). Returns the
    trained draft's folder (``directory/final``)."""
    from dmtp_hf.training import TrainConfig, Trainer
    from dmtp_hf.training.data import TokenizedDataset

    model = load_target_checkpoint(target)
    vocab = model.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab - 1, (24,), generator=generator) for _ in range(8)]
    data = TokenizedDataset([{"input_ids": ids, "loss_mask": torch.ones_like(ids)} for ids in tokens])
    config = TrainConfig.from_dict(
        {
            "target_model": str(target),
            "init_from": str(dflash),
            "anchor_layout": "dual",
            "fusion": "residual",
            "draft_config": {"mask_token_id": vocab - 1},
            "train_data": "unused",  # the dataset is given
            "max_length": 32,
            "num_anchors": 8,
            "micro_batch_size": 4,
            "max_steps": steps,
            "learning_rate": 3e-3,
            "warmup_ratio": 0.1,
            "output_dir": str(directory),
            "save_every": 0,
            "eval_every": 0,
            "report_to": "none",
            "resume_from": None,
            "seed": seed,
        }
    )
    Trainer(config, target=model, train_dataset=data).train()
    return Path(directory) / "final"


def make_tiny_llama(directory: str | Path, *, seed: int = 0, vocab_size: int = 128) -> Path:
    """A tiny random Llama checkpoint with tied embeddings and no MTP head (SmolLM2's architecture in miniature)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    path = Path(directory)
    LlamaForCausalLM(config).eval().save_pretrained(path)
    return path


# The tiny tokenizer: a few words of the evaluation prompts, ChatML specials (`<|im_end|>` = 1 = the tiny targets' EOS).
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think> </think>\n{%- endif %}{%- endif %}"
)
WORDS = (
    "the a of to and is in what how many write python function number if you are for with that this it be on by "
    "as can your + = ? . , $ ( ) : 1 2 3 4 5 0 def return list x y n each has more than his her their they we "
    "<think> </think> user assistant"
).split()
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "[UNK]"]  # <|im_end|> = 1 = the tiny target's EOS


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the tiny targets' vocabulary (ids below 127, the drafts' mask token) with a ChatML
    template: enough for the CLI's chat prompts on a tiny target."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    assert len(vocab) < 127  # 127 is the drafts' mask token
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="[UNK]",
        chat_template=CHAT_TEMPLATE,
    )
