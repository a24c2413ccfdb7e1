"""Prepare stage (minimal): read chat JSONL, split a deterministic holdout, write data/prepared/.

    python -m reprotune.prepare [hydra overrides]

The holdout is chosen by a hash of each example's content, not a shuffle, so appending examples never
moves an old example between train and holdout.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import hydra
from omegaconf import DictConfig

from reprotune.config import CONF_DIR

log = logging.getLogger("reprotune.prepare")


def example_key(example: dict) -> str:
    return hashlib.sha256(json.dumps(example["messages"], sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def in_holdout(example: dict, fraction: float) -> bool:
    return int(example_key(example)[:8], 16) / 0xFFFFFFFF < fraction


def read_chat_jsonl(path: Path) -> list[dict]:
    examples = []
    with open(path, encoding="utf-8-sig") as fh:
        for line in fh:
            if line.strip():
                examples.append({"messages": json.loads(line)["messages"]})
    return examples


def write_jsonl(rows: list[dict], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, out)


def write_manifest(cfg: DictConfig, out: Path) -> None:
    """Inputs and outputs with their hashes, so 'make verify' can re-run and compare this stage."""
    from omegaconf import OmegaConf

    from reprotune import manifest as mf

    root = Path(cfg.paths.root)
    record = mf.base_manifest("prepare", OmegaConf.to_container(cfg, resolve=True))
    record.update({
        "manifest_path": os.path.relpath(out / "manifest.json", root),
        "inputs": {"raw_data": mf.path_record(Path(cfg.data.path), root)},
        "outputs": {"train": mf.path_record(out / "train.jsonl", root),
                    "holdout": mf.path_record(out / "holdout.jsonl", root)},
    })
    mf.write_json(out / "manifest.json", record)


def prepare(cfg: DictConfig) -> dict:
    examples = read_chat_jsonl(Path(cfg.data.path))
    train = [e for e in examples if not in_holdout(e, cfg.data.holdout_fraction)]
    holdout = [e for e in examples if in_holdout(e, cfg.data.holdout_fraction)]
    out = Path(cfg.paths.prepared)
    write_jsonl(holdout, out / "holdout.jsonl")
    write_jsonl(train, out / "train.jsonl")
    write_manifest(cfg, out)
    log.info("prepared %d train and %d holdout examples in %s", len(train), len(holdout), out)
    return {"train": len(train), "holdout": len(holdout)}


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    prepare(cfg)


if __name__ == "__main__":
    main()
