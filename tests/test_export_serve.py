"""make serve: llama.cpp's OpenAI-compatible server on the GGUF answers exactly like the parity run; serve-info
prints the vLLM and Ollama commands."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError

from .conftest import REPO
from .export_pipeline import tiny_export

pytestmark = pytest.mark.slow  # needs the llama.cpp build and starts llama-server


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    return tiny_export(tmp_path_factory, upto="gguf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(exported: tuple[Path, list[str]]):
    root, overrides = exported
    port = free_port()
    log = root / "serve.log"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    with open(log, "wb") as fh:
        # the tiny random model's Q4_K_M need not pass the parity gate (test_export_gate tests the refusal)
        proc = subprocess.Popen([sys.executable, "-m", "reprotune.serve", *overrides, f"export.serve.port={port}",
                                 "export.serve.allow_failed=true"],
                                stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("server did not start: " + log.read_text()[-2000:])
        yield root, overrides, port, proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_chat_completion_equals_parity_greedy_output(server) -> None:
    from openai import OpenAI

    from reprotune.gguf_parity import prompts_of
    from reprotune.merge import read_holdout
    from reprotune.run import resolve

    root, overrides, port, _ = server
    report = json.loads((root / "outputs/gguf/parity.json").read_text())
    cfg = compose(overrides)
    messages = prompts_of(read_holdout(resolve(cfg, "merge")))[0]
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="local")
    reply = client.chat.completions.create(
        model="reprotune-invoices", messages=messages, temperature=0.0, max_tokens=report["max_new_tokens"],
        # greedy like the parity run: no repetition penalty (the server's default is 1.1), no top-k/min-p cut
        extra_body={"top_k": 1, "repeat_penalty": 1.0, "min_p": 0.0, "top_p": 1.0},
    )
    assert reply.model == "reprotune-invoices"
    assert reply.choices[0].message.content == report["gguf_outputs"]["Q4_K_M"][0]


def test_server_binds_loopback_by_default(server) -> None:
    """The listening socket (from /proc/net/tcp) is on 127.0.0.1, not 0.0.0.0."""
    _, _, port, _ = server
    listening = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                 if line.split()[3] == "0A"]  # state LISTEN
    addrs = [f[1] for f in listening if int(f[1].split(":")[1], 16) == port]
    assert addrs == [f"0100007F:{port:04X}"]  # 127.0.0.1, little-endian hex
    assert compose([]).export.serve.host == "127.0.0.1"


def test_serve_info_prints_vllm_and_ollama_commands(exported: tuple[Path, list[str]]) -> None:
    root, overrides = exported
    proc = subprocess.run([sys.executable, "-m", "reprotune.serve", *overrides, "export.serve.info_only=true"],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "vllm serve " in out
    assert f"--enable-lora --lora-modules reprotune-invoices={root}/outputs/adapter" in out
    assert f"--chat-template {root}/outputs/adapter/chat_template.jinja" in out
    assert f"cd {root}/outputs/gguf && ollama create reprotune-invoices -f Modelfile" in out
    assert "http://127.0.0.1:8080/v1" in out


def test_serve_without_gguf_fails_clearly(tmp_path: Path) -> None:
    from reprotune.serve import llama_cpp_settings

    with pytest.raises(ReprotuneError, match=r"outputs/gguf/parity.json names no served quant; run 'make gguf'"):
        llama_cpp_settings(compose([f"paths.root={tmp_path}"]))
    with pytest.raises(ReprotuneError, match=r"model-Q4_K_M.gguf not found; run 'make gguf'"):
        llama_cpp_settings(compose([f"paths.root={tmp_path}", "export.serve.quant=Q4_K_M"]))
