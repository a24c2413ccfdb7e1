"""Overfitting signal: train.eval_steps tracks eval loss on a validation split drawn from train (never the
holdout), and the loss plot carries both curves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.train import split_validation, train

from .conftest import TINY_TRAIN


@pytest.mark.slow  # trains with a validation pass
def test_eval_steps_logs_eval_loss_on_a_split_of_train(workspace: tuple[Path, list[str]]) -> None:
    root, overrides = workspace
    train_file = root / "data/prepared/train.jsonl"
    holdout_file = root / "data/prepared/holdout.jsonl"
    holdout_before = holdout_file.read_bytes()
    record = train(compose([*TINY_TRAIN, *overrides, "train.max_steps=2", "train.eval_steps=1",
                            "train.run.val_fraction=0.25"]))

    metrics = json.loads((root / "outputs/train/metrics.json").read_text())
    curves = json.loads((root / "outputs/train/loss_curves.json").read_text())
    assert [step for step, _ in curves["eval"]] == [1, 2]
    assert all(math.isfinite(loss) and loss > 0 for _, loss in curves["eval"])
    assert len(curves["train"]) == 2

    # the validation split is drawn from train.jsonl, by content, and is what training did not see
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    kept, val = split_validation(rows, 0.25)
    assert metrics["validation_examples"] == len(val) > 0
    assert metrics["train_examples"] == len(kept) == len(rows) - len(val)
    assert not {json.dumps(r) for r in val} & {json.dumps(r) for r in kept}
    holdout = {line for line in holdout_file.read_text().splitlines()}
    assert not {json.dumps(r, ensure_ascii=False) for r in val} & holdout
    assert holdout_file.read_bytes() == holdout_before
    assert set(record["inputs"]) == {"train_data", "base_model"}  # the holdout is not an input of train

    # both curves on the plot: it differs from the plot of the same run without eval points
    with_eval = (root / "outputs/train/loss.png").read_bytes()
    assert with_eval[:8] == b"\x89PNG\r\n\x1a\n"
    from reprotune.train_outputs import loss_curves, plot_loss

    plot_loss(loss_curves([{"step": s, "loss": v} for s, v in curves["train"]]), root / "train_only.png")
    assert (root / "train_only.png").read_bytes() != with_eval


def test_no_eval_steps_means_no_validation_split(workspace: tuple[Path, list[str]]) -> None:
    root, overrides = workspace
    train(compose([*TINY_TRAIN, *overrides, "train.max_steps=1"]))
    metrics = json.loads((root / "outputs/train/metrics.json").read_text())
    assert json.loads((root / "outputs/train/loss_curves.json").read_text())["eval"] == []
    assert metrics["validation_examples"] == 0
    assert metrics["train_examples"] == 32
