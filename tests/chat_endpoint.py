"""A test-only OpenAI-compatible chat endpoint: what ``dmtp regenerate --endpoint`` needs from vLLM or SGLang
(``/v1/chat/completions`` with ``messages`` and ``max_tokens``, greedy), answered by a local target in-process."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch


def chat_endpoint(target, tokenizer, name: str = "default") -> ThreadingHTTPServer:
    """A server on a free local port (``server_address``) answering greedily with ``target.generate``."""
    lock = threading.Lock()

    def complete(request: dict[str, Any]) -> dict[str, Any]:
        ids = tokenizer.apply_chat_template(
            request["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with lock, torch.no_grad():
            out = target.generate(ids, do_sample=False, max_new_tokens=int(request.get("max_tokens") or 256))
        text = tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
        message = {"role": "assistant", "content": text}
        return {"object": "chat.completion", "model": name, "choices": [{"index": 0, "message": message}]}

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            length = int(self.headers.get("Content-Length") or 0)
            self._send(200, complete(json.loads(self.rfile.read(length))))

        def log_message(self, *args) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)
