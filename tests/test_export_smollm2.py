"""End to end on the built-in SmolLM2 with a short-trained adapter (conftest's shared smollm2_run, 12 steps):
merge -> GGUF (F16, Q4_K_M) -> parity. Greedy parity on a random tiny model says little; on a real model the F16
GGUF must answer like HF."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.config import compose

from .conftest import copy_run


@pytest.mark.slow
def test_smollm2_export_answers_like_the_hf_model(smollm2_run: tuple[Path, list[str]], tmp_path: Path) -> None:
    from reprotune.gguf import gguf
    from reprotune.merge import merge

    root, overrides = copy_run(smollm2_run, tmp_path / "run")  # merge and gguf write under paths.root
    overrides = [*overrides, "export.merge.prompts=2", "export.parity.examples=4", "export.parity.max_new_tokens=64",
                 "export.quant=[Q4_K_M]"]  # the recipe this test is about (the default is auto's ladder)
    merge_parity = merge(compose(overrides))["parity"]
    assert merge_parity["fp32_merge"]["max_abs_diff"] <= 1e-3
    assert merge_parity["saved"]["top1_agreement"] >= 0.98

    gguf(compose(overrides))
    report = json.loads((root / "outputs/gguf/parity.json").read_text())
    assert report["tokenization"]["F16"]["identical"] and report["tokenization"]["Q4_K_M"]["identical"]
    assert report["tokenization"]["F16"]["prompts"] == 8
    # F16 holds the bf16 merged weights exactly: greedy answers must be the HF model's
    assert report["greedy"]["F16"]["exact_match_rate"] == 1.0, report["greedy"]["F16"]
    assert report["greedy"]["Q4_K_M"]["token_prefix_agreement"] > 0.3
    # SmolLM2's 576-wide rows are not a multiple of 256: most of "Q4_K_M" falls back to Q5_0
    mix = report["type_mix"]["Q4_K_M"]
    assert "Q5_0" in mix and mix["Q5_0"]["tensors"] > mix.get("Q4_K", {"tensors": 0})["tensors"]
    assert all(report["hf_outputs"]) and all(report["gguf_outputs"]["F16"])  # real answers, not empty
