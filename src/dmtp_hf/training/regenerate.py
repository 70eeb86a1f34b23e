"""Regenerate the assistant turns of a chat dataset with the target itself (``dmtp regenerate``).

Drafts accept best on text the target would write (same model, same chat template, same thinking mode), so the
training responses are rewritten by the target: greedy (T = 0) by default, batched with left padding. Multi-turn
conversations are regenerated turn by turn: the k-th assistant turn is generated from the history that already
contains the regenerated turns ``< k``. A conversation ending with a user turn gets one generated reply.

Output: JSONL ``{"id": ..., "messages": [...]}`` (OpenAI form). The run is resumable: records are appended as
they complete, and ids already in the output file are skipped (a truncated last line from a killed run is dropped).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .arguments import regenerate_parser
from .data import conversation_from_record, read_jsonl

__all__ = ["EndpointError", "completed_ids", "main", "regenerate", "regenerate_endpoint"]


def completed_ids(output_path: str | os.PathLike) -> set[str]:
    """Ids already written to ``output_path``; a trailing partial line (killed run) is truncated away."""
    path = Path(output_path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    good = data.rfind(b"\n") + 1  # everything after the last newline is a partial record
    if good != len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return {str(json.loads(line)["id"]) for line in data[:good].decode("utf-8").splitlines() if line.strip()}


def _turns_to_generate(messages: list[dict[str, str]]) -> list[int]:
    """Indices of the assistant turns to rewrite (plus one past the end when the conversation ends with a user)."""
    indices = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages[-1]["role"] == "user":
        indices.append(len(messages))
    return indices


def left_pad(rows: list[list[int]], pad_id: int, device) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` ``[B, max_len]`` padded on the left (generation continues every row from its
    own last token), without touching the caller's tokenizer settings."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return {"input_ids": ids, "attention_mask": mask}


@torch.no_grad()
def regenerate(
    target: Any,
    tokenizer: Any,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 2048,
    temperature: float = 0.0,
    enable_thinking: bool | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    limit: int | None = None,
    progress: bool = True,
) -> int:
    """Rewrite every assistant turn of ``input_path`` with ``target``; append results to ``output_path``.

    Returns the number of records written by this call (already-completed ids are skipped).
    """
    template_kwargs = dict(chat_template_kwargs or {})
    if enable_thinking is not None:
        template_kwargs["enable_thinking"] = enable_thinking
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    todo = _records_to_do(input_path, output_path, limit)
    # Batches of similar prompt lengths pad (and so compute) less; the output order does not matter (ids do).
    todo.sort(key=lambda record: len(tokenizer.apply_chat_template(record[1][:1], tokenize=False)))

    device = next(target.parameters()).device
    sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature}
    written = 0
    Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    with open(output_path, "a", encoding="utf-8") as out, tqdm(total=len(todo), disable=not progress) as bar:
        for start in range(0, len(todo), batch_size):
            batch = todo[start : start + batch_size]
            histories: list[list[dict[str, str]]] = [[] for _ in batch]
            plans = [_turns_to_generate(messages) for _, messages in batch]
            sources = [messages for _, messages in batch]
            for turn in range(max(len(p) for p in plans)):
                rows = [r for r, plan in enumerate(plans) if turn < len(plan)]
                prompts = []
                for r in rows:
                    end = plans[r][turn]
                    # history message i replaces source message i, so the source is consumed up to len(history)
                    histories[r].extend(sources[r][len(histories[r]) : end])
                    prompts.append(
                        tokenizer.apply_chat_template(
                            histories[r], tokenize=False, add_generation_prompt=True, **template_kwargs
                        )
                    )
                encoded = left_pad(tokenizer(prompts, add_special_tokens=False)["input_ids"], pad_id, device)
                generated = target.generate(**encoded, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **sampling)
                replies = tokenizer.batch_decode(
                    generated[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True
                )
                for r, reply in zip(rows, replies, strict=True):
                    histories[r].append({"role": "assistant", "content": reply})
            for (record_id, source), history in zip(batch, histories, strict=True):
                history.extend(source[len(history) :])  # trailing non-user turns (e.g. tool output) are kept
                out.write(json.dumps({"id": record_id, "messages": history}, ensure_ascii=False) + "\n")
                written += 1
            out.flush()
            bar.update(len(batch))
    return written


class EndpointError(RuntimeError):
    """A record could not be regenerated through the endpoint (after the retries); the message names it."""


def _records_to_do(input_path, output_path, limit: int | None) -> list[tuple[str, list[dict[str, str]]]]:
    done = completed_ids(output_path)
    todo = []
    for line_no, record in read_jsonl(input_path):
        record_id = str(record.get("id", line_no))
        if record_id not in done:
            todo.append((record_id, conversation_from_record(record, f"{input_path}:{line_no}")))
        if limit is not None and len(todo) + len(done) >= limit:
            break
    return todo


def _chat_completion(url: str, payload: dict[str, Any], record_id: str, retries: int, timeout: float) -> str:
    """One chat completion through an OpenAI-compatible server, retried with exponential backoff."""
    import time
    import urllib.error
    import urllib.request

    body = json.dumps(payload).encode("utf-8")
    for attempt in range(retries + 1):
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())["choices"][0]["message"]["content"]
        except urllib.error.HTTPError as err:
            detail = err.read().decode("utf-8", "replace")[:500]
            message = f"record {record_id!r}: the server answered {err.code}: {detail}"
        except (urllib.error.URLError, TimeoutError, OSError, KeyError, json.JSONDecodeError) as err:
            message = f"record {record_id!r}: {type(err).__name__}: {err}"
        if attempt == retries:
            raise EndpointError(message)
        time.sleep(min(30.0, 0.5 * 2**attempt))
    raise AssertionError("unreachable")


def regenerate_endpoint(
    endpoint: str,
    input_path: str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    model: str = "default",
    concurrency: int = 8,
    temperature: float = 0.0,
    top_p: float | None = None,
    max_tokens: int = 2048,
    enable_thinking: bool | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    limit: int | None = None,
    retries: int = 4,
    timeout: float = 600.0,
    progress: bool = True,
) -> int:
    """Like :func:`regenerate`, through any OpenAI-compatible chat-completions server (vLLM, SGLang, TGI,
    llama.cpp server): ``concurrency`` records at a time, each record's turns in order.

    The thinking switch goes to the server as ``chat_template_kwargs``. Resumable: completed ids are skipped and a
    record is written only once all its turns are back. Returns the number of records written.
    """
    from concurrent.futures import ThreadPoolExecutor, as_completed
    from threading import Lock

    url = endpoint.rstrip("/")
    url = (
        url
        if url.endswith("/chat/completions")
        else (url if url.endswith("/v1") else url + "/v1") + "/chat/completions"
    )
    template_kwargs = dict(chat_template_kwargs or {})
    if enable_thinking is not None:
        template_kwargs["enable_thinking"] = enable_thinking
    sampling = {"temperature": temperature, "max_tokens": max_tokens, **({"top_p": top_p} if top_p else {})}
    if template_kwargs:
        sampling["chat_template_kwargs"] = template_kwargs
    todo = _records_to_do(input_path, output_path, limit)

    def one(record_id: str, source: list[dict[str, str]]) -> dict[str, Any]:
        history: list[dict[str, str]] = []
        for end in _turns_to_generate(source):
            history.extend(source[len(history) : end])
            request = {"model": model, "messages": history, **sampling}
            reply = _chat_completion(url, request, record_id, retries, timeout)
            history.append({"role": "assistant", "content": reply})
        history.extend(source[len(history) :])
        return {"id": record_id, "messages": history}

    written, lock = 0, Lock()
    Path(output_path).parent.mkdir(parents=True, exist_ok=True)
    with (
        open(output_path, "a", encoding="utf-8") as out,
        tqdm(total=len(todo), disable=not progress) as bar,
        ThreadPoolExecutor(max_workers=concurrency) as pool,
    ):
        for future in as_completed([pool.submit(one, rid, msgs) for rid, msgs in todo]):
            record = future.result()  # an EndpointError names the record and the server's message
            with lock:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
                out.flush()
                written += 1
            bar.update(1)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    """``dmtp regenerate``: rewrite the assistant turns of a chat JSONL with the target (greedy by default)."""
    from ..assistant.target.loading import load_target

    parser = regenerate_parser()
    args = parser.parse_args(argv)
    thinking = {"true": True, "false": False, "unset": None}[args.enable_thinking]
    if args.endpoint:
        n = regenerate_endpoint(
            args.endpoint,
            args.input,
            args.output,
            model=args.model,
            concurrency=args.concurrency,
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_new_tokens,
            enable_thinking=thinking,
            limit=args.limit,
        )
        print(f"regenerated {n} records through {args.endpoint} -> {args.output}")
        return 0
    if not args.target:
        parser.error("give --target (local generation) or --endpoint (a server)")

    from transformers import AutoTokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" or torch.device(device).type != "cpu" else "float32"
    target = load_target(args.target, dtype=dtype if dtype == "auto" else getattr(torch, dtype), device=device)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
    n = regenerate(
        target,
        tokenizer,
        args.input,
        args.output,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        enable_thinking=thinking,
        limit=args.limit,
    )
    print(f"regenerated {n} records -> {args.output}")
    return 0
