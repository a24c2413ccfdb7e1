"""PEFT's trainable tokens on a tied head, as TRL's fused LM head reads it.

model.lora_trainable_tokens (Gemma 3 270M: <end_of_turn>, whose row the pretrained base never learnt) trains those
embedding rows with the adapter: PEFT wraps the embedding and, the head being tied, the head in a
TrainableTokensWrapper whose forward uses the rows with the trained values. TRL 1.16's SFTTrainer does not call the
head's forward: its fused LM head (trl.trainer.utils.add_fused_lm_head) reads `lm_head.weight` and `lm_head.bias`
and computes the log-probabilities in chunks. Through the wrapper `weight` is the frozen base weight (the trained
rows would get no gradient from the head, the very rows that must learn to score the stop token) and `bias` does
not exist (AttributeError). While `merged_head_view` is active the wrapped head answers `weight` with PEFT's own
merged weights (TrainableTokensLayer.get_merged_weights: the base weight with the trained rows copied in,
differentiable in them) and `bias` with the base layer's, so the fused head computes what the wrapper's forward
computes. The class is given back on exit: saving, merging and evaluation see PEFT's modules unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


def _merged_view_class(cls: type) -> type:
    class MergedHeadView(cls):  # type: ignore[misc, valid-type]
        @property
        def weight(self):
            layer = self.token_adapter
            if self.disable_adapters or not layer.active_adapters:
                return layer.base_layer.weight
            return layer.get_merged_weights(layer.active_adapters)

        @property
        def bias(self):
            return self.token_adapter.base_layer.bias

    MergedHeadView.__name__ = cls.__name__
    return MergedHeadView


@contextlib.contextmanager
def merged_head_view(model: Any) -> Iterator[bool]:
    """While active, a head wrapped by PEFT's trainable tokens shows its merged weights (see the module docstring);
    yields whether there was such a head."""
    from peft.utils.other import TrainableTokensWrapper

    head = model.get_output_embeddings()
    if not isinstance(head, TrainableTokensWrapper):
        yield False
        return
    original = type(head)
    head.__class__ = _merged_view_class(original)
    try:
        yield True
    finally:
        head.__class__ = original
