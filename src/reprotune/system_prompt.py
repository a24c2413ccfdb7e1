"""The system prompt a served model gets when a request has none: the one every training conversation started with.

A model fine-tuned on conversations that all open with the same system message answers like the tuned model only
with it (measured in #50: `2025` instead of `2025-08-09` without it). `make gguf` writes it into the Modelfile's
SYSTEM line (Ollama applies it by itself); `make serve` (llama.cpp's OpenAI-compatible server) reads the same line
and puts it first in each chat request that has no system message of its own (`DefaultSystem`, an ASGI wrapper
around the server's app). A request with its own system message is passed on unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from reprotune.modelfile import parse_modelfile

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def exported_system(gguf_dir: str | Path) -> str | None:
    """The SYSTEM line of the Modelfile `make gguf` wrote next to the GGUF (None: no Modelfile, or no SYSTEM)."""
    modelfile = Path(gguf_dir) / "Modelfile"
    if not modelfile.is_file():
        return None
    found = parse_modelfile(modelfile.read_text(encoding="utf-8")).get("SYSTEM")
    return found[0] if found else None


def with_system(body: bytes, system: str) -> bytes:
    """A chat request's JSON with `system` as its first message when it has no system message (else as it came;
    a body that is not such a request is left to the server to refuse)."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body
    messages = request.get("messages") if isinstance(request, dict) else None
    if not isinstance(messages, list) or any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
        return body
    request["messages"] = [{"role": "system", "content": system}, *messages]
    return json.dumps(request, ensure_ascii=False).encode("utf-8")


class DefaultSystem:
    """ASGI middleware: POST .../chat/completions bodies get the training system prompt when they have none."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], system: str) -> None:
        self.app, self.system = app, system

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or not scope["path"].endswith("/chat/completions"):
            await self.app(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before its request was read
                await self.app(scope, receive, send)
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        body = with_system(body, self.system)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the server waits here for a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        await self.app({**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}, replay, send)
