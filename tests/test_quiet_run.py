"""A default run says nothing a user cannot act on: no FutureWarning or DeprecationWarning from the kit's own
calls, and no advice to install what the lock does not have (bitsandbytes' "pip install kernels")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

# "<file>:<line>: <Category>: <message>", how the warnings module prints
WARNING_LINE = re.compile(r"^(?P<file>\S+?\.py):\d+: (?P<category>\w+Warning): (?P<message>.*)$")


def run_default_tiny_train(root: Path) -> str:
    """python -m reprotune.train as 'make train' runs it, with DeprecationWarnings shown from every module
    (Python hides them outside __main__), so the kit's own deprecated calls in any module would print."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONWARNINGS": "default::DeprecationWarning"}
    cmd = [sys.executable, "-m", "reprotune.train", "model=tiny_random", "train.max_steps=2", "train.save_steps=2",
           f"paths.root={root}"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow  # a full training or NER pass: the full lane (make test-all, CI); make test stays <= 3 min
def test_default_tiny_run_prints_no_deprecation_and_no_install_advice(workspace: tuple[Path, list[str]]) -> None:
    root, _ = workspace
    out = run_default_tiny_train(root)
    warnings = [m.groupdict() for m in map(WARNING_LINE.match, out.splitlines()) if m]
    future = [w for w in warnings if w["category"] == "FutureWarning"]  # printed to every user by default
    own = [w for w in warnings if w["category"] in ("DeprecationWarning", "FutureWarning")
           and Path(w["file"]).resolve().is_relative_to(REPO / "src")]
    assert not future, f"FutureWarnings in a default run: {future}"
    assert not own, f"the kit's own deprecated calls: {own}"
    assert "pip install" not in out, [line for line in out.splitlines() if "pip install" in line]
    assert "adapter " in out and "final loss" in out  # the run itself finished and said so
