"""CPU kernel pinning (reprotune/kernels.py): read from the command line or the config file before torch loads,
applied in fresh processes as the stages start, a user's own setting overridden with one line, native mode giving
it back, and the composed config checked against what was pinned."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune import kernels
from reprotune.config import dump_params

from .conftest import REPO

PROBE = ("import reprotune, torch, os, json; print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(),"
         " 'env': {k: os.environ.get(k) for k in ('ATEN_CPU_CAPABILITY', 'MKL_CBWR', 'OMP_WAIT_POLICY',"
         " 'REPROTUNE_CPU_KERNELS')}}))")


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


@pytest.mark.slow  # full lane: stages in their own processes
def test_a_users_level_is_overridden_with_one_line_and_native_gives_it_back() -> None:
    pinned, err = probe(env={"ATEN_CPU_CAPABILITY": "default"})
    level = kernels.pinned_env()["ATEN_CPU_CAPABILITY"]
    assert pinned["capability"] == level.upper()  # forced below the user's (and the CPU's) level, to the pinned one
    assert pinned["env"]["ATEN_CPU_CAPABILITY"] == kernels.pinned_env()["ATEN_CPU_CAPABILITY"]
    assert err.count("reprotune: ATEN_CPU_CAPABILITY=default overridden to") == 1
    if platform.machine().lower() in ("x86_64", "amd64"):  # the route's sgemm threads beside torch's OpenMP ones
        assert pinned["env"]["OMP_WAIT_POLICY"] == "PASSIVE"
    native, err = probe("hardware.cpu_kernels=native", env={"ATEN_CPU_CAPABILITY": "default"})
    assert native["capability"] == "DEFAULT" and native["env"]["MKL_CBWR"] is None and "overridden" not in err
    assert native["env"]["OMP_WAIT_POLICY"] is None  # native keeps OpenMP's own waiting
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


ROUTE_PROBE = """
import json, sys
import reprotune, torch
from reprotune import cpu_blas, kernels
kernels.route_matmul(kernels.os.environ["REPROTUNE_CPU_KERNELS"])
a, b = torch.randn(200, 300), torch.randn(300, 100)
torch.mm(a, b)
print(json.dumps({"calls": cpu_blas.calls(), "matmul": kernels.kernel_state()["matmul"]}))
"""


@pytest.mark.skipif(kernels.MATMUL.get(platform.machine().lower()) != "openblas",
                    reason="the OpenBLAS route is the x86-64 pinned path")
@pytest.mark.slow  # full lane: products in their own processes per mode
def test_pinned_mode_runs_float32_products_on_openblas_and_native_does_not() -> None:
    """Pinned: torch.mm, nn.Linear forward and backward, addmm (bias, LoRA's fused scale), addmm_ and mm(out=) go
    through OpenBLAS's pinned core (the route counts its sgemm calls, and torch.mm's bytes are a direct sgemm's);
    other dtypes stay torch's; native mode installs nothing (its products are MKL's)."""
    import torch

    from reprotune import cpu_blas

    state = kernels.route_matmul("pinned")
    assert state is not None and state["library"] == "openblas" and state["core"] == "Haswell", state
    assert kernels.kernel_state()["matmul"] == state
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(100, 1000, generator=gen), torch.randn(1000, 120, generator=gen)
    before = cpu_blas.calls()
    got = torch.mm(a, b)
    assert cpu_blas.calls() > before
    direct = torch.empty(100, 120)
    cpu_blas._state["blas"].sgemm(b"N", b"N", 120, 100, 1000, 1.0, b.data_ptr(), 120, a.data_ptr(), 1000, 0.0,
                                  direct.data_ptr(), 120)  # one call, no pieces: this shape is cut in none
    assert len(cpu_blas.pieces(100, 120, 1000)[1]) == 1
    assert torch.equal(got, direct)
    for name, run in [("linear forward and backward", lambda: _linear_step(gen)),
                      ("addmm", lambda: torch.addmm(torch.randn(120), a, b, alpha=0.5)),
                      ("addmm_", lambda: torch.zeros(100, 120).addmm_(a, b)),
                      ("mm(out=)", lambda: torch.mm(a, b, out=torch.empty(0)))]:
        before = cpu_blas.calls()
        run()
        assert cpu_blas.calls() > before, name
    before = cpu_blas.calls()
    assert torch.mm(a.double(), b.double()).dtype == torch.float64 and cpu_blas.calls() == before
    native, _ = _route_probe("hardware.cpu_kernels=native")
    assert native == {"calls": 0, "matmul": {"library": "mkl"}}
    pinned, _ = _route_probe()
    assert pinned["calls"] > 0 and pinned["matmul"]["library"] == "openblas"


def _linear_step(gen: object) -> None:
    import torch

    layer = torch.nn.Linear(64, 32)
    x = torch.randn(4, 7, 64, requires_grad=True, generator=gen)
    layer(x).square().sum().backward()


def _route_probe(*argv: str) -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items() if k not in kernels._all_pinned_names()
             and not k.startswith("REPROTUNE_C") and k != kernels.USER_ENV}
    code = f"import sys; sys.argv = ['stage', *{list(argv)!r}]; {ROUTE_PROBE}"
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(REPO / "src")},
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_the_openblas_route_gives_the_same_bytes_at_any_thread_count() -> None:
    """Products big enough to be cut into pieces (the LM head's, an MLP's) and small ones: equal bytes with 1, 2, 3
    and 4 threads (OpenBLAS's own threading gave a different result per thread count), the cut a function of the
    shape only."""
    import torch

    from reprotune import cpu_blas

    if kernels.route_matmul("pinned") is None:
        pytest.skip("no OpenBLAS route on this architecture")
    gen = torch.Generator().manual_seed(1)
    shapes = [(502, 1536, 576), (16, 502, 576), (300, 576, 4096), (7, 33, 5)]
    operands = [(torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)) for m, k, n in shapes]
    assert len(cpu_blas.pieces(300, 4096, 576)[1]) > 1  # the LM-head-like product is cut
    threads = torch.get_num_threads()
    results = {}
    try:
        for count in (1, 2, 3, 4):
            torch.set_num_threads(count)
            results[count] = [torch.mm(a, b) for a, b in operands] + [torch.mm(b.t(), a.t()) for a, b in operands]
    finally:
        torch.set_num_threads(threads)
    for count in (2, 3, 4):
        assert all(torch.equal(x, y) for x, y in zip(results[1], results[count], strict=True)), count
