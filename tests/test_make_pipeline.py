"""make train, make eval, make gguf as a new user runs them, in a fresh git copy of this checkout (tiny model):
each brings its prerequisites up to date through DVC and skips what is current, dvc.lock describes outputs/
afterwards; then the DVC chain sft -> preference (issue #26) in the same copy: make train ARGS="objective=dpo"
(prepare_pairs + train_pref from the SFT adapter, SFT's stages skipped), make eval ARGS="objective=dpo"
(eval_pref), make gguf ARGS="objective=dpo" (merge_pref + gguf_pref: the preference adapter exported under
outputs/pref), both chains' outputs in dvc.lock; changing one input re-runs exactly the stages that read it (and
those whose inputs changed), in both chains; and a preference stage refuses SFT params in one line.

The re-run matrix it prints is the one in docs/pipeline.md. (One copy for all of it: the SFT runs, the preference
chain and the matrix used to build their own copies, two of the suite's longest set-ups.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from reprotune.manifest import sha256_tree, tree_digest

from .conftest import REPO

pytestmark = pytest.mark.slow

VENV = Path(sys.executable).parent.parent
# the tiny model; a high learning rate so the adapter visibly moves the logits (merge parity has teeth)
TINY = ["model=tiny_random", "train.max_steps=3", "train.save_steps=3", "train.logging_steps=1",
        "train.per_device_train_batch_size=2", "train.learning_rate=0.01", "eval.max_examples=4",
        "eval.max_new_tokens=16", "export.merge.prompts=2", "export.parity.examples=2",
        "export.parity.max_new_tokens=16",
        # make repro's preference chain (DPO from the SFT adapter): 2 steps, not the built-in demo's 14
        "++objective.max_steps=2"]
ALL = ["prepare", "train", "eval", "merge", "gguf"]
# make repro's second chain (params_pref.yaml, objective=dpo)
PREF = ["prepare_pairs", "train_pref", "eval_pref", "merge_pref", "gguf_pref"]
DPO = ("objective=dpo", "objective.max_steps=2")  # the preference chain through make train/eval/gguf
TIMES: dict[str, float] = {}


def run(cmd: list[str], root: Path, env: dict, timeout: int = 1800) -> str:
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def make(root: Path, target: str, env: dict, extra: tuple[str, ...] = ()) -> list[str]:
    """Run a make target with the tiny settings; return the DVC stages it ran, in order."""
    started = time.time()
    log = run(["make", target, f"ARGS={' '.join([*TINY, *extra])}"], root, env)
    TIMES[target] = TIMES.get(target, 0.0) + time.time() - started
    return re.findall(r"Running stage '(\w+)'", log)


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A fresh git copy of this checkout (tracked + untracked-not-ignored files) with the shared venv."""
    root = tmp_path_factory.mktemp("clone") / "reprotune"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        if (REPO / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, root / rel)
    (root / ".venv").symlink_to(VENV)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MAKEFLAGS", "MAKELEVEL")}
    env.update({"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                "GIT_COMMITTER_EMAIL": "t@t", "DVC_NO_ANALYTICS": "1", "PYTHONHASHSEED": "random",
                "REPROTUNE_CACHE": str(REPO / ".cache/reprotune"),  # the tiny model, materialised once
                # the pinned llama.cpp build, reused (compiling it takes 6+ minutes)
                "LLAMA_CPP_CACHE": os.environ.get("LLAMA_CPP_CACHE", str(REPO / ".cache/llama-cpp"))})
    run(["git", "init", "-q", "-b", "main"], root, env)
    run(["git", "add", "-A"], root, env)
    run(["git", "commit", "-q", "-m", "fresh clone"], root, env)
    return root, env


@pytest.fixture(scope="module")
def first_runs(clone: tuple[Path, dict]) -> dict[str, list[str]]:
    root, env = clone
    return {target: make(root, target, env) for target in ("train", "eval", "gguf")}


def assert_serves_its_choice(gguf_dir: Path) -> None:
    """The default export (export.quant, whatever it names) ships the file parity.json says it serves, and the
    Modelfile points at it."""
    parity = json.loads((gguf_dir / "parity.json").read_text())
    served = parity["serve_quant"]
    assert served in parity["gate"] and parity["modelfile"]["from"] == f"model-{served}.gguf"
    assert (gguf_dir / f"model-{served}.gguf").read_bytes()[:4] == b"GGUF"
    assert f"FROM ./model-{served}.gguf" in (gguf_dir / "Modelfile").read_text()


def test_train_eval_gguf_from_a_fresh_clone(clone: tuple[Path, dict], first_runs: dict[str, list[str]]) -> None:
    root, env = clone
    assert first_runs == {"train": ["prepare", "train"], "eval": ["eval"], "gguf": ["merge", "gguf"]}
    # the SFT chain's stages (the preference chain has not run in this clone)
    assert "Data and pipelines are up to date." in run([str(VENV / "bin/dvc"), "status", "prepare", "train", "eval",
                                                        "merge", "gguf"], root, env)
    for path in ("outputs/adapter/adapter_model.safetensors", "outputs/eval/metrics.json",
                 "outputs/merged/model.safetensors", "outputs/export/gguf_manifest.json"):
        assert (root / path).is_file(), path
    assert_serves_its_choice(root / "outputs/gguf")
    lock = (root / "dvc.lock").read_text()
    assert all(f"  {stage}:" in lock for stage in ALL)
    print(f"\nfresh clone, tiny model: make train {TIMES['train']:.0f}s, make eval {TIMES['eval']:.0f}s, "
          f"make gguf {TIMES['gguf']:.0f}s")


def test_a_second_make_train_runs_nothing(clone: tuple[Path, dict], first_runs: dict[str, list[str]]) -> None:
    root, env = clone
    before = sha256_tree(root / "outputs")
    assert make(root, "train", env) == []
    assert make(root, "gguf", env) == []
    assert sha256_tree(root / "outputs") == before


# ----------------------------------------------------------------------- the preference chain (sft -> dpo)
@pytest.fixture(scope="module")
def chain(clone: tuple[Path, dict], first_runs: dict[str, list[str]]) -> dict:
    """make train, eval and gguf ARGS="objective=dpo" after the SFT chain's runs, the outputs before and after."""
    root, env = clone
    sft_outputs = sha256_tree(root / "outputs")
    pref = make(root, "train", env, DPO)
    after_pref = sha256_tree(root / "outputs")
    evals = make(root, "eval", env, DPO)
    exports = make(root, "gguf", env, DPO)
    after_export = sha256_tree(root / "outputs")
    return {"sft_outputs": sft_outputs, "pref": pref, "after_pref": after_pref, "eval": evals,
            "export": exports, "after_export": after_export}


def test_make_train_with_dpo_runs_the_preference_chain_from_the_sft_adapter(clone: tuple[Path, dict],
                                                                             chain: dict) -> None:
    root, env = clone
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
    status = run([str(VENV / "bin/dvc"), "status", "train", "train_pref", "eval_pref", "gguf_pref"], root, env)
    assert "up to date" in status


def test_make_merge_and_gguf_with_dpo_export_the_preference_adapter(clone: tuple[Path, dict], chain: dict) -> None:
    root, _ = clone
    # the training stages of both chains and SFT's own export current: skipped
    assert chain["export"] == ["merge_pref", "gguf_pref"]
    # the preference run's export beside the rest; the SFT run's outputs (its merge and GGUF too) byte for byte
    assert {k: v for k, v in chain["after_export"].items() if not k.startswith("pref/")} == chain["sft_outputs"]
    assert any(k.startswith("merged/") for k in chain["sft_outputs"])
    merge = json.loads((root / "outputs/pref/export/merge_manifest.json").read_text())
    assert merge["inputs"]["adapter"]["path"] == "outputs/pref/adapter"
    assert merge["inputs"]["adapter"]["sha256"] == tree_digest(sha256_tree(root / "outputs/pref/adapter"))
    assert merge["parity"]["fp32_merge"]["passed"] and merge["parity"]["saved"]["passed"]
    gguf = json.loads((root / "outputs/pref/gguf/parity.json").read_text())
    assert gguf["holdout_prompts"] == len((root / "data/pairs/holdout.jsonl").read_text().splitlines())
    assert all(t["identical"] for t in gguf["tokenization"].values())
    assert_serves_its_choice(root / "outputs/pref/gguf")
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert lock["merge_pref"]["params"]["params_pref.yaml"]["objective"]["name"] == "dpo"
    assert {d["path"] for d in lock["merge_pref"]["deps"]} >= {"outputs/pref/adapter", "data/pairs/holdout.jsonl"}


# ------------------------------------------------------------------------------------------ re-run matrix
def _append_comment(root: Path, rel: str) -> None:
    path = root / rel
    path.write_text(path.read_text() + "# touched by tests/test_make_pipeline.py\n")


def _stale(root: Path, env: dict, extra: tuple[str, ...]) -> list[str]:
    """The stages `make repro ARGS=...` would run first: params.yaml and params_pref.yaml written as make repro
    writes them (reprotune.runner.write_params), then `dvc status`, DVC's own test of changed deps and params."""
    stage_env = {**env, "PYTHONPATH": str(root / "src")}
    code = f"from reprotune.runner import write_params; write_params('all', {[*TINY, *extra]!r}, False)"
    run([sys.executable, "-c", code], root, stage_env)
    proc = subprocess.run([str(VENV / "bin/dvc"), "status", "--json"], cwd=root, env=stage_env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [name.rsplit(":", 1)[-1] for name in json.loads(proc.stdout or "{}")]


E8 = ("eval.max_new_tokens=8",)
# (what changes, extra ARGS, a file edited, the stages expected, how), applied one after the other. "run": make
# repro runs them and the change stays. "stale": `dvc status` names them and the change is undone, no stage runs:
# here the gguf rows would be llama.cpp's convert, the imatrix, the quant ladder and parity in both chains (make gguf
# of the tiny model: 48 s of the 2-core box), the merge row both merges and both of those again, the metrics.py row
# both evaluations again (the eval.max_new_tokens row runs them), and which stages a change reaches is DVC's status
# either way; the "run" rows show make repro acting on it, the cascade to every stage after a re-run one included
# (train.max_steps).
MATRIX = [
    ("nothing", (), None, [], "run"),
    ("eval.max_new_tokens=8", E8, None, ["eval", "eval_pref"], "run"),
    ("export.parity.max_new_tokens=8", (*E8, "export.parity.max_new_tokens=8"), None, ["gguf", "gguf_pref"],
     "stale"),
    ("edit src/reprotune/modelfile.py", E8, "src/reprotune/modelfile.py", ["gguf", "gguf_pref"], "stale"),
    # make gguf's parity gate scores the task with the eval stage's metrics (reprotune.gguf_quality, issue #49), and
    # train's GRPO rewards with them too (reprotune.rl.rewards: field_accuracy is eval's score, issue #47)
    ("edit src/reprotune/metrics.py", E8, "src/reprotune/metrics.py",
     ["train", "eval", "gguf", "train_pref", "eval_pref", "gguf_pref"], "stale"),
    # stale: dvc status names the stages whose own params changed; run, their new merged/parity.json (it records
    # the prompt count) would re-run gguf and gguf_pref after them, as the train.max_steps row's cascade shows
    ("export.merge.prompts=3", (*E8, "export.merge.prompts=3"), None, ["merge", "merge_pref"], "stale"),
    ("train.max_steps=4", (*E8, "train.max_steps=4"), None,
     ["train", "eval", "merge", "gguf", *PREF[1:]], "run"),
]


def test_rerun_matrix(clone: tuple[Path, dict], chain: dict) -> None:
    """make repro (all stages of both chains) after each change: which stages ran (or, for a "stale" row, which
    dvc status names before the change is undone)."""
    root, env = clone
    ran = make(root, "repro", env)  # make train/eval/gguf, with and without objective=dpo, left nothing to do
    rows = [("first make repro, after make train/eval/gguf with and without objective=dpo", ran, "run")]
    assert ran == []
    current: tuple[str, ...] = ()  # the ARGS the outputs were last built with
    for label, extra, edited, expected, how in MATRIX:
        kept = (root / edited).read_text() if edited else None
        if edited:
            _append_comment(root, edited)
        if how == "run":
            ran, current = make(root, "repro", env, extra), extra
        else:
            ran = _stale(root, env, extra)
            if edited:
                (root / edited).write_text(kept)
            assert _stale(root, env, current) == [], f"{label}: undoing it left stages stale"
        rows.append((label, ran, how))
        assert sorted(ran, key=[*ALL, *PREF].index) == expected, (label, ran)
    # the model cache somewhere else: no stage reads where it is, so nothing re-runs
    other = dict(env, REPROTUNE_CACHE=str(root.parent / "other-cache"))
    ran = make(root, "repro", other, MATRIX[-1][1])
    rows.append(("REPROTUNE_CACHE elsewhere", ran, "run"))
    assert ran == []
    print("\n| change | stages re-run |\n|---|---|")
    for label, ran, how in rows:
        print(f"| {label} | {', '.join(ran) or 'none'}{' (stale in dvc status; undone, not run)' if how == 'stale' else ''} |")


def test_a_preference_stage_refuses_sft_params_in_one_line(clone: tuple[Path, dict], chain: dict) -> None:
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
        merged = sha256_tree(root / "outputs/merged")
        proc = subprocess.run([str(VENV / "bin/dvc"), "repro", "-s", "-f", "merge_pref"], cwd=root, env=stage_env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode != 0
        line = next(x for x in proc.stdout.splitlines() + proc.stderr.splitlines() if "objective.name" in x)
        assert re.match(r"params_pref.yaml:\d+: objective.name: 'sft', but the preference stages \(.*merge_pref", line)
        assert sha256_tree(root / "outputs/merged") == merged and not (root / "outputs/pref/merged.tmp").exists()
    finally:
        params.write_text(kept)
