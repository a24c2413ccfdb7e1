"""The lock: hash-pinned, in agreement with pyproject.toml, with the right torch build per variant."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

sys.path.insert(0, str(Path("scripts").resolve()))
from pyproject_digest import dependency_digest  # noqa: E402

PIN = re.compile(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", re.MULTILINE)


def pins(lock: Path) -> dict[str, str]:
    return {canonicalize_name(n): v for n, v in PIN.findall(lock.read_text())}


@pytest.mark.parametrize("variant", ["cpu", "cuda"])
def test_lock_matches_pyproject(variant: str) -> None:
    lock = Path(f"lockfiles/{variant}.txt")
    text = lock.read_text()
    recorded = re.search(r"^# pyproject-deps-sha256: ([0-9a-f]{64})$", text, re.MULTILINE)
    assert recorded, f"{lock} has no pyproject digest header"
    assert recorded.group(1) == dependency_digest(Path("pyproject.toml")), \
        f"pyproject.toml changed since {lock} was generated: run 'make lock'"
    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    locked = pins(lock)
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in locked, f"{req.name} is in pyproject.toml but not in {lock}"
        assert Version(locked[name]) in req.specifier or req.specifier.contains(
            Version(locked[name]).public), f"{lock}: {req.name}=={locked[name]} violates '{spec}'"


@pytest.mark.parametrize("variant", ["cpu", "cuda", "builtin-model"])
def test_every_pin_has_a_hash(variant: str) -> None:
    blocks = re.split(r"\n(?=[A-Za-z0-9])", Path(f"lockfiles/{variant}.txt").read_text())
    reqs = [b for b in blocks if PIN.match(b)]
    assert reqs
    for block in reqs:
        assert "--hash=sha256:" in block, f"no hash for {block.splitlines()[0]}"


def test_torch_builds() -> None:
    assert pins(Path("lockfiles/cpu.txt"))["torch"] == "2.13.0+cpu"
    assert pins(Path("lockfiles/cuda.txt"))["torch"] == "2.13.0"
    assert "nvidia-cudnn-cu13" in pins(Path("lockfiles/cuda.txt"))
    assert "bitsandbytes" in pins(Path("lockfiles/cpu.txt"))
    # the GPU fast path's fused kernels are locked for CUDA only (they need Triton, which the CPU build lacks)
    assert "liger-kernel" in pins(Path("lockfiles/cuda.txt")) and "liger-kernel" not in pins(Path("lockfiles/cpu.txt"))
    # no local paths leak into a lock users will install from
    for variant in ("cpu", "cuda", "builtin-model"):
        text = Path(f"lockfiles/{variant}.txt").read_text()
        assert "/opt/" not in text and "file://" not in text and "/tmp/" not in text


def test_installed_environment_is_the_lock() -> None:
    """The running venv holds exactly the locked versions (bootstrap used --require-hashes)."""
    from importlib import metadata

    locked = pins(Path("lockfiles/cpu.txt"))
    for name in ("torch", "transformers", "peft", "trl", "hydra-core", "dvc", "bitsandbytes"):
        assert metadata.version(name) == locked[canonicalize_name(name)]


def test_bootstrap_reuses_a_current_venv() -> None:
    out = subprocess.run(["bash", "scripts/bootstrap.sh"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, VARIANT="cpu"))
    assert out.returncode == 0, out.stderr
    assert "building" not in out.stderr  # stamp matched: nothing reinstalled
