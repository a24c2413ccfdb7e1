"""Resume parity: kill -9 a training run after a checkpoint, rerun, and get the uninterrupted run's bytes.

Also: torn checkpoints (killed while being written) are never resumed, and rotation keeps a good one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reprotune.checkpoints import CHECKPOINT_SEAL, good_checkpoints, is_sealed, seal_checkpoint
from reprotune.invoices import generate
from reprotune.manifest import sha256_tree

from .conftest import REPO, TINY_TRAIN, write_jsonl

# 12 examples in batches of 4: 3 steps an epoch, so the 6-step run resumes across an epoch boundary
RUN = [*TINY_TRAIN, "train.max_steps=6", "train.save_steps=2", "train.per_device_train_batch_size=4",
       "train.save_total_limit=2"]


def train_cmd(root: Path) -> list[str]:
    return [sys.executable, "-m", "reprotune.train", *RUN, f"paths.root={root}"]


def stage_env(hash_seed: int = 0) -> dict[str, str]:
    # each process gets another str-hash seed: outputs must not depend on set/dict-of-str iteration order
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONHASHSEED": str(hash_seed),
            "TOKENIZERS_PARALLELISM": "false"}


def make_root(root: Path) -> Path:
    write_jsonl(root / "data/prepared/train.jsonl", generate(12, seed=11))
    return root


def wait_for_sealed(ckpts: Path, step: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (ckpts / f"checkpoint-{step}" / CHECKPOINT_SEAL).is_file():
            return
        if proc.poll() is not None:
            raise AssertionError(f"training exited ({proc.returncode}) before checkpoint-{step} was sealed")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no sealed checkpoint-{step} within {timeout}s")


def killed_at_step_then_rerun(cmd, straight: Path, killed: Path, out: str, step: int = 2) -> tuple[dict, dict]:
    """`cmd(root)` run straight through in `straight`; in `killed` it is killed (SIGKILL) once checkpoint-`step` of
    `out`/checkpoints is sealed, and run again. Returns the train manifests (resumed, uninterrupted), after
    checking the kill left no adapter and the rerun resumed from that checkpoint."""
    subprocess.run(cmd(straight), env=stage_env(), check=True, capture_output=True, timeout=600)
    proc = subprocess.Popen(cmd(killed), env=stage_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_sealed(killed / out / "checkpoints", step, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / out / "adapter").exists()
    rerun = subprocess.run(cmd(killed), env=stage_env(2), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed, whole = (json.loads((r / out / "train/manifest.json").read_text()) for r in (killed, straight))
    assert resumed["resumed_from"] and Path(resumed["resumed_from"]).name == f"checkpoint-{step}"
    return resumed, whole


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = make_root(tmp_path_factory.mktemp("straight"))
    subprocess.run(train_cmd(root), env=stage_env(), check=True, capture_output=True, timeout=600)
    return root, json.loads((root / "outputs/train/manifest.json").read_text())


def add_torn_checkpoints(ckpts: Path) -> list[Path]:
    """What a kill mid-write or disk trouble leaves: newer checkpoints that must never be resumed."""
    newest = good_checkpoints(ckpts, remove_torn=False)[-1]
    torn = ckpts / "checkpoint-98"  # the Trainer was killed before the seal was written
    shutil.copytree(newest, torn)
    (torn / CHECKPOINT_SEAL).unlink()
    corrupt = ckpts / "checkpoint-99"  # sealed, then a file was truncated: the seal no longer matches
    shutil.copytree(newest, corrupt)
    optimizer = corrupt / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:100])
    assert not is_sealed(torn) and not is_sealed(corrupt) and is_sealed(newest)
    return [torn, corrupt]


@pytest.mark.slow  # three training processes, one killed mid-run
def test_kill_9_then_rerun_is_byte_identical(uninterrupted: tuple[Path, dict], tmp_path: Path) -> None:
    straight_root, straight = uninterrupted
    root = make_root(tmp_path)
    ckpts = root / "outputs/checkpoints"
    kill_after = random.choice([2, 4])  # a random checkpoint, then a random moment in the steps after it
    delay = random.uniform(0.0, 0.5)
    # printed before the kill: a failure's captured output names the draw that led to it
    print(f"drew: SIGKILL {delay:.3f} s after checkpoint-{kill_after} is sealed", flush=True)
    proc = subprocess.Popen(train_cmd(root), env=stage_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_sealed(ckpts, kill_after, proc)
    time.sleep(delay)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (root / "outputs/adapter").exists()
    fakes = add_torn_checkpoints(ckpts)

    rerun = subprocess.run(train_cmd(root), env=stage_env(2), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    resumed = json.loads((root / "outputs/train/manifest.json").read_text())
    assert resumed["resumed_from"], "the rerun did not resume from a checkpoint"
    step = int(Path(resumed["resumed_from"]).name.split("-")[1])
    assert kill_after <= step < 98, f"resumed from {resumed['resumed_from']}"
    assert "removing torn checkpoint" in rerun.stdout + rerun.stderr
    assert not any(f.exists() for f in fakes)
    print(f"killed after checkpoint-{kill_after}, resumed from checkpoint-{step}; adapter sha256 "
          f"{resumed['outputs']['adapter']['sha256']} (uninterrupted: {straight['outputs']['adapter']['sha256']})")
    assert resumed["outputs"]["adapter"]["files"] == straight["outputs"]["adapter"]["files"]
    assert resumed["outputs"]["adapter"]["sha256"] == straight["outputs"]["adapter"]["sha256"]
    assert (root / "outputs/train/metrics.json").read_bytes() == \
        (straight_root / "outputs/train/metrics.json").read_bytes()
    assert not ckpts.exists()  # a finished run cleans up


def test_seal_lists_every_file(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"abc")
    (folder / "sub").mkdir()
    (folder / "sub/b.json").write_text("{}")
    assert not is_sealed(folder)
    seal_checkpoint(folder, 3)
    seal = json.loads((folder / CHECKPOINT_SEAL).read_text())
    assert seal["step"] == 3 and seal["files"] == sha256_tree(folder, exclude=[CHECKPOINT_SEAL])
    assert set(seal["files"]) == {"a.bin", "sub/b.json"}
    assert is_sealed(folder)
    (folder / "a.bin").unlink()
    assert not is_sealed(folder)
