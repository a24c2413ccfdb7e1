"""Every preset is the model it names: the *_random presets build their hub preset's architecture class and
config (no weights: on the meta device or config only), each tiny family builds its class, and a tokenizer the
model cannot embed stops with one line before any model code runs (issue #25)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.models import (
    _random_init_tokenizer,
    check_vocabulary,
    load_base_model,
    load_tokenizer,
    random_init_config,
    resolve_model_dir,
)

from .conftest import write_jsonl
from .families import CLASSES, FAMILIES, family_params

SMOLLM2_IDS = 49152


def _spec(preset: str) -> dict:
    return OmegaConf.to_container(compose([f"model={preset}"]).model.random_init, resolve=True)


@pytest.mark.parametrize("preset", family_params())
def test_tiny_family_builds_its_architecture_class(preset: str, tmp_path: Path) -> None:
    cfg = compose([f"model={preset}", "hardware=cpu", f"paths.root={tmp_path}"])
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    family = next(f for f, p in FAMILIES.items() if p == preset)
    model = load_base_model(model_dir, cfg, "cpu", "float32", None)
    assert type(model).__name__ == CLASSES[family]
    assert model.config.vocab_size == len(load_tokenizer(model_dir, cfg.model)) == SMOLLM2_IDS


@pytest.mark.slow  # full lane: builds the 8B architecture on the meta device
def test_qwen3_8b_random_is_qwen3_8b() -> None:
    """The config the preset builds is conf/model/qwen3_8b.yaml's architecture in Qwen3's own config class."""
    spec = _spec("qwen3_8b_random")
    config = random_init_config(spec, _random_init_tokenizer(spec), "qwen3_8b_random")
    hub = OmegaConf.to_container(compose(["model=qwen3_8b"]).model.architecture, resolve=True)
    assert type(config).__name__ == "Qwen3Config" and config.model_type == "qwen3"
    assert (config.vocab_size, config.head_dim, config.tie_word_embeddings) == (151936, 128, False)
    assert config.rope_parameters["rope_theta"] == 1_000_000 and config.max_position_embeddings == 40960
    assert all(getattr(config, k) == v for k, v in hub.items() if k != "rope_theta")


@pytest.mark.slow  # full lane: builds the 1B architecture on the meta device
def test_llama32_1b_random_has_llama3_rope_scaling_and_a_tied_head() -> None:
    spec = _spec("llama32_1b_random")
    config = random_init_config(spec, _random_init_tokenizer(spec), "llama32_1b_random")
    assert type(config).__name__ == "LlamaConfig" and config.vocab_size == 128256 and config.tie_word_embeddings
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["rope_theta"]) == ("llama3", 32.0, 500000.0)
    assert rope["original_max_position_embeddings"] == 8192


@pytest.mark.slow  # a full training or NER pass: the full lane (make test-all, CI); make test stays <= 3 min
def test_mistral_vocabulary_smaller_than_the_tokenizer_is_one_line(tmp_path: Path) -> None:
    """Mistral-7B's 32,768-row embedding with SmolLM2's 49,152 ids: a CUDA device-side assert on a GPU, one line
    naming the preset and both sizes here, from `python -m reprotune.train`, before any model is built."""
    from reprotune.invoices import generate

    write_jsonl(tmp_path / "data/prepared/train.jsonl", generate(4, seed=1))
    proc = subprocess.run([sys.executable, "-m", "reprotune.train", "model=mistral_7b_random", "hardware=cpu",
                           f"paths.root={tmp_path}"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "REPROTUNE_CACHE": str(tmp_path / "cache")})
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "'mistral_7b_random'" in last and "49,152 ids" in last and "vocab_size is 32,768" in last, last
    assert "Traceback" not in proc.stderr
    assert not list((tmp_path / "cache").glob("random-*")), "nothing is built"


def test_a_local_model_whose_embedding_is_too_small_stops_before_loading(tmp_path: Path) -> None:
    """source=local: config.json's vocab_size against the tokenizer, in load_tokenizer (prepare, train)."""
    cfg = compose(["model=tiny_random", "hardware=cpu", f"paths.root={tmp_path}"])
    local = tmp_path / "local-model"
    shutil.copytree(resolve_model_dir(cfg.model, cfg.paths.model_cache), local)
    conf = json.loads((local / "config.json").read_text())
    conf["vocab_size"] = 32000
    (local / "config.json").write_text(json.dumps(conf))
    model_cfg = compose(["model=tiny_random", "model.source=local", f"model.path={local}"]).model
    with pytest.raises(ReprotuneError, match=r"model 'tiny_random': the tokenizer has 49,152 ids .* vocab_size is "
                                             r"32,000"):
        load_tokenizer(local, model_cfg)
    assert load_tokenizer(local, None).pad_token is not None  # an adapter/merged dir: no base to check against


@pytest.mark.slow  # full lane: builds a tokenizer folder and the stage in its own process
def test_a_tokenizer_without_eos_is_one_line(tmp_path: Path) -> None:
    spec = _spec("tiny_random")
    tokenizer = _random_init_tokenizer(spec)
    check_vocabulary("tiny_random", tokenizer, SMOLLM2_IDS)  # the real tokenizer passes
    tokenizer.eos_token = None
    with pytest.raises(ReprotuneError, match=r"model 'tiny_random': the tokenizer \(49,152 ids\) has no eos token "
                                             r"\(model vocab_size 49,152\)"):
        check_vocabulary("tiny_random", tokenizer, SMOLLM2_IDS)


@pytest.mark.slow  # full lane: a forward of each family's model
def test_one_id_past_the_embedding_is_caught() -> None:
    tokenizer = _random_init_tokenizer(_spec("tiny_random"))
    with pytest.raises(ReprotuneError, match="highest 49,151"):
        check_vocabulary("x", tokenizer, SMOLLM2_IDS - 1)


def test_make_plan_warns_of_the_mistral_vocabulary(tmp_path: Path) -> None:
    from reprotune.sizing import report as sz_report

    out = sz_report.make_plan(compose(["model=mistral_7b_random", f"paths.root={tmp_path}"]))
    assert any("49,152 ids but the model's vocab_size is 32,768: make train stops" in w for w in out["warnings"])
    assert out["model"]["parameters"] == 7_248_023_552  # MistralForCausalLM on the meta device says the same
    qwen = sz_report.make_plan(compose(["model=qwen3_8b_random", f"paths.root={tmp_path}"]))
    assert not any("make train stops" in w for w in qwen["warnings"])
