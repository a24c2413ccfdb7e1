"""Several processes: the same launch path as 'make train NPROC=2' (torchrun, the Trainer's DDP), here with 2 CPU
processes on the gloo backend and the tiny model. Checked: two runs give byte-identical adapters, 1 process and
2 processes with the same global batch give the same per-step loss (tolerance 1e-5; on CPU they came out equal),
and kill -9 of one rank after a checkpoint, then a rerun, resumes and gives the uninterrupted run's bytes.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from reprotune import distributed
from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.invoices import generate

from .conftest import REPO, write_jsonl

# 16 examples, global batch 2 rows x 2: with 2 processes each takes 2 rows and accumulates once
RUN = ["model=tiny_random", "train.max_steps=6", "train.save_steps=2", "train.logging_steps=1",
       "train.per_device_train_batch_size=2", "train.gradient_accumulation_steps=2"]


def env(nproc: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false",
            "NPROC": str(nproc), "OMP_NUM_THREADS": "1"}


def launch(root: Path, nproc: int, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "reprotune.distributed", *RUN, f"paths.root={root}"]
    return subprocess.Popen(cmd, env=env(nproc), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kw)


def run(root: Path, nproc: int) -> dict:
    if not (root / "data/prepared/train.jsonl").exists():
        write_jsonl(root / "data/prepared/train.jsonl", generate(16, seed=5))
    proc = launch(root, nproc)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]
    manifest = json.loads((root / "outputs/train/manifest.json").read_text())
    manifest["_log"] = out
    return manifest


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    return {"one": run(tmp_path_factory.mktemp("one"), 1), "two": run(tmp_path_factory.mktemp("two"), 2),
            "two_again": run(tmp_path_factory.mktemp("two_again"), 2)}


def _curve(manifest: dict) -> list[tuple[int, float]]:
    root = Path(manifest["config"]["paths"]["root"])
    return json.loads((root / "outputs/train/loss_curves.json").read_text())["train"]


@pytest.mark.slow
def test_two_processes_keep_the_global_batch(runs: dict[str, dict]) -> None:
    two = runs["two"]
    assert two["distributed"]["world_size"] == 2 and two["distributed"]["strategy"] == "ddp"
    assert "= 4 (configured global batch kept)" in two["distributed"]["global_batch"]
    assert runs["one"]["distributed"]["world_size"] == 1
    assert two["_log"].count("global batch 2 rows x 1 accumulation x 2 process(es)") >= 1
    # torchrun's workers are pinned like a single process (they inherit the launcher's pin and pin again)
    kernels = two["hardware"]["cpu_kernels"]
    assert kernels["mode"] == "pinned" and kernels["capability"] == runs["one"]["hardware"]["cpu_kernels"]["capability"]
    assert kernels["env"] == runs["one"]["hardware"]["cpu_kernels"]["env"] and kernels["env"]["ATEN_CPU_CAPABILITY"]


@pytest.mark.slow
def test_two_process_rerun_is_byte_identical(runs: dict[str, dict]) -> None:
    assert runs["two"]["outputs"]["adapter"]["files"] == runs["two_again"]["outputs"]["adapter"]["files"]


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_losses(runs: dict[str, dict]) -> None:
    one, two = _curve(runs["one"]), _curve(runs["two"])
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(1, 7))
    worst = max(abs(a - b) for (_, a), (_, b) in zip(one, two, strict=True))
    print(f"largest per-step loss difference, 1 vs 2 processes: {worst:.3g}")
    assert worst <= 1e-5


@pytest.mark.slow
def test_kill_9_of_one_rank_then_rerun_resumes_identically(runs: dict[str, dict], tmp_path: Path) -> None:
    import psutil

    write_jsonl(tmp_path / "data/prepared/train.jsonl", generate(16, seed=5))
    proc = launch(tmp_path, 2)
    kill_after = random.choice([2, 4])
    print(f"drew: kill one rank once checkpoint-{kill_after} is sealed", flush=True)  # before it happens
    seal = tmp_path / f"outputs/checkpoints/checkpoint-{kill_after}/reprotune-sealed.json"
    waited = time.monotonic()
    while not seal.is_file():
        assert proc.poll() is None, f"the run ended ({proc.returncode}) before checkpoint-{kill_after} was sealed"
        # a 6-step tiny run seals checkpoint-4 in well under a minute on 2 busy cores: 10 min is a hang, not load
        assert time.monotonic() - waited < 600, f"no sealed checkpoint-{kill_after} after 10 min: the run hangs"
        time.sleep(0.05)
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "reprotune.train" in " ".join(p.cmdline())]
    assert len(ranks) == 2
    victim = random.choice(ranks)
    # printed before the kill: a failure's captured output names the draw that led to it
    print(f"drew: SIGKILL pid {victim.pid} of the rank processes {[r.pid for r in ranks]}", flush=True)
    os.kill(victim.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0 and not (tmp_path / "outputs/adapter").exists(), "the run finished before the kill"

    resumed = run(tmp_path, 2)
    assert resumed["resumed_from"], resumed["_log"][-2000:]
    assert resumed["outputs"]["adapter"]["files"] == runs["two"]["outputs"]["adapter"]["files"]


def test_global_batch_divides_accumulation() -> None:
    cfg = compose(["train.gradient_accumulation_steps=4"])
    assert distributed.global_batch(cfg, 2, 4, 2)[0] == 2
    assert distributed.global_batch(cfg, 2, 4, 4)[0] == 1
    accum, line = distributed.global_batch(cfg, 2, 3, 2)
    assert accum == 3 and "2x the configured one" in line
    kept = compose(["hardware.keep_global_batch=false"])
    assert distributed.global_batch(kept, 2, 4, 2)[0] == 4


def test_launch_command_single_host_and_multi_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setenv("NNODES", "1")
    cmd = distributed.launch_command(["model=tiny_random"], 2)
    assert "--standalone" in cmd and "--nproc_per_node=2" in cmd and cmd[-2:] == ["reprotune.train", "model=tiny_random"]
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("MASTER_PORT", "29400")
    cmd = distributed.launch_command([], 8)
    assert {"--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.5", "--master_port=29400"} <= set(cmd)
    assert "--standalone" not in cmd


def test_strategy_choice() -> None:
    assert distributed.strategy(compose([]), 1) == "none"
    assert distributed.strategy(compose([]), 2) == "ddp"
    assert distributed.strategy(compose(["hardware.distributed=fsdp2"]), 2) == "fsdp2"
    args = distributed.trainer_arguments(compose(["hardware.distributed=fsdp2"]), "fsdp2")
    assert args["fsdp"] == "full_shard auto_wrap" and args["fsdp_config"]["fsdp_version"] == 2
    with pytest.raises(ReprotuneError, match="hardware.distributed: must be auto, ddp or fsdp2, not 'zero3'"):
        distributed.trainer_arguments(compose(["hardware.distributed=zero3"]), "zero3")


def _gpu_host(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """A host with `count` CUDA devices, as torch reports it (the only thing faked: torch's device query)."""
    import torch

    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def _dvc_train_args() -> list[str]:
    """The arguments dvc.yaml's train stage passes to reprotune.distributed (what `make train` runs)."""
    import shlex

    import yaml

    cmd = shlex.split(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]["cmd"])
    assert cmd[:3] == ["python", "-m", "reprotune.distributed"], cmd
    return cmd[3:]


@pytest.mark.parametrize(("hardware", "expected"), [("gpu", 4), ("cpu", 1), ("auto", 1)])
def test_nproc_reads_the_device_from_params_yaml_under_dvc(hardware: str, expected: int, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """make train ARGS="hardware=gpu": params.yaml is written from the ARGS, DVC runs the stage with
    `--config-dir . --config-name params` only, and every GPU of the host gets a process."""
    from reprotune.config import dump_params

    dump_params([f"hardware={hardware}"], tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    _gpu_host(monkeypatch, 4)
    args = _dvc_train_args()
    assert not any(a.startswith("hardware") for a in args)  # the device comes from params.yaml alone
    assert distributed.nproc(args) == expected
    monkeypatch.setenv("NPROC", "2")
    assert distributed.nproc(args) == 2  # NPROC still overrides


def test_nproc_of_the_direct_module_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """python -m reprotune.distributed hardware=gpu: every GPU; hardware=cpu or a CPU-only host: one."""
    _gpu_host(monkeypatch, 3)
    assert distributed.nproc(["hardware=gpu", "model=tiny_random"]) == 3
    assert distributed.nproc(["hardware=cpu"]) == 1
    assert distributed.nproc(["hardware=gpu", "hardware.device=cpu"]) == 1
    assert distributed.launch_command(["hardware=gpu"], distributed.nproc(["hardware=gpu"]))[3] == "--nproc_per_node=3"
    _gpu_host(monkeypatch, 0)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.nproc(["hardware=gpu"]) == 1
