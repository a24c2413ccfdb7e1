"""llama.cpp's vocabulary warnings that fail `make gguf`, and the one exception a preset may name: the
control-looking-token warning for exactly one (id, text) token (Gemma 3's '</s>', 212, which llama.cpp makes an
end-of-generation control token by its spelling), checked against the HF tokenizer. No llama.cpp needed: the
lines are llama.cpp's own format (src/llama-vocab.cpp's LLAMA_LOG_WARN with %6d)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from reprotune import llamacpp
from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.gguf_build import accepted_control_tokens
from reprotune.models import load_tokenizer, resolve_model_dir


def _control_looking(token_id: int, text: str) -> tuple[int, str]:
    return (llamacpp.WARN, f"load: control-looking token: {token_id:6d} '{text}' was not control-type; this is "
                           "probably a bug in the model. its type will be overridden\n")


GEMMA_212 = _control_looking(212, "</s>")
DEGRADED = (llamacpp.WARN, "load: missing pre-tokenizer type, using: 'default'\n")


def test_control_looking_warnings_fail_unless_that_exact_token_is_accepted() -> None:
    assert llamacpp.degrading_warnings([GEMMA_212]) == [GEMMA_212[1].strip()]
    accepted = frozenset({(212, "</s>")})
    assert llamacpp.degrading_warnings([GEMMA_212], accepted) == []
    for other in (_control_looking(213, "</s>"), _control_looking(212, "<|im_end|>")):
        assert llamacpp.degrading_warnings([other], accepted) == [other[1].strip()], other
    assert llamacpp.degrading_warnings([GEMMA_212, DEGRADED], accepted) == [DEGRADED[1].strip()]


def test_gemma3_270m_accepts_only_its_closing_s_tag() -> None:
    tokens = OmegaConf.to_container(compose(["model=gemma3_270m"]).model.llama_cpp_control_tokens)
    assert tokens == [{"id": 212, "text": "</s>"}]


def test_an_accepted_token_is_checked_against_the_tokenizer(tmp_path: Path) -> None:
    cfg = compose(["model=tiny_random", "hardware=cpu", f"paths.root={tmp_path}"])
    tokenizer = load_tokenizer(resolve_model_dir(cfg.model, cfg.paths.model_cache), cfg.model)
    real = tokenizer.convert_ids_to_tokens(2)
    OmegaConf.update(cfg, "model.llama_cpp_control_tokens", [{"id": 2, "text": real}], force_add=True)
    assert accepted_control_tokens(cfg.model, tokenizer) == frozenset({(2, real)})
    OmegaConf.update(cfg, "model.llama_cpp_control_tokens", [{"id": 2, "text": "</s>"}], force_add=True)
    with pytest.raises(ReprotuneError, match=rf"^model 'tiny_random': model.llama_cpp_control_tokens: id 2 is "
                                             rf"'{real}' in the tokenizer, not '</s>'$"):
        accepted_control_tokens(cfg.model, tokenizer)
