"""Prompt-only baseline: the real `openai` client against a real local OpenAI-compatible server.

The server (tests/eval_support.py) binds to 127.0.0.1 and answers with the tiny model's greedy completions;
nothing here is mocked: requests go over HTTP, the client is the one from the lockfile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.evaluate import evaluate

from .eval_support import ChatServer, eval_overrides, tiny_adapter  # noqa: F401 (fixture)

KEY_ENV = "REPROTUNE_BASELINE_API_KEY"
FAKE_KEY = "sk-test-DO-NOT-LEAK-4242424242"
SYSTEM = "You turn invoices into JSON. Reply with the JSON object only."


@pytest.fixture(scope="module")
def server(tiny_adapter: Path):  # noqa: F811
    """Serves the tiny base model as a stand-in for a prompted base model behind an API."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reprotune.models import resolve_model_dir

    cfg = compose(["model=tiny_random"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_adapter / "outputs/adapter")
    model = AutoModelForCausalLM.from_pretrained(resolve_model_dir(cfg.model, cfg.paths.model_cache)).eval()
    with ChatServer(model, tokenizer, api_key=FAKE_KEY) as srv:
        yield srv


def baseline_args(url: str, *extra: str) -> list[str]:
    return [f"eval.baseline.url={url}", "eval.baseline.model=tiny-served", f"eval.baseline.api_key_env={KEY_ENV}",
            f"eval.baseline.system_prompt='{SYSTEM}'", "eval.baseline.max_retries=0", *extra]


@pytest.mark.slow  # starts an OpenAI-compatible server on the tiny model
def test_baseline_in_the_same_table(server: ChatServer, tiny_adapter: Path,  # noqa: F811
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, FAKE_KEY)
    evaluate(compose(eval_overrides(tiny_adapter, "eval_baseline", *baseline_args(server.url))))
    out = tiny_adapter / "eval_baseline"

    holdout = [json.loads(line)["messages"] for line in
               (tiny_adapter / "data/prepared/holdout.jsonl").read_text().splitlines()][:6]
    # every holdout example went over HTTP, with the configured system prompt in place of the example's own
    assert len(server.requests) == 6
    for request, messages in zip(server.requests, holdout, strict=True):
        assert request["messages"] == [{"role": "system", "content": SYSTEM}, messages[1]]
        assert request["temperature"] == 0 and request["max_tokens"] == 24 and request["model"] == "tiny-served"

    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["predictions"]["baseline"] for r in records] == server.replies
    assert all(set(r["scores"]) == {"base", "tuned", "baseline"} for r in records)
    assert all("baseline" not in r["reference_loss"] for r in records)  # an API gives no loss

    metrics = json.loads((out / "metrics.json").read_text())
    assert set(metrics["baseline"]) >= {"json_valid", "field_accuracy", "schema_ok", "exact_match"}
    assert "loss" not in metrics["baseline"]
    assert metrics["delta_tuned_vs_baseline"]["field_accuracy"] == pytest.approx(
        metrics["tuned"]["field_accuracy"] - metrics["baseline"]["field_accuracy"], abs=2e-6)
    report = (out / "report.md").read_text()
    assert "| metric | base | tuned | prompt baseline | Δ tuned − base | Δ tuned − prompt baseline |" in report

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["baseline"] == {"url": server.url, "model": "tiny-served"}
    assert manifest["timing"]["baseline"]["seconds"] > 0
    for path in out.rglob("*"):  # the key was sent to the server, and is written nowhere
        assert FAKE_KEY.encode() not in path.read_bytes(), path


@pytest.mark.slow  # starts an OpenAI-compatible server on the tiny model
def test_wrong_key_is_a_clear_error(server: ChatServer, tiny_adapter: Path,  # noqa: F811
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-wrong-key-000000")
    with pytest.raises(ReprotuneError, match=rf"HTTP 401 .*\${KEY_ENV}") as err:
        evaluate(compose(eval_overrides(tiny_adapter, "eval_wrong_key", *baseline_args(server.url))))
    assert "sk-wrong-key" not in str(err.value)
    assert not (tiny_adapter / "eval_wrong_key").exists()  # failed before any model pass or output


@pytest.mark.slow  # starts an OpenAI-compatible server on the tiny model
def test_text_pairs_reach_the_baseline_as_text_completions(server: ChatServer, tiny_adapter: Path,  # noqa: F811
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A preference run on text (standard) pairs: the baseline is asked each text prompt as it is, through the
    completions endpoint (no chat turns, no system prompt), and scored beside base and tuned."""
    import shutil

    monkeypatch.setenv(KEY_ENV, FAKE_KEY)
    shutil.copytree(tiny_adapter / "outputs/adapter", tmp_path / "outputs/pref/adapter")
    rows = [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
            {"prompt": "Water boils at", "chosen": " 100 C at sea level.", "rejected": " 50 C."}]
    (tmp_path / "data/pairs").mkdir(parents=True)
    (tmp_path / "data/pairs/holdout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = len(server.requests)
    evaluate(compose([f"paths.root={tmp_path}", "model=tiny_random", "objective=dpo", "objective.init_adapter=null",
                      "eval.max_new_tokens=8", "data.task.type=text", "data.task.primary_metric=rougeL",
                      "data.task.metrics=[]", *baseline_args(server.url)]))
    sent = server.requests[before:]
    assert [(r["prompt"], r["max_tokens"], r["temperature"]) for r in sent] == [(r["prompt"], 8, 0) for r in rows]
    assert all("messages" not in r for r in sent)
    records = [json.loads(line) for line in (tmp_path / "outputs/pref/eval/predictions.jsonl").read_text().splitlines()]
    assert [r["predictions"]["baseline"] for r in records] == server.replies[before:]
    metrics = json.loads((tmp_path / "outputs/pref/eval/metrics.json").read_text())
    assert set(metrics["baseline"]) == {"exact_match", "token_f1", "rougeL"} and metrics["examples"] == 2


def test_unreachable_endpoint_is_a_clear_error(tiny_adapter: Path) -> None:  # noqa: F811
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(ReprotuneError, match=f"eval.baseline.url: {url}: cannot connect"):
        evaluate(compose(eval_overrides(tiny_adapter, "eval_down", *baseline_args(url, "eval.baseline.timeout_s=5"))))
