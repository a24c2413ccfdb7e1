"""repro=strict on a GPU: two runs of the built-in model give byte-identical adapters.

Skipped without CUDA (this is the H200 check; bench/determinism.py measures what strict costs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: strict GPU determinism is checked on a GPU machine (see docs/reproducibility.md)")]

# The model is the built-in one; a host without it (or a bigger check) names another and extra overrides, e.g.
# REPROTUNE_GPU_TEST_ARGS="model=llama32_1b_random model.random_init.tokenizer_dir=/path/to/tokenizer"
STRICT = [*(os.environ.get("REPROTUNE_GPU_TEST_ARGS", "").split() or ["model=smollm2_135m"]), "hardware=gpu", "repro=strict", "train.max_steps=12", "train.save_steps=100",
          "train.logging_steps=4"]


def train_subprocess(root: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "reprotune.train", *STRICT, f"paths.root={root}"], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((root / "outputs/train/manifest.json").read_text())


def test_strict_gpu_runs_are_byte_identical(tmp_path: Path) -> None:
    from reprotune.invoices import generate

    from .conftest import write_jsonl

    runs = []
    for name in ("a", "b"):
        write_jsonl(tmp_path / name / "data/prepared/train.jsonl", generate(96, seed=5))
        runs.append(train_subprocess(tmp_path / name))
    a, b = runs
    assert a["device"] == "cuda" and a["determinism"]["deterministic_algorithms"] is True
    assert a["determinism"]["cublas_workspace_config"] == ":4096:8"
    # strict keeps the fast path's attention (flex attention on packed rows: deterministic with deterministic
    # algorithms on); eager only for unpacked strict runs (reprotune.runtime.attention)
    want = "flex_attention" if a["run_settings"]["packing"] else "eager"
    assert a["determinism"]["attn_implementation"] == want
    print(f"strict GPU adapters: {a['outputs']['adapter']['sha256']} / {b['outputs']['adapter']['sha256']}")
    assert a["outputs"]["adapter"]["files"] == b["outputs"]["adapter"]["files"]
    assert (tmp_path / "a/outputs/train/metrics.json").read_bytes() == \
        (tmp_path / "b/outputs/train/metrics.json").read_bytes()
