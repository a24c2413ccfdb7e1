"""Per architecture family (tiny Llama, Qwen3, Mistral, Gemma 3): train a few steps, then `make merge`'s merge
(base + adapter in float32 against the merged model, and the saved bf16 file) must hold its parity, with an
adapter that really moves the logits (issue #25). The export lane: each family trains and merges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.config import compose

from .export_pipeline import EXPORT_ARGS, EXPORT_TRAIN
from .families import CLASSES, family_params


@pytest.mark.slow  # trains and merges one tiny model per family
@pytest.mark.parametrize("preset", family_params())
def test_merge_parity_per_family(preset: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    from reprotune.invoices import generate
    from reprotune.merge import merge
    from reprotune.train import train

    from .conftest import write_jsonl

    rows = generate(24, seed=7)
    write_jsonl(tmp_path / "data/prepared/train.jsonl", rows[:20])
    write_jsonl(tmp_path / "data/prepared/holdout.jsonl", rows[20:])
    cfg = compose([*EXPORT_TRAIN, *EXPORT_ARGS, f"paths.root={tmp_path}", f"model={preset}"])
    train(cfg)
    adapter = json.loads((tmp_path / "outputs/adapter/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"].startswith(f"random_init:{preset}@")
    merge(cfg)
    parity = json.loads((tmp_path / "outputs/merged/parity.json").read_text())
    fp32, saved, effect = parity["fp32_merge"], parity["saved"], parity["adapter_effect"]
    assert fp32["passed"] and fp32["max_abs_diff"] <= 1e-3 and fp32["positions"] > 50
    assert effect["max_abs_diff"] > 20 * fp32["max_abs_diff"], "the adapter must move the logits"
    assert saved["passed"] and saved["top1_agreement"] >= 0.98
    merged = json.loads((tmp_path / "outputs/merged/config.json").read_text())
    assert merged["architectures"] == [CLASSES[request.node.callspec.id]]  # still the family's class
