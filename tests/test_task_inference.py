"""The eval task inferred from the data (#50 item 2): data.task.type auto (json when every reference answer is a
JSON object, else text), the built-in invoice fields and metrics for the invoice data only, eval.max_new_tokens
auto from the longest training answer, the report titled with the data's name; an explicit setting wins, and a
wrong value names the setting and its allowed values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from reprotune import metrics as mx
from reprotune.config import CONF_DIR, compose
from reprotune.errors import ReprotuneError
from reprotune.evaluate import evaluate

from .eval_support import tiny_adapter  # noqa: F401 (fixture)

BUILTIN = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "data/invoices.yaml").task)
DEFAULT = OmegaConf.to_container(compose([]).data.task, resolve=True)
INVOICE = '{"supplier": "A", "invoice_number": "1", "date": "2025-01-02", "currency": "EUR", "total": 1, "tax": 0}'


def test_json_answers_of_the_invoice_data_keep_the_invoice_task() -> None:
    task = mx.resolve_task(DEFAULT, [INVOICE, INVOICE], True, BUILTIN)
    assert task["type"] == "json" and task["fields"] == BUILTIN["fields"]
    assert [m["name"] for m in task["metrics"]] == ["amounts_ok", "iso_date"]
    assert mx.primary_metric(task) == "field_accuracy"


def test_a_users_json_answers_are_scored_on_their_own_keys() -> None:
    task = mx.resolve_task(DEFAULT, ['{"city": "Paris", "zip": 75001}', '{"city": "Bonn"}'], False, BUILTIN)
    assert task["type"] == "json" and task["fields"] == ["city", "zip"] and task["metrics"] == []
    assert mx.metric_names(task) == ["json_valid", "exact_match", "field_accuracy", "schema_ok", "field/city",
                                     "field/zip"]
    mx.check_task(task)


def test_a_users_free_text_answers_are_a_text_task_without_the_invoice_metrics() -> None:
    task = mx.resolve_task(DEFAULT, ["2025-08-09", '{"a": 1}'], False, BUILTIN)
    assert task["type"] == "text" and mx.metric_names(task) == ["exact_match", "token_f1", "rougeL"]
    assert mx.primary_metric(task) == "rougeL"
    mx.check_task(task)


def test_an_explicit_setting_wins() -> None:
    explicit = {**DEFAULT, "type": "text", "metrics": [{"name": "iso", "kind": "regex", "pattern": r"\d{4}"}]}
    task = mx.resolve_task(explicit, [INVOICE], False, BUILTIN)
    assert task["type"] == "text" and [m["name"] for m in task["metrics"]] == ["iso"]


@pytest.mark.parametrize(("task", "expected"), [
    ({"type": "xml"}, r"^data\.task\.type: 'xml' is not one of auto, json, text"),
    ({"type": "text", "primary_metric": "bleu"},
     r"^data\.task\.primary_metric: 'bleu' is not a metric of this text task; set data\.task\.primary_metric "
     r"to one of exact_match, token_f1, rougeL"),
])
def test_a_wrong_value_names_the_setting_and_its_choices(task: dict, expected: str) -> None:
    with pytest.raises(ReprotuneError, match=expected):
        mx.check_task(mx.resolve_task(task, ["x"], False, BUILTIN))


def _dates(n: int) -> list[dict]:
    months = ["January", "February", "March", "April", "May", "June"]
    return [{"messages": [{"role": "system", "content": "Convert the date to ISO 8601."},
                          {"role": "user", "content": f"{i + 1} {months[i % 6]} 2025"},
                          {"role": "assistant", "content": f"2025-{i % 6 + 1:02d}-{i + 1:02d}"}]} for i in range(n)]


def test_eval_on_a_users_text_data(tiny_adapter: Path, tmp_path: Path) -> None:  # noqa: F811
    """A real eval (tiny model) on date conversions: a text task, no invoice metrics, a budget from the training
    answers, the report titled with the data's name."""
    from transformers import AutoTokenizer

    prepared = tmp_path / "data/prepared"
    prepared.mkdir(parents=True)
    (prepared / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _dates(12)))
    (prepared / "holdout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _dates(3)))
    adapter = tiny_adapter / "outputs/adapter"
    result = evaluate(compose(["model=tiny_random", "eval.batch_size=4", f"paths.root={tmp_path}",
                               f"paths.adapter={adapter}", f"data.path={tmp_path / 'dates.jsonl'}", "data.name=dates"]))
    metrics = result["metrics"]
    assert set(metrics["tuned"]) == {"exact_match", "token_f1", "rougeL", "loss", "perplexity"}
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    longest = max(len(tokenizer.encode(r["messages"][-1]["content"], add_special_tokens=False)) for r in _dates(12))
    budget = result["manifest"]["config"]["eval"]["max_new_tokens"]
    assert longest < budget <= longest + 16 + 4  # the answer, its end-of-turn tokens, the margin
    report = (tmp_path / "outputs/eval/report.md").read_text()
    assert report.startswith("# Evaluation: tiny_random base vs + adapter on the dates holdout")
    assert f"max {budget} new tokens" in report and "Task type `text`" in report
