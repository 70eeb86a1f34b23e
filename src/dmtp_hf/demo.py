"""``dmtp demo``: what the README's first command runs.

Until the bundled trained models exist (reproduction issue), the demo uses a tiny *randomly initialised*
Qwen3 target and DMTP draft built in code, and says so: it shows the draft's interface end to end (binding,
one drafting block, DFlash-layout conversion), not real acceptance.
"""

from __future__ import annotations

import tempfile

import torch


def run_demo(max_new_tokens: int = 48, seed: int = 0) -> int:
    """Run the demo and return a process exit code."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .modeling import DMTPConfig, DMTPDraftModel

    torch.manual_seed(seed)
    print("NOTE: no bundled trained models yet -- this demo uses a tiny RANDOMLY INITIALISED target and draft.")
    target = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    ).eval()
    draft = DMTPDraftModel(
        DMTPConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_target_layers=4,
            target_layer_ids=[0, 2],
            mask_token_id=255,
        )
    ).bind(target)
    cfg = draft.config
    print(f"draft: layout={cfg.anchor_layout} fusion={cfg.fusion} candidates={cfg.num_candidates}")

    prompt = torch.randint(0, 250, (1, 12))
    with torch.no_grad():
        out = target(prompt, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i + 1] for i in cfg.target_layer_ids], dim=-1)
        anchor = out.logits[:, -1].argmax(-1)  # A: the token the target just emitted
        t1 = torch.randint(0, 250, (1,))  # stands in for the native MTP head's first candidate
        mtp_hidden = torch.randn(1, cfg.hidden_size)
        block = draft.block_embeddings(anchor, t1, mtp_hidden)
        positions = torch.cat([torch.arange(12), draft.block_position_ids(torch.tensor([12]))[0]])[None]
        hidden = draft(block, features, positions).last_hidden_state
        proposals = draft.compute_logits(hidden[:, cfg.first_predicted_slot :]).argmax(-1)
    print(f"prompt ids: {prompt[0].tolist()}")
    print(f"A={anchor.item()} T1={t1.item()} -> DFlash proposals T2..T7: {proposals[0].tolist()}")

    with tempfile.TemporaryDirectory() as tmp:
        draft.save_pretrained(tmp)
        reloaded = DMTPDraftModel.from_pretrained(tmp, target=target)
        same = all(torch.equal(a, b) for a, b in zip(draft.state_dict().values(), reloaded.state_dict().values()))
        draft.save_dflash(f"{tmp}/dflash")
        print(
            f"save/load round trip exact: {same}; DFlash-layout copy written (fusion is still zero: "
            f"{draft.fusion.is_noop()})"
        )
    return 0
