"""The DVC chain sft -> preference (issue #26) as a user runs it, in a fresh git copy of this checkout (tiny model):
make train, then make train ARGS="objective=dpo" (prepare_pairs + train_pref from the SFT adapter, SFT's stages
skipped), make eval ARGS="objective=dpo" (eval_pref), make gguf ARGS="objective=dpo" (merge_pref + gguf_pref: the
preference adapter exported under outputs/pref), both chains' outputs in dvc.lock, and a preference stage refusing
SFT params in one line."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from reprotune.manifest import sha256_tree, tree_digest

from .test_make_pipeline import TINY, VENV, clone, run  # noqa: F401 - clone is the fixture

pytestmark = pytest.mark.slow

DPO = ["objective=dpo", "objective.max_steps=2"]


def make(root: Path, target: str, env: dict, *extra: str) -> list[str]:
    log = run(["make", target, f"ARGS={' '.join([*TINY, *extra])}"], root, env)
    return re.findall(r"Running stage '(\w+)'", log)


@pytest.fixture(scope="module")
def chain(clone: tuple[Path, dict]) -> dict:  # noqa: F811 - the imported fixture
    root, env = clone
    sft = make(root, "train", env)
    sft_outputs = sha256_tree(root / "outputs")
    pref = make(root, "train", env, *DPO)
    after_pref = sha256_tree(root / "outputs")
    evals = make(root, "eval", env, *DPO)
    exports = make(root, "gguf", env, *DPO)
    after_export = sha256_tree(root / "outputs")
    return {"sft": sft, "sft_outputs": sft_outputs, "pref": pref, "after_pref": after_pref, "eval": evals,
            "export": exports, "after_export": after_export}


def test_make_train_with_dpo_runs_the_preference_chain_from_the_sft_adapter(clone: tuple[Path, dict],  # noqa: F811
                                                                             chain: dict) -> None:
    root, _ = clone
    assert chain["sft"] == ["prepare", "train"]
    assert chain["pref"] == ["prepare_pairs", "train_pref"]  # SFT's stages current: skipped
    assert chain["eval"] == ["eval_pref"]
    # SFT's outputs byte for byte; the preference run's beside them
    assert {k: v for k, v in chain["after_pref"].items() if not k.startswith("pref/")} == chain["sft_outputs"]
    manifest = json.loads((root / "outputs/pref/train/manifest.json").read_text())
    init = manifest["objective"]["init_adapter"]
    assert init["path"] == "outputs/adapter" and init["sha256"] == tree_digest(sha256_tree(root / "outputs/adapter"))
    assert manifest["objective"]["reference"].startswith("init_adapter")
    assert manifest["inputs"]["train_data"]["path"] == "data/pairs/train.jsonl"
    metrics = json.loads((root / "outputs/pref/eval/metrics.json").read_text())["preference"]
    assert {"base", "sft", "tuned"} <= set(metrics) and metrics["pairs"] > 0
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert {"prepare", "train", "prepare_pairs", "train_pref", "eval_pref", "merge_pref", "gguf_pref"} <= set(lock)
    assert lock["train_pref"]["params"]["params_pref.yaml"]["objective"]["name"] == "dpo"
    assert "objective" not in lock["train"]["params"]["params.yaml"]
    # dvc push versions both: every output of both chains is in the cache
    status = run([str(VENV / "bin/dvc"), "status", "train", "train_pref", "eval_pref", "gguf_pref"], root, clone[1])
    assert "up to date" in status


def test_make_merge_and_gguf_with_dpo_export_the_preference_adapter(clone: tuple[Path, dict],  # noqa: F811
                                                                    chain: dict) -> None:
    root, _ = clone
    assert chain["export"] == ["merge_pref", "gguf_pref"]  # the training stages of both chains current: skipped
    # the preference run's export beside the rest; the SFT run's outputs byte for byte, no SFT merge or GGUF
    assert {k: v for k, v in chain["after_export"].items() if not k.startswith("pref/")} == chain["sft_outputs"]
    assert not (root / "outputs/merged").exists() and not (root / "outputs/gguf").exists()
    merge = json.loads((root / "outputs/pref/export/merge_manifest.json").read_text())
    assert merge["inputs"]["adapter"]["path"] == "outputs/pref/adapter"
    assert merge["inputs"]["adapter"]["sha256"] == tree_digest(sha256_tree(root / "outputs/pref/adapter"))
    assert merge["parity"]["fp32_merge"]["passed"] and merge["parity"]["saved"]["passed"]
    gguf = json.loads((root / "outputs/pref/gguf/parity.json").read_text())
    assert gguf["holdout_prompts"] == len((root / "data/pairs/holdout.jsonl").read_text().splitlines())
    assert all(t["identical"] for t in gguf["tokenization"].values())
    assert (root / "outputs/pref/gguf/model-Q4_K_M.gguf").read_bytes()[:4] == b"GGUF"
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert lock["merge_pref"]["params"]["params_pref.yaml"]["objective"]["name"] == "dpo"
    assert {d["path"] for d in lock["merge_pref"]["deps"]} >= {"outputs/pref/adapter", "data/pairs/holdout.jsonl"}


def test_a_preference_stage_refuses_sft_params_in_one_line(clone: tuple[Path, dict], chain: dict) -> None:  # noqa: F811
    root, env = clone
    params = root / "params_pref.yaml"
    kept = params.read_text()
    try:
        params.write_text(kept.replace("objective:\n  name: dpo", "objective:\n  name: sft"))
        stage_env = {**env, "PYTHONPATH": str(root / "src"), "PATH": f"{VENV / 'bin'}:{env['PATH']}"}  # as make's
        proc = subprocess.run([str(VENV / "bin/dvc"), "repro", "-s", "-f", "train_pref"], cwd=root, env=stage_env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode != 0
        line = next(x for x in proc.stdout.splitlines() + proc.stderr.splitlines() if "objective.name" in x)
        assert re.match(r"params_pref.yaml:\d+: objective.name: 'sft', but the preference stages", line)
        assert "Running stage 'train_pref'" in proc.stdout and not (root / "outputs/adapter.tmp").exists()
        # an export stage of the preference chain too: merge_pref never merges into SFT's outputs/merged
        proc = subprocess.run([str(VENV / "bin/dvc"), "repro", "-s", "-f", "merge_pref"], cwd=root, env=stage_env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode != 0
        line = next(x for x in proc.stdout.splitlines() + proc.stderr.splitlines() if "objective.name" in x)
        assert re.match(r"params_pref.yaml:\d+: objective.name: 'sft', but the preference stages \(.*merge_pref", line)
        assert not (root / "outputs/merged").exists() and not (root / "outputs/pref/merged.tmp").exists()
    finally:
        params.write_text(kept)
