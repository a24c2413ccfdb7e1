"""FLOPs of a LoRA/QLoRA training step, per token, from a model's shape: what the planner's throughput and memory
models (reprotune.sizing) predict with and what the train stage's MFU is measured against (reprotune.speed).
Pure arithmetic on any object with transformers' config attributes; no project import, no torch."""

from __future__ import annotations

import math
from typing import Any, Protocol

# bf16 dense matrix rate measured on the lent H200s (8192^3 products, random data): the MFU denominator
H200_BF16_FLOPS = 790e12


class Checkpointing(Protocol):
    """What recomputed_share reads of a run's settings (reprotune.run_settings.RunSettings has both)."""
    activation_checkpointing: bool
    checkpoint_every_n_layers: int


def matmul_flops_per_token(model_config: Any) -> float:
    """Forward FLOPs of the dense layers per token (2 x the weights every token passes through; embedding
    lookups are free)."""
    c = model_config
    h, i, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * (h // c.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i  # q, o; k, v; gate, up, down
    return 2.0 * (layers * per_layer + h * c.vocab_size)


def attention_flops_per_token(model_config: Any, mean_context: float) -> float:
    """Forward FLOPs of causal attention per token for examples of mean length `mean_context` (QK^T and PV)."""
    c = model_config
    return 2.0 * 2.0 * c.num_hidden_layers * c.hidden_size * mean_context / 2.0


def checkpointed_layers(layers: int, every: int) -> int:
    """Decoder layers recomputed in the backward: transformers checkpoints layers 0, n, 2n, ..."""
    return math.ceil(layers / max(1, every))


def recomputed_share(model_config: Any, fast: Checkpointing) -> float:
    """The share of decoder layers recomputed in the backward."""
    if not fast.activation_checkpointing:
        return 0.0
    layers = model_config.num_hidden_layers
    return checkpointed_layers(layers, fast.checkpoint_every_n_layers) / layers


def mlp_flops_per_token(model_config: Any) -> float:
    """Forward FLOPs of the decoder layers' MLPs per token (gate, up, down)."""
    c = model_config
    return 2.0 * c.num_hidden_layers * 3 * c.hidden_size * c.intermediate_size


def lora_step_flops_per_token(model_config: Any, mean_example_tokens: float, recompute: float,
                              tiled_mlp: bool = False) -> float:
    """FLOPs per token of a LoRA/QLoRA training step on a frozen base: forward, the input-gradient half of the
    backward (frozen weights need no weight gradient), attention backward ~2x its forward, one more forward
    for the recomputed share of the layers, and with the tiled MLP (reprotune.tiled_mlp) one more MLP forward in
    every layer's backward. The adapters' own FLOPs (rank 16) are under 1% and left out."""
    dense = matmul_flops_per_token(model_config)
    attn = attention_flops_per_token(model_config, mean_example_tokens)
    tiles = mlp_flops_per_token(model_config) if tiled_mlp else 0.0
    return (2 + float(recompute)) * dense + (3 + float(recompute)) * attn + tiles


def mfu(tokens_per_second: float, flops_per_token: float, peak: float = H200_BF16_FLOPS) -> float:
    return tokens_per_second * flops_per_token / peak
