"""The Ollama Modelfile pieces (reprotune.modelfile) from the presets' real chat templates (TRL's shipped copies):
the Go template reassembles exactly what the HF template renders, the stops hold the template's end-of-turn token,
Gemma 3's system message folded into the first user turn is reassembled too, and the templates that are not fixed
per-role wrapping (Qwen3's think logic) are refused with modelfile's one line (issue #25: the Modelfile's template and stops per architecture)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trl

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.modelfile import assemble, go_template, probe, stop_tokens
from reprotune.models import resolve_model_dir

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
# the special tokens each template's model has (SmolLM2's tokenizer has ChatML's only)
SPECIAL = {"llama3": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"],
           "llama3_2": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|begin_of_text|>"],
           "qwen2_5": [], "gemma3": ["<start_of_turn>", "<end_of_turn>"]}
END_OF_TURN = {"llama3": "<|eot_id|>", "llama3_2": "<|eot_id|>", "qwen2_5": "<|im_end|>", "gemma3": "<end_of_turn>"}
CONVERSATIONS = [
    [{"role": "user", "content": "Invoice INV-7 from Acme, total 12.50 EUR."}],
    [{"role": "system", "content": "You answer in JSON."}, {"role": "user", "content": "Total?"},
     {"role": "assistant", "content": "{\"total\": 12.5}"}, {"role": "user", "content": "Currency?"}],
]


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    cfg = compose(["model=tiny_random"])
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(cfg.model, cfg.paths.model_cache))
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL.get(name, [])})
    tokenizer.chat_template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
    return tokenizer


@pytest.mark.parametrize("name", ["llama3", "llama3_2", "qwen2_5", "gemma3"])
def test_real_template_pieces_reassemble_the_hf_rendering_and_stop_at_end_of_turn(name: str) -> None:
    tokenizer = _tokenizer(name)
    pieces = probe(tokenizer)
    for conversation in CONVERSATIONS:
        hf = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert assemble(pieces, conversation, generation=True) == hf, name
    stops = stop_tokens(tokenizer, pieces, [tokenizer.eos_token_id])
    assert END_OF_TURN[name] in stops and END_OF_TURN[name] in pieces.assistant_end
    template = go_template(pieces)
    assert pieces.assistant_begin.strip() in template.replace("\\n", "\n")
    assert pieces.system_in_first_user == (name == "gemma3")  # Gemma 3: the system message opens the user turn


@pytest.mark.parametrize(("name", "why"), [("qwen3", "role logic beyond fixed wrapping")])
def test_templates_that_are_not_fixed_wrapping_are_refused_with_one_line(name: str, why: str) -> None:
    with pytest.raises(ReprotuneError, match=f"{why}; write the Ollama TEMPLATE by hand") as err:
        probe(_tokenizer(name))
    assert "\n" not in str(err.value)
