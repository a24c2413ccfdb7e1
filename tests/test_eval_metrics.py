"""Scoring (reprotune.metrics): JSON, free-text and config-declared metrics on hand-made predictions."""

from __future__ import annotations

import json

import pytest

from reprotune import metrics as mx
from reprotune.config import compose
from reprotune.errors import ReprotuneError

REF = json.dumps({"supplier": "Acme Ltd", "invoice_number": "INV-00042", "date": "2024-03-01",
                  "currency": "EUR", "total": 1190.0, "tax": 190.0})
FIELDS = ["supplier", "invoice_number", "date", "currency", "total", "tax"]
TYPES = {"supplier": "string", "invoice_number": "string", "date": "string", "currency": "string",
         "total": "number", "tax": "number"}


def with_changes(**changes: object) -> str:
    obj = json.loads(REF)
    obj.update(changes)
    return json.dumps({k: v for k, v in obj.items() if v is not ...})


def test_perfect_json_answer_scores_everything() -> None:
    s = mx.json_scores(REF, REF, FIELDS, TYPES)
    assert s["json_valid"] == s["exact_match"] == s["field_accuracy"] == s["schema_ok"] == 1.0
    # 1190 and 1190.0 are the same JSON number; key order does not matter
    reordered = json.dumps({"tax": 190, "total": 1190, "currency": "EUR", "date": "2024-03-01",
                            "invoice_number": "INV-00042", "supplier": "Acme Ltd"})
    assert mx.json_scores(reordered, REF, FIELDS, TYPES)["exact_match"] == 1.0


def test_markdown_fence_is_tolerated_but_prose_is_not() -> None:
    assert mx.json_scores(f"```json\n{REF}\n```", REF, FIELDS)["json_valid"] == 1.0
    s = mx.json_scores(f"Here is the JSON: {REF}", REF, FIELDS, TYPES)
    assert s == {**{k: 0.0 for k in s}}  # invalid JSON: every score zero
    assert mx.json_scores("[1, 2]", REF, FIELDS)["json_valid"] == 0.0  # valid JSON, but not an object


def test_field_accuracy_counts_each_field() -> None:
    s = mx.json_scores(with_changes(total=1100.0, date="01/03/2024"), REF, FIELDS, TYPES)
    assert s["json_valid"] == 1.0 and s["exact_match"] == 0.0
    assert s["field_accuracy"] == pytest.approx(4 / 6)
    assert s["field/total"] == 0.0 and s["field/date"] == 0.0 and s["field/supplier"] == 1.0
    assert s["schema_ok"] == 1.0  # wrong values, right shape


def test_schema_compliance() -> None:
    assert mx.json_scores(with_changes(total="1190.00"), REF, FIELDS, TYPES)["schema_ok"] == 0.0  # string, not number
    assert mx.json_scores(with_changes(total=True), REF, FIELDS, TYPES)["schema_ok"] == 0.0  # bool is no number
    assert mx.json_scores(with_changes(note="x"), REF, FIELDS, TYPES)["schema_ok"] == 0.0  # extra key
    missing = mx.json_scores(with_changes(tax=...), REF, FIELDS, TYPES)
    assert missing["schema_ok"] == 0.0 and missing["field_accuracy"] == pytest.approx(5 / 6)
    assert mx.json_scores(with_changes(note="x"), REF, FIELDS, TYPES)["exact_match"] == 0.0


def test_text_metrics() -> None:
    assert mx.text_scores("  Paris ", "Paris") == {"exact_match": 1.0, "token_f1": 1.0, "rougeL": 1.0}
    s = mx.text_scores("the cat sat on the mat", "a cat sat on a red mat")
    # SQuAD normalisation drops articles: pred {cat, sat, on, mat}, ref {cat, sat, on, red, mat}
    assert s["token_f1"] == pytest.approx(2 * (4 / 4) * (4 / 5) / (4 / 4 + 4 / 5))
    assert s["exact_match"] == 0.0
    # rouge-score: LCS of [the cat sat on the mat] and [a cat sat on a red mat] is 4 tokens
    assert s["rougeL"] == pytest.approx(2 * (4 / 6) * (4 / 7) / (4 / 6 + 4 / 7))
    assert mx.text_scores("", "Paris")["token_f1"] == 0.0


def test_metrics_declared_in_config_without_code() -> None:
    task = {"type": "text", "metrics": [
        {"name": "answer", "kind": "regex", "pattern": r"#### (\S+)", "mode": "extract"},
        {"name": "has_answer", "kind": "regex", "pattern": r"####"},
        {"name": "exact_ci", "kind": "exact", "normalize": "lower"},
        {"name": "total_ok", "kind": "json_field", "field": "total"},
    ]}
    mx.check_task(task)
    s = mx.score("so 6*7.\n#### 42", "Six sevens.\n#### 42", task)
    assert s["answer"] == 1.0 and s["has_answer"] == 1.0 and s["exact_ci"] == 0.0
    assert mx.score("#### 41", "#### 42", task)["answer"] == 0.0
    assert mx.score("No answer", "#### 42", task)["has_answer"] == 0.0
    assert mx.score("SIX  Sevens", "six sevens", task)["exact_ci"] == 1.0
    assert mx.score('{"total": 3}', '{"total": 3.0, "tax": 1}', task)["total_ok"] == 1.0
    assert mx.metric_names(task) == ["exact_match", "token_f1", "rougeL", "answer", "has_answer", "exact_ci",
                                     "total_ok"]


def test_builtin_invoice_task_config() -> None:
    from omegaconf import OmegaConf

    default = OmegaConf.to_container(compose([]).data.task, resolve=True)
    task = mx.resolve_task(default, [REF], True, default)  # type auto on the invoice data's JSON answers: json
    mx.check_task(task)
    assert task["type"] == "json" and mx.primary_metric(task) == "field_accuracy"
    good = mx.score(REF, REF, task)
    assert good["amounts_ok"] == 1.0 and good["iso_date"] == 1.0
    bad = mx.score(with_changes(date="01.03.2024", tax=19.0), REF, task)
    assert bad["amounts_ok"] == 0.0 and bad["iso_date"] == 0.0 and bad["field_accuracy"] == pytest.approx(4 / 6)


@pytest.mark.parametrize(("task", "message"), [
    ({"type": "xml"}, "data.task.type"),
    ({"type": "json"}, "data.task.fields"),
    ({"type": "json", "fields": ["a"], "field_types": {"a": "str"}}, "field_types.a"),
    ({"type": "text", "metrics": [{"name": "m", "kind": "bleu"}]}, r"metrics\[0\]: unknown kind"),
    ({"type": "text", "metrics": [{"name": "m", "kind": "regex", "pattern": "("}]}, r"metrics\[0\]: bad regex"),
    ({"type": "text", "metrics": [{"name": "m", "kind": "json_field"}]}, "needs 'field'"),
    ({"type": "text", "metrics": [{"kind": "exact"}]}, "needs 'name'"),
    ({"type": "text", "primary_metric": "bleu"}, "primary_metric"),
])
def test_bad_task_config_names_the_key(task: dict, message: str) -> None:
    with pytest.raises(ReprotuneError, match=message):
        mx.check_task(task)


def test_text_task_report_without_a_model(tmp_path) -> None:
    """The report path for a free-text task and a prompt baseline, from hand-made predictions."""
    from reprotune.evaluation import report as ev_report
    from reprotune.evaluation import scoring
    from reprotune.evaluation.generation import SystemRun

    task = {"type": "text", "metrics": [{"name": "has_paris", "kind": "regex", "pattern": "Paris"}]}
    names = mx.metric_names(task)
    refs = ["Paris is the capital.", "Berlin"]
    preds = {"base": ["It is Paris.", "Bonn"], "tuned": ["Paris is the capital.", "Berlin"],
             "baseline": ["Paris", "Berlin"]}
    runs = {s: SystemRun(p, [3, 1], nll=[1.0, 2.0] if s != "baseline" else [],
                            n_tokens=[2, 2] if s != "baseline" else []) for s, p in preds.items()}
    scores = {s: [mx.score(p, r, task) for p, r in zip(preds[s], refs, strict=True)] for s in preds}
    metrics = scoring.build_metrics({s: scoring.summarise(runs[s], scores[s], names) for s in runs}, 2)
    assert metrics["tuned"]["exact_match"] == 1.0 and metrics["base"]["exact_match"] == 0.0
    assert metrics["base"]["loss"] == 0.75 and "loss" not in metrics["baseline"]
    assert metrics["delta_tuned_vs_baseline"]["exact_match"] == 0.5
    records = [{"index": i, "input": "q", "reference": refs[i], "predictions": {s: preds[s][i] for s in preds},
                "scores": {s: scores[s][i] for s in preds}} for i in range(2)]
    cfg = compose(["eval.report_examples=1"])
    table = ev_report.write_report(tmp_path / "report.md", cfg, metrics, records, names, mx.primary_metric(task))
    report = (tmp_path / "report.md").read_text()
    assert table in report and "| rougeL |" in table and "| has_paris |" in table
    assert "| exact_match | 0.0% | 100.0% | 50.0% | +100.0 pp | +50.0 pp |" in table
    assert "(2 of 2; 1 shown" in report and report.count("### Example") == 1
    ev_report.plot_comparison(metrics, names, tmp_path / "comparison.png")
    assert (tmp_path / "comparison.png").read_bytes()[:4] == b"\x89PNG"
