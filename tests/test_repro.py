"""Bitwise reruns and run verification on CPU: every stage re-run from its manifest gives the same bytes,
and when it does not, verify names the recorded input that changed.

Stages run as separate processes (as make and DVC run them), so nothing is shared between a run and its
re-run but the files on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune.invoices import generate
from reprotune.verify import input_differences, main, output_differences

from .conftest import REPO, TINY_TRAIN, write_jsonl


def stage(name: str, root: Path, *overrides: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONHASHSEED": "random"}  # verify re-runs with another
    proc = subprocess.run([sys.executable, "-m", f"reprotune.{name}", *overrides, f"paths.root={root}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """prepare + train on the tiny model, once, as the user's recorded run."""
    root = tmp_path_factory.mktemp("recorded")
    write_jsonl(root / "data/raw/invoices.jsonl", generate(40, seed=7))
    stage("prepare", root)
    stage("train", root, *TINY_TRAIN)
    return root


def verify(manifest: Path, *overrides: str, capsys: pytest.CaptureFixture) -> tuple[int, dict]:
    code = main(["--json", str(manifest), *overrides])
    out = capsys.readouterr().out
    return code, json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


@pytest.mark.slow  # make verify re-runs stages in subprocesses
def test_train_rerun_is_byte_identical(run: Path, capsys: pytest.CaptureFixture) -> None:
    code, report = verify(run / "outputs/train/manifest.json", capsys=capsys)
    recorded = json.loads((run / "outputs/train/manifest.json").read_text())
    print(f"train: adapter sha256 {recorded['outputs']['adapter']['sha256']} -> {report['outputs']}")
    assert report["outputs"] == {"adapter": "identical", "metrics": "identical", "loss_curves": "identical",
                                 "loss_plot": "identical"}
    assert report["identical"] and code == 0
    assert report["inputs_differ"] == {}, report["inputs_differ"]  # same machine, code, lock, data, config


@pytest.mark.slow  # make verify re-runs stages in subprocesses
def test_prepare_rerun_is_byte_identical(run: Path, capsys: pytest.CaptureFixture) -> None:
    code, report = verify(run / "data/prepared/manifest.json", capsys=capsys)
    assert report["outputs"] == {name: "identical" for name in
                                 ("train", "holdout", "report", "pii_report", "metrics", "lengths_plot")}
    assert code == 0 and report["inputs_differ"] == {}


@pytest.mark.slow  # make verify re-runs stages in subprocesses
def test_changed_data_is_named(run: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # a copy of the recorded run whose raw data has since changed (one more invoice)
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)
    with open(copy / "data/raw/invoices.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(generate(41, seed=7)[-1]) + "\n")
    code, report = verify(copy / "data/prepared/manifest.json", capsys=capsys)
    assert code == 1 and not report["identical"]
    assert "different" in report["outputs"]["train"] or "different" in report["outputs"]["holdout"]
    assert list(report["inputs_differ"]) == ["data"]
    assert report["inputs_differ"]["data"][0].startswith("raw_data: ")


@pytest.mark.slow  # make verify re-runs stages in subprocesses
def test_changed_config_is_named(run: Path, capsys: pytest.CaptureFixture) -> None:
    code, report = verify(run / "data/prepared/manifest.json", "data.holdout_fraction=0.5", capsys=capsys)
    assert code == 1
    assert list(report["inputs_differ"]) == ["config"]
    assert report["inputs_differ"]["config"] == ["data.holdout_fraction: 0.1 -> 0.5"]
    printed = main([str(run / "data/prepared/manifest.json"), "data.holdout_fraction=0.5"])
    out = capsys.readouterr().out
    assert printed == 1 and "RESULT: different; first recorded difference: config data.holdout_fraction: 0.1 -> 0.5" in out


def test_every_category_is_compared() -> None:
    """Each kind of recorded input that can change a result is reported under its own name."""
    base = {"git": {"commit": "a" * 40, "dirty": False}, "code": {"src_sha256": "1" * 64},
            "lock": {"sha256": "2" * 64, "variant": "cpu"}, "packages": {"all_sha256": "3" * 64},
            "inputs": {"train_data": {"sha256": "4" * 64}}, "config": {"seed": 42, "paths": {"root": "/a"}},
            "hardware": {"machine": "x86_64", "cpu": "Xeon", "cpu_count": 2, "torch_threads": 2, "gpus": [],
                         "driver": None},
            "runtime": {"torch": "2.13.0", "cuda": None, "cudnn": None, "container_image": None},
            "outputs": {"adapter": {"sha256": "5" * 64, "files": {"a": "6"}}}}
    changes = {
        "code": lambda m: m["code"].update(src_sha256="f" * 64),
        "lock": lambda m: m["lock"].update(sha256="f" * 64),
        "data": lambda m: m["inputs"]["train_data"].update(sha256="f" * 64),
        "config": lambda m: m["config"].update(seed=43),
        "hardware": lambda m: m["hardware"].update(cpu="EPYC"),
        "driver": lambda m: m["hardware"].update(driver="570.1"),
        "image": lambda m: m["runtime"].update(container_image="sha256:abc"),
    }
    for category, change in changes.items():
        other = json.loads(json.dumps(base))
        change(other)
        assert list(input_differences(base, other)) == [category], category
    moved = json.loads(json.dumps(base))
    moved["config"]["paths"]["root"] = "/elsewhere"  # where a run happened is not an input
    assert input_differences(base, moved) == {}
    changed = json.loads(json.dumps(base))
    changed["outputs"]["adapter"] = {"sha256": "7" * 64, "files": {"a": "8"}}
    assert output_differences(base, changed) == {"adapter": "different (a)"}


def test_another_host_names_the_first_difference(capsys: pytest.CaptureFixture) -> None:
    """A run recorded on an AVX-512 host with native kernels, verified on this one (pinned, AVX2): the report
    lists what the math ran on, the kernel level first, and the printed result names it."""
    from reprotune.manifest import hardware_state
    from reprotune.verify import print_report

    here = {"hardware": hardware_state(), "outputs": {}}
    there = json.loads(json.dumps(here))
    there["hardware"]["cpu_kernels"].update(mode="native", capability="AVX512")
    there["hardware"]["cpu_detail"]["isa"] = [*there["hardware"]["cpu_detail"]["isa"], "avx512_fake"]
    there["hardware"]["cpu"] = "Some Other CPU"
    differ = input_differences(there, here)
    assert list(differ) == ["hardware"]
    assert differ["hardware"][0] == f"cpu_kernels.mode: native -> {here['hardware']['cpu_kernels']['mode']}"
    assert any(line.startswith("cpu_kernels.capability: AVX512 -> ") for line in differ["hardware"])
    assert any(line.startswith("cpu: Some Other CPU -> ") for line in differ["hardware"])
    print_report({"stage": "train", "manifest": "m.json", "outputs": {"adapter": "different"},
                  "inputs_differ": differ, "identical": False})
    out = capsys.readouterr().out
    assert "RESULT: different; first recorded difference: hardware cpu_kernels.mode: native -> " in out
    # the user's own overridden settings are informational: pinned mode replaced them, they are no difference
    noisy = json.loads(json.dumps(here))
    noisy["hardware"]["cpu_kernels"]["user_env_overridden"] = {"ATEN_CPU_CAPABILITY": "avx512"}
    assert input_differences(noisy, here) == {}


def test_bad_run_argument_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(tmp_path / "nope.json")]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    broken = tmp_path / "manifest.json"
    broken.write_text('{"stage": "train",\n "config": }\n')
    assert main([str(broken)]) == 2
    err = capsys.readouterr().err
    assert "manifest.json: line 2" in err and "Traceback" not in err
    assert main(["not-a-revision-xyz"]) == 2
    assert "neither a manifest file nor a git revision" in capsys.readouterr().err
