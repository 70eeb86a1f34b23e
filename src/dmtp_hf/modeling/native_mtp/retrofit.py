"""A new MTP head for a target that ships none (most causal LMs people run): the DeepSeek/Qwen MTP recipe.

``g_t = final_norm(layer(projection([embedding_norm(E(x_{t+1})) ; hidden_norm(h_t)])))``, with one decoder layer of
the target's own class, the target's embedding and (tied) LM head, and the ``retrofit`` layout's Qwen-style names.
It is initialised so that training starts from something sensible: the decoder layer and the final norm are copies of
the target's last layer and final norm, and the projection adds the two normalised halves. Train it with the target
frozen (``train_mtp_head: only`` in a training config, ``mtp_retrofit: true``); `load_native_mtp(target,
checkpoint=...)` then reads the saved head like any native one.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from .head import HiddenInput, NativeMTPHead
from .layouts import get_mtp_layout

__all__ = ["new_mtp_head"]


@torch.no_grad()
def new_mtp_head(
    target: PreTrainedModel,
    *,
    hidden_input: HiddenInput = "post_norm",
    layout: str = "retrofit",
    dtype: torch.dtype | None = None,
) -> NativeMTPHead:
    """A freshly initialised MTP head for ``target`` (see the module docstring), on the target's LM-head device."""
    head = NativeMTPHead(target, get_mtp_layout(layout), hidden_input=hidden_input)
    decoder = target.get_decoder()
    last = decoder.layers[-1]
    if type(last) is type(head.layer):
        try:
            head.layer.load_state_dict(last.state_dict())
        except RuntimeError:  # a hybrid target's last layer may not be a full-attention one: keep the fresh init
            pass
    head.final_norm.load_state_dict(decoder.norm.state_dict())
    hidden = head.projection.out_features
    eye = torch.eye(hidden, dtype=head.projection.weight.dtype)
    head.projection.weight.copy_(torch.cat([eye, eye], dim=1) * 0.5)
    weight = target.get_output_embeddings().weight
    return head.to(device=weight.device, dtype=dtype or weight.dtype).eval()
