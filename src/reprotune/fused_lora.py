"""LoRA's `result + B(A(x)) * scaling` with the scale and the add inside B's matrix product.

PEFT computes a LoRA linear layer as the frozen product followed by B's product, a multiply by the scale and an
add, and its 4-bit layer clones the frozen output first: each of those reads and writes a whole
[tokens, out_features] tensor, and the backward multiplies the incoming gradient by the scale again: a large
share of an 8B LoRA step's GPU time (docs/measurements/2026-12-01-gpu-fast-path.md). `torch.addmm(result, A(x), Bᵀ,
alpha=scaling)` is the same sum done by one cuBLAS call that reads `result` in its epilogue; its backward scales
only the rank-r products. The sum is rounded once instead of twice, so the numbers differ from PEFT's in the last
bit, not in meaning; runs stay deterministic (same kernels, same order).

Only the plain case is rerouted (one active adapter, no dropout, no LoRA variant such as DoRA, no lora bias, not
merged, no per-example adapter names); everything else goes through PEFT's own forward unchanged. The layers get
PEFT's forward back when the context exits, so saving, merging and evaluation see plain PEFT modules.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def _lora_linear_classes() -> tuple[type, ...]:
    from peft.tuners.lora import layer

    classes: list[type] = [layer.Linear]
    try:
        from peft.tuners.lora import bnb

        if hasattr(bnb, "Linear4bit"):
            classes.append(bnb.Linear4bit)
    except ImportError:  # no bitsandbytes: no 4-bit layers to reroute
        pass
    return tuple(classes)


def plain_adapter(module: nn.Module, kwargs: dict[str, Any]) -> str | None:
    """The one adapter `module` would add the PEFT way, when the fused sum is the same computation; else None."""
    if kwargs or module.disable_adapters or module.merged:
        return None
    active = [a for a in module.active_adapters if a in module.lora_A]
    if len(active) != 1:
        return None
    name = active[0]
    if (name in getattr(module, "lora_variant", {}) or not isinstance(module.lora_dropout[name], nn.Identity)
            or module.lora_B[name].bias is not None):
        return None
    return name


def _same_dtypes(module: nn.Module, name: str, x: torch.Tensor) -> bool:
    """Outside autocast PEFT casts between the adapter's and the layer's dtypes; the fused sum needs none."""
    return (torch.is_autocast_enabled(x.device.type)
            or x.dtype == module.lora_A[name].weight.dtype == module.lora_B[name].weight.dtype)


def fused_forward(module: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's LoRA linear forward, the scale and add of the adapter folded into B's product."""
    name = None if args else plain_adapter(module, kwargs)
    if name is None or not _same_dtypes(module, name, x):
        return type(module).forward(module, x, *args, **kwargs)
    result = module.base_layer(x)
    hidden = module.lora_A[name](x)
    out = torch.addmm(result.reshape(-1, result.shape[-1]), hidden.reshape(-1, hidden.shape[-1]),
                      module.lora_B[name].weight.t(), alpha=module.scaling[name])
    return out.view(result.shape)


@contextlib.contextmanager
def fused_lora(model: nn.Module, active: bool = True) -> Iterator[int]:
    """Reroute the model's LoRA linear layers through `fused_forward` while the context is open; yields how many."""
    if not active:
        yield 0
        return
    classes = _lora_linear_classes()
    layers = [m for m in model.modules() if type(m) in classes]
    for m in layers:
        m.forward = types.MethodType(fused_forward, m)
    try:
        yield len(layers)
    finally:
        for m in layers:
            del m.forward  # back to the class's (PEFT's) forward
