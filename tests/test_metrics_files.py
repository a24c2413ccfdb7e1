"""DVC's metrics files hold numbers only: `dvc metrics show` and `dvc metrics diff` print a table of what is worth
comparing between two runs (counts, token lengths, losses, accuracies), not package versions or model names.
Every metrics file every stage declares (reprotune.pipeline.STAGES) is written here for real and read back."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from reprotune import pipeline
from reprotune.config import compose
from reprotune.evaluate import evaluate
from reprotune.invoices import generate
from reprotune.prepare import prepare

from .conftest import write_jsonl
from .eval_support import eval_overrides, tiny_adapter  # noqa: F401 (fixture)


def leaves(value: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [leaf for k, v in value.items() for leaf in leaves(v, f"{path}.{k}" if path else k)]
    return [(path, value)]


def non_numbers(path: Path) -> list[tuple[str, Any]]:
    """Every value of the JSON file that is not a finite int or float (a bool is not a number here)."""
    values = leaves(json.loads(path.read_text()))
    assert values, f"{path}: empty"
    return [(k, v) for k, v in values if isinstance(v, bool) or not isinstance(v, int | float)
            or not math.isfinite(v)]


@pytest.mark.slow  # full lane: runs prepare, eval and the preference stages to read their metrics files
def test_every_metrics_file_holds_only_numbers(tiny_adapter: Path, tmp_path: Path) -> None:  # noqa: F811
    rows = generate(40, seed=7)  # scrubbed for real, with one planted email: the PII counts are metrics too
    rows[3]["messages"][1]["content"] += "\nQuestions? Write to jane.miller@example-supplies.com"
    write_jsonl(tmp_path / "data/raw/invoices.jsonl", rows)
    prepare(compose([f"paths.root={tmp_path}", "model=tiny_random", "data.path=${paths.raw}/invoices.jsonl"]))
    eval_dir = tiny_adapter / "eval_numbers"
    evaluate(compose(eval_overrides(tiny_adapter, "eval_numbers", "eval.max_examples=2", "eval.max_new_tokens=8")))
    written = {"data/prepared/metrics.json": tmp_path / "data/prepared/metrics.json",
               "outputs/train/metrics.json": tiny_adapter / "outputs/train/metrics.json",
               "outputs/eval/metrics.json": eval_dir / "metrics.json"}
    declared = {m for st in pipeline.STAGES.values() for m in st.metrics}
    # the preference chain's (prepare_pairs, train_pref, eval_pref) are not written by this SFT run; make gguf's
    # (both chains) is checked where an export is built: tests/test_export_gguf.py::test_gguf_metrics_are_numbers_only
    assert declared - {"data/pairs/metrics.json", "outputs/pref/train/metrics.json", "outputs/pref/eval/metrics.json",
                       "outputs/export/gguf_metrics.json", "outputs/pref/export/gguf_metrics.json"} == set(written), \
        "a stage declares a metrics file this test does not check"
    for name, path in written.items():
        assert not non_numbers(path), f"{name}: not numbers: {non_numbers(path)}"
    prepared = json.loads(written["data/prepared/metrics.json"].read_text())
    assert prepared["examples"]["train"] + prepared["examples"]["holdout"] == 40
    assert prepared["pii"] == {"examples_changed": 1, "replacements": 1}
    assert json.loads(written["outputs/train/metrics.json"].read_text())["global_step"] == 3
    # what moved out of the metrics files is still written, next to them
    assert json.loads((tmp_path / "data/prepared/pii_report.json").read_text())["detector"]["packages"]
    assert json.loads((tmp_path / "data/prepared/report.json").read_text())["tokens"]["model"] == "tiny_random"
    assert len(json.loads((tiny_adapter / "outputs/train/loss_curves.json").read_text())["train"]) == 3
