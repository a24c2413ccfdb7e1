"""Which CPU kernels the math runs on: pinned to one instruction-set level on every host, before torch loads.

torch picks its CPU kernels (ATen's vectorised ops), MKL its BLAS code path and oneDNN its JIT level from the
CPU it finds, once, when they load: an AVX-512 host then sums in another order than an AVX2 one and the adapter
bytes differ (the losses agree to every printed digit, the bytes do not). `hardware.cpu_kernels=pinned` (the
default) fixes all three to a level every supported CPU of the architecture has, and on x86-64 runs the float32
matrix products on OpenBLAS's pinned Haswell kernels instead of MKL (`route_matmul`, reprotune.cpu_blas: MKL is
equal on Intel and AMD only in its slow COMPATIBLE branch); `native` leaves them to the host (host-dependent
bytes). The environment variables are read when torch is imported, so Hydra cannot set them: `reprotune/__init__.py` calls `pin_before_torch(sys.argv)` first thing, reading the setting from
the command line or from the `--config-dir/--config-name` file that DVC and `make verify` pass. Children
(torchrun's workers, a test's subprocesses, DVC's stages) inherit the environment and pin again themselves.

A user's own ATEN_CPU_CAPABILITY (or MKL/oneDNN setting) is overridden in pinned mode, with one line on stderr
saying so; the value is kept in REPROTUNE_USER_CPU_ENV so that `native` can give it back and the manifest can
record it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from reprotune.schema import CPU_KERNEL_MODES as MODES  # the one list of the modes (pure, imports nothing)

DEFAULT_MODE = "pinned"
KEY = "hardware.cpu_kernels"
USER_ENV = "REPROTUNE_USER_CPU_ENV"  # JSON: the user's own values of the variables pinned below
APPLIED_ENV = "REPROTUNE_CPU_KERNELS"  # the mode this process tree was pinned with (read back by the manifest)
SET_ENV = "REPROTUNE_CPU_ENV_SET"  # the variables pinned mode set (a native child gives back only those)

# Per architecture, the variables and the level every CPU the kit supports has.
#   ATEN_CPU_CAPABILITY: torch's own vectorised kernels (x86-64: default|avx2|avx512; aarch64: default|sve256).
#   MKL_CBWR: MKL's code branch. Only COMPATIBLE gives the same results on Intel and AMD CPUs (MKL's AVX2 branch
#     is Intel-only: on an AMD CPU MKL takes its own path, and the bytes differ from an Intel AVX2 run);
#     it also fixes MKL's cache-size blocking and reduction order.
#   MKL_ENABLE_INSTRUCTIONS: no AVX-512/AMX code in MKL outside CBWR's reach (e.g. its JIT gemm).
#   ONEDNN_MAX_CPU_ISA: oneDNN's JIT level (convolutions, some matmuls, bf16 paths).
#   OPENBLAS_CORETYPE: OpenBLAS's kernel set and blocking. On x86-64 the float32 matrix products run on it
#     (numpy's bundled OpenBLAS, MATMUL below); on aarch64 torch's own BLAS is OpenBLAS.
#   OMP_WAIT_POLICY: not a level, a speed setting (the bytes do not depend on it). The route's matrix-product
#     pieces run on threads of its own beside torch's OpenMP threads, which by default spin for a while after each
#     parallel region and so took a core from the pieces: on 2 cores the products ran at half speed inside
#     training (bench/train_probe.py --cpu-profile; docs/measurements/2026-12-07-cpu-pinned-2-threads.md).
#     PASSIVE makes them sleep at once.
PINNED: dict[str, dict[str, str]] = {
    "x86_64": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
               "ONEDNN_MAX_CPU_ISA": "AVX2", "OPENBLAS_CORETYPE": "Haswell", "OMP_WAIT_POLICY": "PASSIVE"},
    "aarch64": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "ASIMD", "OPENBLAS_CORETYPE": "ARMV8"},
}
# MKL's reproducible branches hold for a fixed thread count only (its work split follows the threads: 1 and 2
# threads give different adapter bytes on the same CPU), so pinned mode also fixes torch's (and MKL's) threads
# of a CPU run when hardware.num_threads does not: 2, which every supported host has; OMP_NUM_THREADS does not
# change it.
PINNED_THREADS = 2
PINNED["amd64"] = PINNED["x86_64"]
PINNED["arm64"] = PINNED["aarch64"]
# Where pinned mode's float32 CPU matrix products (aten::mm, addmm) run, per architecture: "openblas" is numpy's
# bundled OpenBLAS at OPENBLAS_CORETYPE, single-threaded calls in pieces fixed by the shape (reprotune.cpu_blas:
# MKL's COMPATIBLE branch, the only MKL setting equal on Intel and AMD, ran them as SSE2 code: the built-in model
# trained at 0.37x native on an idle 2-core Xeon, issue #51). Elsewhere torch's own BLAS, pinned by the variables
# above.
MATMUL: dict[str, str] = {"x86_64": "openblas", "amd64": "openblas"}
# REPROTUNE_CPU_MATMUL=torch keeps pinned mode's products on torch's BLAS (MKL COMPATIBLE: the kit's pinned path
# before the route, other bytes, slower); for comparisons (bench/cpu_kernels.py). Recorded in the manifest.
MATMUL_ENV = "REPROTUNE_CPU_MATMUL"


def pinned_env(machine: str | None = None) -> dict[str, str]:
    """The variables pinned mode sets on this architecture ({} on one the kit has no level for)."""
    return dict(PINNED.get((machine or platform.machine()).lower(), {}))


def _all_pinned_names() -> set[str]:
    return {name for env in PINNED.values() for name in env}


def config_file(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(--config-dir, --config-name, the other arguments) of a Hydra command line (-cd/-cn, `=` forms too)."""
    found: dict[str, str] = {}
    rest: list[str] = []
    flags = {"--config-dir": "dir", "-cd": "dir", "--config-name": "name", "-cn": "name"}
    args = iter(argv)
    for arg in args:
        flag, sep, value = arg.partition("=")
        if flag in flags:
            found[flags[flag]] = value if sep else next(args, "")
        else:
            rest.append(arg)
    return found.get("dir"), found.get("name"), rest


def _mode_from_config_file(argv: list[str]) -> str | None:
    """hardware.cpu_kernels from the primary config file Hydra is told to load (--config-dir/--config-name)."""
    config_dir, config_name, _ = config_file(argv)
    if not config_name:
        return None
    path = Path(config_dir or ".") / (config_name if config_name.endswith(".yaml") else config_name + ".yaml")
    try:
        import yaml

        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, ValueError, ImportError):
        return None  # Hydra reports a missing or broken file itself, with its own message
    hardware = config.get("hardware") if isinstance(config, dict) else None
    value = hardware.get("cpu_kernels") if isinstance(hardware, dict) else None
    return str(value) if value is not None else None


def mode_from_argv(argv: list[str]) -> str:
    """The hardware.cpu_kernels a stage launched with these arguments will compose (the last override wins);
    without one, the mode the parent process was pinned with (REPROTUNE_CPU_KERNELS: a test run, a launcher),
    else the default."""
    mode = _mode_from_config_file(argv)
    for arg in argv:
        name, sep, value = arg.lstrip("+~").partition("=")
        if sep and name == KEY:
            mode = value.strip("'\"")
    return mode or os.environ.get(APPLIED_ENV) or DEFAULT_MODE


def _torch_loaded() -> bool:
    return "torch" in sys.modules


def pin_before_torch(argv: list[str], stream: Any = None) -> str:
    """Set (pinned) or give back (native) the kernel variables for this process and its children; returns the
    mode. Once torch is loaded its kernels are chosen: then only the record (APPLIED_ENV) is left as it is."""
    stream = stream or sys.stderr
    mode = mode_from_argv(argv)
    if mode not in MODES:
        return mode  # the stage's config check names the bad value (ReprotuneError), with the file and field
    if _torch_loaded():
        return os.environ.get(APPLIED_ENV, "unpinned")
    user = json.loads(os.environ.get(USER_ENV) or "{}")
    if mode == "pinned":
        for name, value in pinned_env().items():
            current = os.environ.get(name)
            if current is not None and current != value and name not in user:
                user[name] = current
                print(f"reprotune: {name}={current} overridden to {value} (hardware.cpu_kernels=pinned: same bytes "
                      f"on every CPU; hardware.cpu_kernels=native keeps yours)", file=stream)
            os.environ[name] = value
        os.environ[SET_ENV] = ",".join(sorted(pinned_env()))
    else:
        ours = set(filter(None, os.environ.pop(SET_ENV, "").split(",")))  # set by a pinned parent, not the user
        for name in _all_pinned_names():
            if name in user:
                os.environ[name] = user[name]
            elif name in ours:
                os.environ.pop(name, None)
    if user:
        os.environ[USER_ENV] = json.dumps(user, sort_keys=True)
    os.environ[APPLIED_ENV] = mode
    return mode


def route_matmul(mode: str, machine: str | None = None) -> dict[str, Any] | None:
    """In pinned mode, send the CPU float32 matrix products to MATMUL's library (after torch is loaded, before the
    math); returns what they run on, or None where they stay torch's (native mode, or an architecture without
    a route)."""
    if mode != "pinned" or MATMUL.get((machine or platform.machine()).lower()) != "openblas":
        return None
    if os.environ.get(MATMUL_ENV, "openblas") == "torch":
        return None
    from reprotune import cpu_blas

    return cpu_blas.install()


def route_matmul_as_pinned() -> dict[str, Any] | None:
    """route_matmul with the mode this process was pinned with (APPLIED_ENV): for the stages that compute without
    set_reproducibility (merge's LoRA products and parity logits, make gguf's HF greedy answers), so every stage's
    float32 products run where its manifest's kernel_state says, in a test's process or a stage's own alike."""
    return route_matmul(os.environ.get(APPLIED_ENV, "unpinned"))


def thread_count(configured: int | None, mode: str) -> int | None:
    """The CPU threads to compute with: hardware.num_threads, else PINNED_THREADS in pinned mode, else torch's."""
    if configured:
        return int(configured)
    return PINNED_THREADS if mode == "pinned" else None


def check_mode(configured: str) -> str | None:
    """The composed hardware.cpu_kernels must be one of MODES and what this process was pinned with; returns a
    warning line when torch was loaded before reprotune (kernels left to the host: the manifest records which)."""
    from reprotune.errors import ReprotuneError

    if configured not in MODES:
        raise ReprotuneError(f"{KEY}: must be one of {', '.join(MODES)}, not {configured!r}")
    applied = os.environ.get(APPLIED_ENV, "unpinned")
    if applied == "unpinned":
        return (f"{KEY}={configured}: torch was imported before reprotune, so the CPU kernels are the host's "
                "(import reprotune first, or run python -m reprotune.<stage>); the manifest records what ran")
    if applied != configured:
        raise ReprotuneError(
            f"{KEY}: the config says {configured!r}, but the CPU kernels were chosen {applied!r} when torch loaded "
            f"(the setting is read from the command line before torch is imported: pass {KEY}={configured} to "
            "python -m reprotune.<stage>)")
    return None


def kernel_state() -> dict[str, Any]:
    """What the math actually runs on (for the manifest): the mode, torch's CPU capability in use, the pinned
    variables as this process sees them, the user's overridden values, the BLAS torch was built with, and what
    the float32 matrix products run on (`matmul`: OpenBLAS's build and core in pinned mode, else torch's BLAS)."""
    import torch

    names = sorted(_all_pinned_names())
    config = torch.__config__.show()
    blas = "mkl" if "BLAS_INFO=mkl" in config else ("openblas" if "openblas" in config.lower() else "other")
    return {"mode": os.environ.get(APPLIED_ENV, "unpinned"),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "env": {name: os.environ.get(name) for name in names},
            "user_env_overridden": json.loads(os.environ.get(USER_ENV) or "{}"),
            "blas": blas, "matmul": _matmul_state(blas), "threads": torch.get_num_threads()}


def _matmul_state(blas: str) -> dict[str, Any]:
    from reprotune import cpu_blas

    state = cpu_blas.state() or {"library": blas}
    if os.environ.get(MATMUL_ENV):
        state[MATMUL_ENV] = os.environ[MATMUL_ENV]
    return state
