"""Shared fixtures: a temporary workspace (paths.root) with a small prepared invoice dataset."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.chdir(REPO)  # stages resolve the model cache and chat templates relative to the repository
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, list[str]]:
    """tmp_path as paths.root, holding 32 train and 8 holdout invoices; returns (root, overrides)."""
    from reprotune.invoices import generate

    rows = generate(40, seed=7)
    write_jsonl(tmp_path / "data/prepared/train.jsonl", rows[:32])
    write_jsonl(tmp_path / "data/prepared/holdout.jsonl", rows[32:])
    write_jsonl(tmp_path / "data/raw/invoices.jsonl", rows)
    return tmp_path, [f"paths.root={tmp_path}"]


TINY_TRAIN = ["model=tiny_random", "train.max_steps=3", "train.save_steps=2", "train.logging_steps=1",
              "train.per_device_train_batch_size=2"]
