"""One tiny train -> merge -> gguf run shared by the export tests (built once per pytest session, whichever xdist
worker asks first; the others wait on its lock). Its train stage is conftest's shared tiny adapter: the same
settings (EXPORT_TRAIN is TINY_ADAPTER_TRAIN) on the same invoices, trained once for the eval and export tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reprotune.config import compose

from .conftest import TINY_ADAPTER_TRAIN, file_lock, session_dir, tiny_adapter_run, write_jsonl

# a few steps at a high learning rate: the adapter must move the logits visibly, or merge parity is vacuous
EXPORT_TRAIN = TINY_ADAPTER_TRAIN
EXPORT_ARGS = ["export.quant=[Q4_K_M,Q8_0]", "export.parity.examples=3", "export.parity.max_new_tokens=16",
               "export.merge.prompts=3"]


def tiny_workspace(root: Path) -> list[str]:
    from reprotune.invoices import generate

    rows = generate(40, seed=7)
    write_jsonl(root / "data/prepared/train.jsonl", rows[:32])
    write_jsonl(root / "data/prepared/holdout.jsonl", rows[32:])
    return [*EXPORT_TRAIN, *EXPORT_ARGS, f"paths.root={root}"]


def stage(factory: pytest.TempPathFactory, root: Path, name: str) -> None:
    """Run a stage once per session (a marker file says it is done)."""
    marker = root / f".done-{name}"
    if marker.exists():
        return
    overrides = json.loads((root / "overrides.json").read_text())
    cfg = compose(overrides)
    if name == "train":
        # what train(cfg) would write: the shared run has the same train settings and data (the export keys of
        # EXPORT_ARGS are read by merge and gguf only), and its adapter bytes do not depend on paths.root
        shared = tiny_adapter_run(factory)
        for out in ("outputs/adapter", "outputs/train"):
            shutil.copytree(shared / out, root / out, dirs_exist_ok=True)  # over what a failed attempt left
    elif name == "merge":
        from reprotune.merge import merge

        merge(cfg)
    elif name == "gguf":
        from reprotune.gguf import gguf

        gguf(cfg)
    marker.touch()


def tiny_export(factory: pytest.TempPathFactory, upto: str) -> tuple[Path, list[str]]:
    root = session_dir(factory) / "tiny-export"
    with file_lock(root.with_name("tiny-export.lock")):
        if not (root / "overrides.json").exists():
            root.mkdir(parents=True, exist_ok=True)
            (root / "overrides.json").write_text(json.dumps(tiny_workspace(root)))
        for name in ("train", "merge", "gguf"):
            stage(factory, root, name)
            if name == upto:
                break
    return root, json.loads((root / "overrides.json").read_text())
