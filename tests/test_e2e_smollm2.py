"""End to end on the built-in SmolLM2 (slow: about a minute of CPU training, shared with the other SmolLM2 tests
through conftest's smollm2_run; runs in CI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.config import compose


@pytest.mark.slow
def test_make_train_style_run_on_smollm2(smollm2_run: tuple[Path, list[str]]) -> None:
    """The run: `python -m reprotune.train` with 12 steps of 2 rows, checkpoints at 6 (conftest.smollm2_run)."""
    root, _ = smollm2_run
    metrics = json.loads((root / "outputs/train/metrics.json").read_text())
    losses = [loss for _, loss in json.loads((root / "outputs/train/loss_curves.json").read_text())["train"]]
    assert metrics["global_step"] == 12
    # the adapter learns: the last steps' loss is well below the first steps'
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    manifest = json.loads((root / "outputs/train/manifest.json").read_text())
    assert manifest["config"]["model"]["name"] == "smollm2_135m"
    assert manifest["inputs"]["base_model"]["files"]["model.safetensors"]

    # the adapter loads on the base with PEFT and answers a holdout invoice with JSON-looking text
    from transformers import AutoTokenizer

    from reprotune.models import load_peft_model

    adapter = root / "outputs/adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"].startswith("builtin:")
    tok = AutoTokenizer.from_pretrained(adapter)
    model = load_peft_model(adapter, compose([]).paths.model_cache)
    row = json.loads((root / "data/prepared/holdout.jsonl").read_text().splitlines()[0])
    enc = tok.apply_chat_template(row["messages"][:-1], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    out = model.generate(**enc, max_new_tokens=80, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert answer.lstrip().startswith("{") and '"supplier"' in answer, answer
