"""The tiny random model of each supported architecture family (conf/model/tiny_random*.yaml), for tests that must
hold per architecture; pytest ids carry the family name (test_x[qwen3])."""

from __future__ import annotations

import pytest

FAMILIES = {"llama": "tiny_random", "qwen3": "tiny_random_qwen3", "mistral": "tiny_random_mistral",
            "gemma3": "tiny_random_gemma3"}
# what each preset must build (the architecture class transformers instantiates)
CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
           "gemma3": "Gemma3ForCausalLM"}


def family_params(fast: tuple[str, ...] | None = None) -> list:
    """pytest.param(preset, id=family) for every family. fast: the families the fast lane (make test) keeps; the
    others are marked slow (make test-all and CI run every family). None: every family in the fast lane."""
    return [pytest.param(preset, id=family, marks=() if fast is None or family in fast else pytest.mark.slow)
            for family, preset in FAMILIES.items()]
