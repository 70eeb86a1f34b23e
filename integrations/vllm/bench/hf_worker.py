"""Transformers (plain ``generate``) or dmtp-hf's own engine as a benchmark worker, same protocol as
``vllm_worker.py``; runs in dmtp-hf's environment. Jobs hold one prompt each (these engines decode one request at
a time here; dmtp-hf's batched decoding is measured by ``dmtp bench``)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM

import dmtp_hf
from dmtp_hf.modeling import DMTPDraftModel, load_native_mtp


def answer(message: dict) -> None:
    """One answer line for the orchestrator."""
    print("@@ " + json.dumps(message), flush=True)


def main() -> None:
    """Serve jobs until stdin closes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--draft", default=None, help="a DMTP draft (dmtp-hf layout); none: plain generate")
    parser.add_argument("--mtp-head", default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = None
    if args.draft:
        head = load_native_mtp(target, checkpoint=args.mtp_head) if args.mtp_head else None
        draft = DMTPDraftModel.from_pretrained(args.draft).bind(target, native_mtp=head).eval()
    target.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)  # warm-up
    answer({"ready": True})
    for line in sys.stdin:
        job = json.loads(line)
        if len(job["prompts"]) != 1:
            raise ValueError("hf_worker decodes one request per job")
        prompt = job["prompts"][0]
        ids = torch.tensor([prompt["prompt_token_ids"]])
        options = dict(do_sample=False, max_new_tokens=prompt["max_tokens"])
        start = time.perf_counter()
        if draft is None:
            out, hist = target.generate(ids, **options), []
        else:
            result = dmtp_hf.generate(target, ids, draft, return_dict_in_generate=True, **options)
            out, hist = result.sequences, result.spec_stats.hist
        seconds = time.perf_counter() - start
        answer(
            {
                "tokens": [out[0, ids.shape[1] :].tolist()],
                "seconds": seconds,
                "drafts": sum(hist),
                "accepted": sum(k * n for k, n in enumerate(hist)),
                "per_pos": [sum(hist[i + 1 :]) for i in range(max(len(hist) - 1, 0))],
            }
        )


if __name__ == "__main__":
    main()
