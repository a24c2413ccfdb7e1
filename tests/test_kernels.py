"""CPU kernel pinning (reprotune/kernels.py): read from the command line or the config file before torch loads,
applied in fresh processes as the stages start, a user's own setting overridden with one line, native mode giving
it back, and the composed config checked against what was pinned."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune import kernels
from reprotune.config import dump_params

from .conftest import REPO

PROBE = ("import reprotune, torch, os, json; print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(),"
         " 'env': {k: os.environ.get(k) for k in ('ATEN_CPU_CAPABILITY', 'MKL_CBWR', 'REPROTUNE_CPU_KERNELS')}}))")


def probe(*argv: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """A fresh process that imports reprotune, then torch (as `python -m reprotune.<stage> argv` does)."""
    clean = {k: v for k, v in os.environ.items() if k not in kernels._all_pinned_names()
             and not k.startswith("REPROTUNE_C") and k != kernels.USER_ENV}
    code = f"import sys; sys.argv = ['stage', *{list(argv)!r}]; {PROBE}"
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(REPO / "src"), **(env or {})},
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_mode_from_the_command_line_the_config_file_and_the_parent(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.APPLIED_ENV, raising=False)
    assert kernels.mode_from_argv([]) == "pinned"
    assert kernels.mode_from_argv(["model=tiny_random", "hardware.cpu_kernels=native"]) == "native"
    assert kernels.mode_from_argv(["++hardware.cpu_kernels=native", "hardware.cpu_kernels=pinned"]) == "pinned"
    dump_params(["hardware.cpu_kernels=native"], tmp_path / "params.yaml")
    dvc = ["--config-dir", str(tmp_path), "--config-name", "params", "hydra.run.dir=."]
    assert kernels.mode_from_argv(dvc) == "native"
    assert kernels.mode_from_argv([f"--config-dir={tmp_path}", "-cn", "params"]) == "native"
    assert kernels.mode_from_argv([*dvc, "hardware.cpu_kernels=pinned"]) == "pinned"  # an override wins
    monkeypatch.setenv(kernels.APPLIED_ENV, "native")  # a native parent (torchrun, a test run)
    assert kernels.mode_from_argv(["model=tiny_random"]) == "native"


def test_a_users_level_is_overridden_with_one_line_and_native_gives_it_back() -> None:
    pinned, err = probe(env={"ATEN_CPU_CAPABILITY": "default"})
    level = kernels.pinned_env()["ATEN_CPU_CAPABILITY"]
    assert pinned["capability"] == level.upper()  # forced below the user's (and the CPU's) level, to the pinned one
    assert pinned["env"]["ATEN_CPU_CAPABILITY"] == kernels.pinned_env()["ATEN_CPU_CAPABILITY"]
    assert err.count("reprotune: ATEN_CPU_CAPABILITY=default overridden to") == 1
    native, err = probe("hardware.cpu_kernels=native", env={"ATEN_CPU_CAPABILITY": "default"})
    assert native["capability"] == "DEFAULT" and native["env"]["MKL_CBWR"] is None and "overridden" not in err
    assert native["env"]["REPROTUNE_CPU_KERNELS"] == "native"


def test_a_native_child_of_a_pinned_parent_gets_the_users_values_back() -> None:
    """A pinned parent (the test suite, a launcher) starting `python -m reprotune.train hardware.cpu_kernels=native`:
    the child drops what the parent pinned and restores what the user had."""
    parent = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", kernels.APPLIED_ENV: "pinned",
              kernels.SET_ENV: "ATEN_CPU_CAPABILITY,MKL_CBWR", kernels.USER_ENV: json.dumps({"MKL_CBWR": "AUTO"})}
    child, _ = probe("hardware.cpu_kernels=native", env=parent)
    assert child["env"]["ATEN_CPU_CAPABILITY"] is None and child["env"]["MKL_CBWR"] == "AUTO"


def test_the_composed_config_must_match_what_was_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    from reprotune.errors import ReprotuneError

    monkeypatch.setenv(kernels.APPLIED_ENV, "pinned")
    assert kernels.check_mode("pinned") is None
    with pytest.raises(ReprotuneError, match="hardware.cpu_kernels: the config says 'native'.*pass "
                                             "hardware.cpu_kernels=native"):
        kernels.check_mode("native")
    with pytest.raises(ReprotuneError, match="must be one of pinned, native, not 'fast'"):
        kernels.check_mode("fast")
    monkeypatch.delenv(kernels.APPLIED_ENV)
    assert "torch was imported before reprotune" in kernels.check_mode("pinned")
    assert kernels.thread_count(None, "pinned") == kernels.PINNED_THREADS
    assert kernels.thread_count(None, "native") is None and kernels.thread_count(3, "pinned") == 3
