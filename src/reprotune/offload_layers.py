"""Offloading only some decoder layers' inputs (hardware.offload_layers; issue #48: the card before the host).

TRL's activation offloading (trl.models.activation_offloading.OffloadActivations, hardware.activation_offloading)
is a torch.autograd.graph.saved_tensors_hooks context the Trainer enters around each forward: every tensor autograd
saves from then on is copied to pinned host memory and brought back in the backward. torch runs only the innermost
saved_tensors_hooks, and TRL opts a module out exactly that way: its NoOpManager (hooks that keep a tensor as it
is), entered in a forward pre-hook of the LM head and of Liger's modules and left in a forward hook. transformers
checkpoints a decoder layer's `forward`, not its `__call__` (transformers.modeling_layers.GradientCheckpointingLayer),
so a module hook runs outside the checkpoint: the layer input torch's non-reentrant checkpoint saves for the
recompute is saved under the NoOpManager (it stays on the GPU), while inside the layer the checkpoint's own hooks
are the innermost ones (its tensors are recomputed, not saved) as before. So the layers after the first N keep
their inputs on the GPU and the first N send theirs to the host, with TRL's class as it is.

The first layers are the ones offloaded: the backward needs their inputs last, so the copies back have the most
compute to hide behind, and the last layers' inputs, needed as soon as the backward starts, never leave the card.
Nothing computed changes (a kept tensor is the same tensor; an offloaded one comes back bit for bit), so the bytes
of a run are those of the run with all or none offloaded; tests/test_host_memory.py checks which inputs the outer
hooks see, on the CPU. The GPU side (TRL's streams with some layers kept) is modelled, not yet measured on a card.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LAYER_NAME = re.compile(r"(^|\.)layers\.\d+$")


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers in order (a PEFT-wrapped model's too): the modules named `...layers.<i>`."""
    return [module for name, module in model.named_modules() if LAYER_NAME.search(name)]


@contextmanager
def keep_layer_inputs(model: Any, offloaded: int) -> Iterator[int]:
    """Under TRL's activation offloading, the decoder layers after the first `offloaded` keep their saved inputs on
    the GPU (0, or at least as many as the model has: untouched, every input offloaded); yields how many layers keep
    theirs. The hooks are removed afterwards."""
    layers = decoder_layers(model) if offloaded else []
    if offloaded >= len(layers):  # 0, or every layer's: TRL's offloading as it is
        yield 0
        return
    from trl.models.activation_offloading import NoOpManager

    noop = NoOpManager()
    handles = []
    for layer in layers[offloaded:]:
        handles.append(layer.register_forward_pre_hook(lambda *_: noop.__enter__()))
        handles.append(layer.register_forward_hook(lambda *_: noop.__exit__(), always_call=True))
    try:
        yield len(layers) - offloaded
    finally:
        for handle in handles:
            handle.remove()
