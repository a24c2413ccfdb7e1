"""Golden trajectory: the per-step training loss of a small fixed run is pinned in tests/golden/.

An innocent-looking version bump (torch, transformers, trl, peft) or a refactor that changes training
shows up here. On the CPU class the reference was recorded on, the losses (and the adapter bytes) must
match exactly; on another CPU, within a small relative tolerance (kernels may sum in another order).

Intended change? Regenerate and commit the reference:
    REPROTUNE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_repro_golden.py
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from reprotune.config import compose
from reprotune.manifest import hardware_state, package_versions
from reprotune.train import train

GOLDEN = Path(__file__).parent / "golden"
REFERENCE = GOLDEN / "tiny_train_loss.json"
# fixed data committed next to the reference (not regenerated: a data-generator change must not move it)
DATA = GOLDEN / "train.jsonl"
# spelled out (not conftest's TINY_TRAIN): the pinned run must not move when other tests' settings do
RUN = ["model=tiny_random", "train.max_steps=6", "train.save_steps=100", "train.logging_steps=1",
       "train.per_device_train_batch_size=4", "seed=42"]
CROSS_CPU_RTOL = 1e-5


def golden_run(root: Path) -> dict:
    (root / "data/prepared").mkdir(parents=True)
    (root / "data/prepared/train.jsonl").write_bytes(DATA.read_bytes())
    record = train(compose([*RUN, f"paths.root={root}"]))
    curve = json.loads((root / "outputs/train/loss_curves.json").read_text())["train"]
    return {"overrides": RUN, "loss": [loss for _, loss in curve], "steps": [step for step, _ in curve],
            "adapter_sha256": record["outputs"]["adapter"]["sha256"],
            "cpu": hardware_state()["cpu"], "packages": package_versions()["key"]}


def test_loss_trajectory_matches_reference(tmp_path: Path) -> None:
    got = golden_run(tmp_path)
    if os.environ.get("REPROTUNE_UPDATE_GOLDEN") == "1":
        REFERENCE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    ref = json.loads(REFERENCE.read_text())
    assert got["overrides"] == ref["overrides"], "the golden run's settings changed: regenerate the reference"
    assert got["steps"] == ref["steps"]
    changed = {k: (ref["packages"].get(k), v) for k, v in got["packages"].items() if ref["packages"].get(k) != v}
    context = (f"reference recorded on {ref['cpu']!r} with {ref['packages']}; this run on {got['cpu']!r}"
               + (f"; packages changed since: {changed}" if changed else ""))
    if got["cpu"] == ref["cpu"]:
        diffs = [(s, r, g) for s, r, g in zip(got["steps"], ref["loss"], got["loss"], strict=True) if r != g]
        assert not diffs, (f"training changed: per-step loss differs from tests/golden at (step, reference, now) "
                           f"{diffs[:3]} ({context}). If intended, regenerate: REPROTUNE_UPDATE_GOLDEN=1")
        assert got["adapter_sha256"] == ref["adapter_sha256"], f"adapter bytes changed ({context})"
    else:
        bad = [(s, r, g) for s, r, g in zip(got["steps"], ref["loss"], got["loss"], strict=True)
               if not math.isclose(r, g, rel_tol=CROSS_CPU_RTOL)]
        assert not bad, (f"training changed beyond the cross-CPU tolerance {CROSS_CPU_RTOL}: (step, reference, "
                         f"now) {bad[:3]} ({context})")
