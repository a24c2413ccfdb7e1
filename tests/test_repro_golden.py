"""Golden trajectory: the per-step training loss and the adapter bytes of a small fixed run are pinned in
tests/golden/, exactly, on every CPU.

An innocent-looking version bump (torch, transformers, trl, peft) or a refactor that changes training shows up
here. There is no looser branch for "another CPU": the CPU kernels are pinned (hardware.cpu_kernels=pinned,
reprotune/kernels.py) to one level every x86-64 CPU has, so an AVX-512 host, an AVX2 host, Intel or AMD, one
thread or two in OMP_NUM_THREADS (a CPU run computes with hardware.num_threads, else 2), must all give the
reference bytes; the child-process test below forces each kernel level this CPU
can run and each thread count and checks exactly that.

Intended change? Regenerate and commit the reference:
    REPROTUNE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_repro_golden.py -k matches_reference
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune import kernels
from reprotune.config import compose
from reprotune.kernels import PINNED_THREADS
from reprotune.manifest import cpu_state, package_versions
from reprotune.train import train

GOLDEN = Path(__file__).parent / "golden"
REFERENCE = GOLDEN / "tiny_train_loss.json"
# fixed data committed next to the reference (not regenerated: a data-generator change must not move it)
DATA = GOLDEN / "train.jsonl"
# spelled out (not conftest's TINY_TRAIN): the pinned run must not move when other tests' settings do
RUN = ["model=tiny_random", "train.max_steps=6", "train.save_steps=100", "train.logging_steps=1",
       "train.per_device_train_batch_size=4", "seed=42"]


def _workspace(root: Path) -> None:
    (root / "data/prepared").mkdir(parents=True)
    (root / "data/prepared/train.jsonl").write_bytes(DATA.read_bytes())


def _summary(root: Path, record: dict) -> dict:
    curve = json.loads((root / "outputs/train/loss_curves.json").read_text())["train"]
    return {"overrides": RUN, "loss": [loss for _, loss in curve], "steps": [step for step, _ in curve],
            "adapter_sha256": record["outputs"]["adapter"]["sha256"],
            "cpu": record["hardware"]["cpu"], "cpu_vendor": record["hardware"]["cpu_detail"]["vendor"],
            "cpu_family_model": record["hardware"]["cpu_detail"].get("family_model_stepping"),
            "cpu_avx512": "avx512f" in record["hardware"]["cpu_detail"].get("isa", []),
            "cpu_kernels": {k: v for k, v in record["hardware"]["cpu_kernels"].items()
                            if k in ("mode", "capability", "env", "blas", "matmul")},
            "packages": package_versions()["key"]}


def golden_run(root: Path) -> dict:
    _workspace(root)
    return _summary(root, train(compose([*RUN, f"paths.root={root}"])))


def test_loss_trajectory_matches_reference(tmp_path: Path) -> None:
    got = golden_run(tmp_path)
    if os.environ.get("REPROTUNE_UPDATE_GOLDEN") == "1":
        REFERENCE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    ref = json.loads(REFERENCE.read_text())
    assert got["overrides"] == ref["overrides"], "the golden run's settings changed: regenerate the reference"
    assert got["steps"] == ref["steps"]
    changed = {k: (ref["packages"].get(k), v) for k, v in got["packages"].items() if ref["packages"].get(k) != v}
    context = (f"reference recorded on {ref['cpu']!r} ({ref.get('cpu_vendor')}) with kernels "
               f"{ref.get('cpu_kernels')}; this run on {got['cpu']!r} ({got['cpu_vendor']}) with {got['cpu_kernels']}"
               + (f"; packages changed since: {changed}" if changed else ""))
    diffs = [(s, r, g) for s, r, g in zip(got["steps"], ref["loss"], got["loss"], strict=True) if r != g]
    assert not diffs, (f"training changed: per-step loss differs from tests/golden at (step, reference, now) "
                       f"{diffs[:3]} ({context}). If intended, regenerate: REPROTUNE_UPDATE_GOLDEN=1")
    assert got["adapter_sha256"] == ref["adapter_sha256"], f"adapter bytes changed ({context})"


# torch's AVX-512 kernels need these (aten/src/ATen/native/DispatchStub.cpp's check, via cpuinfo)
AVX512_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def levels_this_cpu_runs() -> list[str]:
    """The ATEN_CPU_CAPABILITY values this CPU can run, lowest first."""
    isa = set(cpu_state()["isa"])
    levels = ["default"]
    if "avx2" in isa and "fma" in isa:
        levels.append("avx2")
    if isa >= AVX512_FLAGS:
        levels.append("avx512")
    return levels


def child_run(root: Path, env: dict[str, str], *overrides: str, launcher: tuple[str, ...] = ()) -> dict:
    """The golden run as `make train` runs it (its own process, its own torch import) with env added; launcher:
    a command the interpreter runs under (an emulated CPU)."""
    _workspace(root)
    cmd = [*launcher, sys.executable, "-m", "reprotune.train", *RUN, f"paths.root={root}", *overrides]
    clean = {k: v for k, v in os.environ.items() if k not in {*kernels._all_pinned_names(), "OMP_NUM_THREADS",
                                                              "REPROTUNE_CPU_KERNELS", "REPROTUNE_USER_CPU_ENV"}}
    proc = subprocess.run(cmd, env={**clean, **env}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((root / "outputs/train/manifest.json").read_text())
    return {**_summary(root, record), "threads": record["hardware"]["torch_threads"], "stderr": proc.stderr,
            "optim": record["run_settings"]["optim"]}


@pytest.mark.slow
def test_golden_bytes_under_every_kernel_level_and_thread_count(tmp_path: Path) -> None:
    """A user's ATEN_CPU_CAPABILITY (each level this CPU runs) or thread count does not move the bytes: pinned
    mode overrides the level, with one line saying so; and the control shows the forcing itself is real
    (hardware.cpu_kernels=native keeps the user's level: the recorded capability is the forced one)."""
    ref = json.loads(REFERENCE.read_text())
    levels = levels_this_cpu_runs()
    # one run per level, thread counts alternating; the last with HF_HUB_OFFLINE=0 (transformers writes it into
    # tokenizer_config.json, local_files_only, unless reprotune drops it); a CPU of one level gets a second run, so
    # that both thread counts are tried
    cases = [({"ATEN_CPU_CAPABILITY": level, "OMP_NUM_THREADS": str(1 + i % 2)}) for i, level in
             enumerate(levels)] + ([{"OMP_NUM_THREADS": "2"}] if len(levels) == 1 else [])
    cases[-1]["HF_HUB_OFFLINE"] = "0"
    assert {c["OMP_NUM_THREADS"] for c in cases} == {"1", "2"}
    for i, env in enumerate(cases):
        got = child_run(tmp_path / f"pinned-{i}", env)
        where = f"with {env} on {got['cpu']!r}"
        assert got["threads"] == PINNED_THREADS, where  # OMP_NUM_THREADS does not change the pinned count
        assert got["cpu_kernels"]["capability"] == "AVX2", where
        assert got["optim"] == "adamw_torch_fused", where
        assert got["loss"] == ref["loss"], f"per-step loss moved {where}: {got['loss']} vs {ref['loss']}"
        assert got["adapter_sha256"] == ref["adapter_sha256"], f"adapter bytes moved {where}"
        if env.get("ATEN_CPU_CAPABILITY", "avx2") != "avx2":
            assert f"ATEN_CPU_CAPABILITY={env['ATEN_CPU_CAPABILITY']} overridden to avx2" in got["stderr"]
    top = levels[-1]
    native = child_run(tmp_path / "native", {"ATEN_CPU_CAPABILITY": top, "OMP_NUM_THREADS": "1"},
                       "hardware.cpu_kernels=native")
    assert native["cpu_kernels"]["mode"] == "native" and native["threads"] == 1
    assert native["cpu_kernels"]["capability"] == top.upper(), native["cpu_kernels"]
    assert native["cpu_kernels"]["env"]["MKL_CBWR"] is None, "native mode must leave MKL to the host"
