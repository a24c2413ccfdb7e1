"""Shared fixtures: a temporary workspace (paths.root) with a small prepared invoice dataset, and one short
training run of the built-in SmolLM2 that the slow tests on the real model share."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# before anything imports torch: importing reprotune pins the CPU kernels (reprotune/kernels.py) for the tests
# run in this process; the stages the tests start as subprocesses pin themselves
import reprotune  # noqa: F401

if os.environ.get("REPROTUNE_CPU_KERNELS") not in ("pinned", "native"):
    raise RuntimeError("torch was imported before tests/conftest.py: the CPU kernels could not be pinned")

REPO = Path(__file__).resolve().parents[1]
os.chdir(REPO)  # stages resolve the model cache and chat templates relative to the repository
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def small_invoices(root: Path) -> None:
    """32 train and 8 holdout invoices in root/data/prepared (and all 40 in root/data/raw)."""
    from reprotune.invoices import generate

    rows = generate(40, seed=7)
    write_jsonl(root / "data/prepared/train.jsonl", rows[:32])
    write_jsonl(root / "data/prepared/holdout.jsonl", rows[32:])
    write_jsonl(root / "data/raw/invoices.jsonl", rows)


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, list[str]]:
    """tmp_path as paths.root, holding 32 train and 8 holdout invoices; returns (root, overrides)."""
    small_invoices(tmp_path)
    return tmp_path, [f"paths.root={tmp_path}"]


# 12 steps of 2 rows: enough for the loss to fall clearly and for greedy replies to look like the JSON answers
SMOLLM2_TRAIN = ["train.max_steps=12", "train.logging_steps=1", "train.per_device_train_batch_size=2",
                 "train.save_steps=6"]


@pytest.fixture(scope="session")
def smollm2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """One short run of the built-in SmolLM2 as 'make train' runs it (the CLI, in its own process) on the workspace
    invoices, trained once per session for the slow tests on the real model (test_e2e_smollm2, test_eval,
    test_export_smollm2). Read-only: a test that writes under paths.root works on copy_run(...)."""
    root = tmp_path_factory.mktemp("smollm2-run")
    small_invoices(root)
    cmd = [sys.executable, "-m", "reprotune.train", f"paths.root={root}", *SMOLLM2_TRAIN]
    subprocess.run(cmd, check=True, timeout=1800)
    return root, [f"paths.root={root}"]


def copy_run(run: tuple[Path, list[str]], dest: Path) -> tuple[Path, list[str]]:
    """A private copy of a shared run (data and outputs), with paths.root pointing at it."""
    root, _ = run
    shutil.copytree(root, dest)
    return dest, [f"paths.root={dest}"]


TINY_TRAIN = ["model=tiny_random", "train.max_steps=3", "train.save_steps=2", "train.logging_steps=1",
              "train.per_device_train_batch_size=2"]
