"""The reference the vLLM tests compare with: the same DMTP draft decoding the same prompts in dmtp-hf's own engine.

Runs in dmtp-hf's environment (not vLLM's: the two pin different transformers). Writes JSON with, per prompt, the
prompt's token ids (so that vLLM decodes exactly the same input), the greedy tokens, the number of verify rounds
and how many rounds accepted at least i + 1 proposals (vLLM's ``spec_decode_num_accepted_tokens_per_pos``).

    .venv/bin/python integrations/vllm/tests/hf_reference.py --target DIR --draft DIR --mtp-head DIR \
        --prompts prompts.json --out reference.json
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM

import dmtp_hf
from dmtp_hf.modeling import DMTPDraftModel, load_native_mtp


def main() -> None:
    """Decode the prompts with dmtp-hf and write the reference JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", required=True, help="the DMTP draft in dmtp-hf's layout")
    parser.add_argument("--mtp-head", required=True)
    parser.add_argument("--prompts", required=True, help='JSON: [{"prompt_token_ids": [...], "max_tokens": n}]')
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    head = load_native_mtp(target, checkpoint=args.mtp_head)
    draft = DMTPDraftModel.from_pretrained(args.draft).bind(target, native_mtp=head).eval()
    results = []
    for item in json.load(open(args.prompts)):
        ids = torch.tensor([item["prompt_token_ids"]])
        out = dmtp_hf.generate(
            target, ids, draft, do_sample=False, max_new_tokens=item["max_tokens"], return_dict_in_generate=True
        )
        hist = out.spec_stats.hist
        results.append(
            {
                "tokens": out.sequences[0, ids.shape[1] :].tolist(),
                "rounds": sum(hist),
                "accepted_per_pos": [sum(hist[i + 1 :]) for i in range(len(hist) - 1)],
            }
        )
    with open(args.out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
