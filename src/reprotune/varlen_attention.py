"""Attention for padding-free packed rows through torch's FlashAttention varlen kernel (`varlen_attention`).

The GPU fast path flattens a micro-batch of packed examples into one sequence (TRL's padding-free collator),
which also hands the model each example's boundaries (`cu_seq_lens_q`, `max_length_q`, computed on the CPU).
`torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, FlashAttention 2 kernels, sm80+) attends within each
example from those boundaries directly: no block mask to build or compile, and grouped-query heads are read as
they are (transformers' flex path repeats K/V to every query head first). On Qwen3-8B's attention shapes it runs
forward + backward in about three quarters of flex attention's time, outputs and gradients equal within bf16
rounding (docs/measurements/2026-12-02-gpu-varlen-attention.md).

Its backward accumulates dQ with atomics unless torch's deterministic algorithms are on; then torch passes
`deterministic` to the kernel, which sums dQ per split in a fixed order (reprotune.runtime.deterministic_kernels
turns them on in the default mode: byte-identical gradients run to run, bench/attention_determinism.py). A batch
without boundaries (an unpacked evaluation batch during training) is
unpadded from its attention mask and goes through the same kernel.
"""

from __future__ import annotations

import importlib.util
import inspect
from functools import cache
from pathlib import Path
from typing import Any

NAME = "varlen_attention"


def available() -> bool:
    """torch ships the varlen kernel (looked up without importing torch: the plan runs on hosts without CUDA)."""
    spec = importlib.util.find_spec("torch")
    return bool(spec and spec.origin and (Path(spec.origin).parent / "nn/attention/varlen.py").is_file())


def register_if_chosen(attn_implementation: str | None) -> None:
    """register() when a stage's attention is this kernel, before its model loads (transformers checks the name
    then). Called by the stages that can choose it (train, and eval when hardware.attn_implementation names it), so
    only their DVC deps hold this GPU kernel, not every stage that loads a tokenizer through reprotune.models."""
    if attn_implementation == NAME:
        register()


def register() -> None:
    """Make `attn_implementation="varlen_attention"` known to transformers (the kernel, and a mask function
    that builds no mask: the boundaries come with the batch)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)


@cache
def _kernel() -> tuple[Any, dict[str, Any]]:
    """varlen_attn, and its grouped-query switch where this torch has one (2.13 asks for enable_gqa=True;
    2.11 takes fewer K/V heads as they are)."""
    from torch.nn.attention.varlen import varlen_attn

    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    return varlen_attn, gqa


def _unpad(mask: Any) -> tuple[Any, Any, int]:
    """Token indices, cumulative lengths and the longest length of a (batch, seq) attention mask (1 = token)."""
    import torch

    lengths = mask.sum(dim=-1, dtype=torch.int32)
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    return torch.nonzero(mask.flatten(), as_tuple=False).flatten(), cu, int(lengths.max())


def varlen_attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                             scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                             cu_seq_lens_q: Any = None, max_length_q: int | None = None,
                             **kwargs: Any) -> tuple[Any, None]:
    """transformers' attention interface: query (batch, heads, seq, dim), key/value (batch, kv_heads, seq, dim)
    -> (batch, seq, heads, dim), no weights."""
    if dropout:
        raise ValueError("varlen_attention: attention dropout is not supported (the fast path trains without it)")
    varlen_attn, gqa = _kernel()
    window = (-1, 0) if not sliding_window else (int(sliding_window) - 1, 0)  # causal, optionally windowed
    batch, heads, seq, dim = query.shape
    q, k, v = (t.transpose(1, 2).reshape(batch * seq, t.shape[1], dim) for t in (query, key, value))
    if cu_seq_lens_q is not None and batch == 1:  # padding-free: the collator's boundaries
        out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, int(max_length_q), int(max_length_q),
                          scale=scaling, window_size=window, **gqa)
        return out.view(batch, seq, heads, dim), None
    if attention_mask is None:  # every row full length
        import torch

        cu = torch.arange(0, (batch + 1) * seq, seq, dtype=torch.int32, device=query.device)
        out = varlen_attn(q, k, v, cu, cu, seq, seq, scale=scaling, window_size=window, **gqa)
        return out.view(batch, seq, heads, dim), None
    index, cu, longest = _unpad(attention_mask[:, -seq:].bool())
    out = q.new_zeros(batch * seq, heads, dim)
    out[index] = varlen_attn(q[index], k[index], v[index], cu, cu, longest, longest, scale=scaling,
                             window_size=window, **gqa)
    return out.view(batch, seq, heads, dim), None
