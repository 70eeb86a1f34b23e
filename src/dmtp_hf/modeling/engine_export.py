"""Checkpoints for serving engines: a DMTP draft and its MTP head as one folder vLLM loads (``dmtp convert --to
vllm``), the LM head rows a draft vocabulary needs in any engine folder, and a DFlash draft as the assistant
Transformers' own DFlash path runs (`transformers_dflash_assistant`).

The vLLM folder is the DFlash layout (`io.save_dflash_checkpoint`) plus what DMTP adds, so the ``dmtp-vllm`` plugin
(``integrations/vllm``) can build the draft from vLLM's own DFlash classes:

* ``config.json``: the DFlash config with ``architectures: ["DFlashDMTPDraftModel"]`` (vLLM keeps a name that starts
  with ``DFlash`` and looks it up in its model registry, where the plugin registers it),
  ``eagle_aux_hidden_state_layer_ids`` = the DFlash feature layers (vLLM numbering: ``target_layer_ids + 1``) plus the
  target's depth when they do not end there (the last layer's output, from which the plugin applies the target's
  final norm: the hidden the MTP head reads), and ``dmtp_config`` (the fusion, the number of proposals, and
  ``mtp``: the head's layout);
* ``model.safetensors``: the DFlash tensors (unprefixed), ``lm_head.weight`` (the target's LM head rows of the draft
  vocabulary, when there is one), ``fusion.*``, and a retrofitted head under ``mtp.*`` in the head's own module
  names, with ``mtp.lm_head.weight`` and ``mtp.token_ids`` when the head predicts over a draft vocabulary. A
  family's own head (DeepSeek-V3, GLM-4.x, MiMo, Qwen3-Next, Qwen3.5/3.6) is not copied: ``dmtp_config.mtp.source``
  is ``"target"`` and the plugin loads the head from the target checkpoint into the family's vLLM MTP model, as
  vLLM's ``mtp`` method does.

A draft vocabulary's logits need the target's LM head rows of that vocabulary: vLLM keeps the *first*
``draft_vocab_size`` rows of a shared LM head and then maps them through ``d2t``, which is right only when the subset
is the first ids. So every engine folder of a draft with a vocabulary carries its own ``lm_head.weight``
(`draft_vocab_lm_head`), as EAGLE-3 drafts do.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from .draft_vocab import draft_token_ids
from .io import atomic_directory, backbone_state_dict

__all__ = [
    "VLLM_ARCHITECTURE",
    "dflash_state_dict",
    "draft_vocab_lm_head",
    "is_retrofitted",
    "save_vllm_draft",
    "transformers_dflash_assistant",
    "vllm_config",
]

VLLM_ARCHITECTURE = "DFlashDMTPDraftModel"


def draft_vocab_lm_head(model: nn.Module, lm_head: nn.Module) -> torch.Tensor | None:
    """The rows of ``lm_head`` (the target's) for ``model``'s draft vocabulary, ``[draft_vocab, H]``; None without a
    draft vocabulary (engines then share the target's whole LM head)."""
    if getattr(model, "d2t", None) is None:
        return None
    return lm_head.weight.detach()[draft_token_ids(model).to(lm_head.weight.device)].contiguous()


def dflash_state_dict(draft: nn.Module) -> dict[str, torch.Tensor]:
    """A DMTP draft's tensors for a DFlash folder: its state dict, plus ``lm_head.weight`` (the target's rows of its
    draft vocabulary) when it has one, which needs the draft bound to its target."""
    state = draft.state_dict()
    if draft.d2t is None:
        return state
    if draft.get_input_embeddings() is None:  # unbound
        raise ValueError(
            "This draft predicts over a draft vocabulary, whose LM head rows engines read from the draft folder and "
            "which come from the target: bind the draft first (`dmtp convert ... --target DIR`)"
        )
    return {**state, "lm_head.weight": draft_vocab_lm_head(draft, draft.target_head)}


def is_retrofitted(head: nn.Module) -> bool:
    """Whether ``head`` (a `NativeMTPHead`) was trained for its target rather than shipped in the target checkpoint
    (the ``retrofit`` layout): only then does the vLLM folder carry a copy of it."""
    return head.layout.name == "retrofit"


def vllm_config(draft: nn.Module, head: nn.Module) -> dict[str, Any]:
    """The ``config.json`` of the vLLM folder (see the module docstring)."""
    config = draft.config
    if config.num_target_layers is None:
        raise ValueError("The draft's config has no num_target_layers; bind it to its target before exporting")
    out = config.to_dflash_dict()
    out["architectures"] = [VLLM_ARCHITECTURE]
    # vLLM captures each layer once: the last layer joins the features unless one of them is it already
    captured = [i + 1 for i in config.target_layer_ids]
    out["eagle_aux_hidden_state_layer_ids"] = captured + [config.num_target_layers] * (
        config.num_target_layers not in captured
    )
    head_config = head.config
    out["dmtp_config"] = {
        "anchor_layout": config.anchor_layout,
        "fusion": config.fusion,
        "num_candidates": config.num_candidates,
        "mtp_hidden_size": config.mtp_hidden_size,
        "mtp": {
            "layout": head.layout.name,
            "hidden_input": head.hidden_input,
            "hidden_first": head.hidden_first,
            "layer_model_type": head_config.model_type,
            "draft_vocab_size": None if head.d2t is None else int(head.d2t.numel()),
            "source": "draft" if is_retrofitted(head) else "target",
        },
    }
    calibration = config.dmtp_config.get("acceptance_calibration")
    if calibration:  # the plugin's adaptive widths read the draft's confidence through it, as `auto` does
        out["dmtp_config"]["acceptance_calibration"] = calibration
    return out


def save_vllm_draft(
    draft: nn.Module, head: nn.Module, save_directory: str | os.PathLike, dtype: torch.dtype | None = None
) -> None:
    """Write ``draft`` (a `DMTPDraftModel` bound to its target) and its MTP ``head`` (a `NativeMTPHead`) as one
    folder for vLLM with the ``dmtp-vllm`` plugin (see the module docstring). A family's own head is not written: the
    plugin reads the target checkpoint's, so a tuned one goes into a copy of the target first (``dmtp
    export-mtp``)."""
    config = draft.config
    if config.anchor_layout != "dual" or config.fusion not in ("residual", "none"):
        raise ValueError(
            f"The vLLM plugin runs dual-anchor DMTP drafts with residual (or no) fusion; this draft has "
            f"anchor_layout={config.anchor_layout!r}, fusion={config.fusion!r}"
        )
    if config.backbone != "dflash":
        raise NotImplementedError("DMTP(D2) drafts need vLLM's DFlash2, which runs on the V2 runner (Triton, GPU)")
    tensors = backbone_state_dict(dflash_state_dict(draft))
    if draft.fusion is not None:
        tensors.update({f"fusion.{k}": v.detach() for k, v in draft.fusion.state_dict().items()})
    if is_retrofitted(head):  # a family's own head stays in the target checkpoint (module docstring)
        for name, tensor in head.state_dict().items():
            if name not in ("d2t", "t2d") and "rotary_emb" not in name:
                tensors[f"mtp.{name}"] = tensor.detach()
        mtp_head = draft_vocab_lm_head(head, head.lm_head)
        if mtp_head is not None:
            tensors["mtp.lm_head.weight"] = mtp_head
            tensors["mtp.token_ids"] = draft_token_ids(head)
    tensors = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous() for k, v in tensors.items()
    }
    out = vllm_config(draft, head)
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    with atomic_directory(save_directory) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")


# Our DFlash tensor names -> those of the assistant class Transformers' DFlash path runs (the rest are the same).
_TRANSFORMERS_DFLASH_NAMES = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}


def transformers_dflash_assistant(draft: nn.Module, full_vocabulary: bool = False) -> nn.Module:
    """The same DFlash weights as the assistant of Transformers' own DFlash path
    (``target.generate(..., assistant_model=it, speculation_type="dflash")``, ``DFlashTokenCandidateGenerator``).

    Transformers ships one class that path runs, ``MuseGlimmerAssistantModel``: a z-lab DFlash backbone (context
    projection and its norm, decoder layers whose K/V read the projected target features and the block, QK-norm,
    bidirectional within the block), so a DFlash draft converts by renaming two tensors. Its block holds
    ``num_candidates + 1`` slots, as our engine drafts. Refused, with the reason: a draft that is not a DFlash draft
    (DMTP's block is conditioned on T1; DFlash2's layers add convolutions and a selector), and a draft vocabulary
    unless ``full_vocabulary``: Transformers scores the draft's hidden state with the target's whole LM head, whose
    rows of the draft vocabulary are the draft's own LM head, so candidates differ only where a token outside the
    draft vocabulary scores highest.
    """
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    config = draft.config
    layout = config.dmtp_config.get("anchor_layout")
    if layout != "dflash" or config.backbone == "dflash2":
        raise ValueError(
            f"Transformers' DFlash path runs plain DFlash drafts; this one is anchor_layout={layout!r} on the "
            f"{config.backbone} backbone"
        )
    if getattr(config, "draft_vocab_size", None) and not full_vocabulary:
        raise ValueError(
            f"This draft predicts over a {config.draft_vocab_size}-token draft vocabulary; Transformers' DFlash path "
            "scores the draft's hidden state with the target's LM head over the full vocabulary "
            "(full_vocabulary=True accepts that)"
        )
    assistant_config = MuseGlimmerAssistantConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=dict(config.rope_parameters),
        max_position_embeddings=config.max_position_embeddings,
        sliding_window=config.sliding_window or config.max_position_embeddings,  # read by sliding layers only
        layer_types=list(config.layer_types),
        hidden_act=config.hidden_act,
        block_size=config.dmtp_config["num_candidates"] + 1,
        mask_token_id=config.dflash_config["mask_token_id"],
        target_layer_ids=list(config.dflash_config["target_layer_ids"]),
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    assistant_config._attn_implementation = "sdpa"
    assistant = MuseGlimmerAssistantModel(assistant_config)
    backbone = backbone_state_dict(draft.state_dict())
    state = {_TRANSFORMERS_DFLASH_NAMES.get(name, name): tensor for name, tensor in backbone.items()}
    assistant.load_state_dict({name: state[name] for name in assistant.state_dict() if "rotary_emb" not in name})
    parameter = next(draft.parameters())
    return assistant.to(device=parameter.device, dtype=parameter.dtype).eval()
