"""``dmtp serve``: a small OpenAI-compatible chat-completions server over a target (and, optionally, a DMTP draft).

Enough of the OpenAI API for ``dmtp regenerate --endpoint`` and other clients of ``/v1/chat/completions``:
``messages``, ``max_tokens``, ``temperature``, ``top_p``, ``chat_template_kwargs`` (e.g. ``enable_thinking``), and
``/v1/models``. One request is decoded at a time (a lock around the model; the HTTP server itself is threaded).
With ``--draft`` every answer is decoded speculatively by the engine, losslessly. It is a test and development
endpoint for CPUs and single GPUs, not a production server: for throughput use vLLM or SGLang.

    dmtp serve --target bundled --port 8000
    dmtp regenerate --endpoint http://127.0.0.1:8000 --input chats.jsonl --output regenerated.jsonl
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

__all__ = ["ChatServer", "main"]


class ChatServer:
    """Answers chat-completion requests with ``target.generate`` (through ``draft`` when given)."""

    def __init__(self, target, tokenizer, draft=None, name: str = "default") -> None:
        self.target, self.tokenizer, self.draft, self.name = target, tokenizer, draft, name
        self.lock = threading.Lock()

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """One chat completion in the OpenAI response shape."""
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        template_kwargs = dict(request.get("chat_template_kwargs") or {})
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True, **template_kwargs
        )["input_ids"].to(self.target.device)
        temperature = float(request.get("temperature") or 0.0)
        options: dict[str, Any] = {"max_new_tokens": int(request.get("max_tokens") or 256)}
        if temperature > 0:
            options.update(do_sample=True, temperature=temperature, top_p=float(request.get("top_p") or 1.0))
        else:
            options.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        with self.lock, torch.no_grad():
            if self.draft is not None:
                options["assistant_model"] = self.draft
            out = self.target.generate(ids, **options)
        new = out[0, ids.shape[1] :]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return {
            "id": f"chatcmpl-{time.time_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": ids.shape[1],
                "completion_tokens": new.numel(),
                "total_tokens": ids.shape[1] + new.numel(),
            },  # fmt: skip
        }

    def http_server(self, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
        """A threaded HTTP server bound to ``host:port`` (port 0: any free port, see ``server_address``)."""
        chat = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode("utf-8")
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": chat.name, "object": "model"}]})
                else:
                    self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": {"message": f"no route {self.path}"}})
                    return
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                    self._send(200, chat.complete(json.loads(self.rfile.read(length) or b"{}")))
                except (ValueError, KeyError, TypeError) as err:
                    self._send(400, {"error": {"message": str(err)}})

            def log_message(self, *args) -> None:  # quiet: one line per request is noise at thousands of requests
                pass

        return ThreadingHTTPServer((host, port), Handler)


def main(argv: Sequence[str] | None = None) -> int:
    """``dmtp serve``: serve ``--target`` (``bundled`` works) over HTTP until interrupted."""
    from transformers import AutoTokenizer

    from .bundled import resolve_target_path
    from .modeling import DMTPDraftModel
    from .training.features import load_target

    parser = argparse.ArgumentParser(prog="dmtp serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="target checkpoint (`bundled`: the bundled target)")
    parser.add_argument("--draft", help="DMTP/DFlash draft: answers are decoded speculatively (same tokens)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--name", default="default", help="the model name clients send")
    parser.add_argument("--device", default=None)
    args = parser.parse_args(argv)
    path = resolve_target_path(args.target)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(path, dtype="auto", device=device)
    tokenizer = AutoTokenizer.from_pretrained(path)
    draft = DMTPDraftModel.from_pretrained(args.draft, target=target).eval() if args.draft else None
    server = ChatServer(target, tokenizer, draft, args.name).http_server(args.host, args.port)
    host, port = server.server_address[:2]
    print(f"serving {path} on http://{host}:{port}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
