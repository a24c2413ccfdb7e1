"""Shared by the eval tests: a tiny trained adapter, and a real OpenAI-compatible HTTP server.

The server is small on purpose but real: it listens on 127.0.0.1, speaks the /v1/chat/completions wire
format the `openai` client uses, checks the bearer key, and answers with a real model's greedy
completion (transformers generate on the served model, rendered with the model's chat template).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest

from .conftest import tiny_adapter_run

TINY_EVAL = ["model=tiny_random", "eval.max_new_tokens=24", "eval.batch_size=4", "eval.max_examples=6"]


@pytest.fixture(scope="session")
def tiny_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """paths.root with 32 train / 8 holdout invoices and a 3-step tiny_random adapter in outputs/adapter
    (conftest.tiny_adapter_run, shared with the export tests); each test evaluates into its own paths.eval_dir
    under it."""
    return tiny_adapter_run(tmp_path_factory)


def eval_overrides(root: Path, eval_dir: str, *extra: str) -> list[str]:
    return [*TINY_EVAL, f"paths.root={root}", f"paths.eval_dir={root / eval_dir}", *extra]


class ChatServer:
    """POST /v1/chat/completions (and /v1/completions, a text prompt as it is) served by a real transformers model
    (greedy); records what it was sent."""

    def __init__(self, model: Any, tokenizer: Any, api_key: str | None) -> None:
        self.model, self.tokenizer, self.api_key = model, tokenizer, api_key
        self.requests: list[dict] = []
        self.replies: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if server.api_key and self.headers.get("Authorization") != f"Bearer {server.api_key}":
                    return self._send(401, {"error": {"message": "invalid api key", "type": "auth"}})
                if self.path not in ("/v1/chat/completions", "/v1/completions"):
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                server.requests.append(body)
                chat = self.path == "/v1/chat/completions"
                text, n_prompt, n_new = server.complete(body["messages"] if chat else body["prompt"],
                                                        int(body.get("max_tokens") or 64))
                server.replies.append(text)
                if not chat:  # a text completion: the prompt as it is
                    return self._send(200, {
                        "id": f"cmpl-{len(server.requests)}", "object": "text_completion",
                        "created": int(time.time()), "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop", "text": text, "logprobs": None}],
                        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_new,
                                  "total_tokens": n_prompt + n_new}})
                return self._send(200, {
                    "id": f"chatcmpl-{len(server.requests)}", "object": "chat.completion",
                    "created": int(time.time()), "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": text}}],
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_new,
                              "total_tokens": n_prompt + n_new}})

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def complete(self, prompt: list[dict] | str, max_tokens: int) -> tuple[str, int, int]:
        import torch

        ids = (self.tokenizer(text=prompt, return_tensors="pt") if isinstance(prompt, str) else
               self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True))
        with torch.inference_mode():
            out = self.model.generate(**ids, do_sample=False, max_new_tokens=max_tokens,
                                      pad_token_id=self.tokenizer.pad_token_id)
        new = out[0, ids["input_ids"].shape[1]:]
        return self.tokenizer.decode(new, skip_special_tokens=True).strip(), ids["input_ids"].shape[1], len(new)

    def __enter__(self) -> ChatServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
