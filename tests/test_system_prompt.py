"""make serve applies the training system prompt to a request that has none (#50 item 4), as the Modelfile's SYSTEM
line does for Ollama: the ASGI wrapper around llama.cpp's app, exercised through a real HTTP client on an app that
echoes what it was sent; serve-info says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.modelfile import render_modelfile
from reprotune.system_prompt import DefaultSystem, exported_system, with_system

SYSTEM = "Convert the date to ISO 8601."


def echo_app():
    """A Starlette app (what FastAPI, and so llama.cpp's server, is built on) answering with the JSON it received."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def echo(request):  # noqa: ANN001, ANN202 - Starlette's request
        return JSONResponse({"got": await request.json()})

    return Starlette(routes=[Route("/v1/chat/completions", echo, methods=["POST"]),
                             Route("/v1/completions", echo, methods=["POST"])])


@pytest.mark.slow  # full lane: needs llama-cpp-python's server extras (FastAPI, Starlette), which make llama-cpp installs
def test_a_request_without_a_system_message_gets_the_training_one() -> None:
    from fastapi.testclient import TestClient

    client = TestClient(DefaultSystem(echo_app(), SYSTEM))
    user = [{"role": "user", "content": "9 August 2025"}]
    got = client.post("/v1/chat/completions", json={"model": "m", "messages": user}).json()["got"]
    assert got["messages"] == [{"role": "system", "content": SYSTEM}, *user] and got["model"] == "m"
    own = [{"role": "system", "content": "Answer in French."}, *user]
    assert client.post("/v1/chat/completions", json={"messages": own}).json()["got"]["messages"] == own
    # other endpoints and bodies that are no chat request pass as they came
    assert client.post("/v1/completions", json={"prompt": "x"}).json()["got"] == {"prompt": "x"}
    assert with_system(b"not json", SYSTEM) == b"not json"


def test_the_system_prompt_comes_from_the_exported_modelfile(tmp_path: Path) -> None:
    assert exported_system(tmp_path) is None
    (tmp_path / "Modelfile").write_text(render_modelfile("model-Q4_K_M.gguf", "{{ .Prompt }}", ["<|im_end|>"], SYSTEM))
    assert exported_system(tmp_path) == SYSTEM
    (tmp_path / "Modelfile").write_text(render_modelfile("model-Q4_K_M.gguf", "{{ .Prompt }}", ["<|im_end|>"], None))
    assert exported_system(tmp_path) is None


def test_serve_info_says_whether_a_system_prompt_is_applied(tmp_path: Path) -> None:
    from reprotune.config import compose
    from reprotune.serve import system_lines

    cfg = compose([f"paths.root={tmp_path}", "model=tiny_random"])
    assert system_lines(cfg)[0].startswith("System prompt: none")
    gguf = tmp_path / "outputs/gguf"
    gguf.mkdir(parents=True)
    (gguf / "Modelfile").write_text(render_modelfile("model-Q4_K_M.gguf", "{{ .Prompt }}", [], SYSTEM))
    assert system_lines(cfg) == [f"System prompt: every training conversation started with {json.dumps(SYSTEM)[1:-1]!r}"
                                 "; make serve and Ollama put it first in a request that has no system message (vLLM "
                                 "does not: send it yourself)."]
