"""The decoder layers' MLPs over tiles of the sequence, for long context (hardware.tiled_mlp; issue #27).

At 96k tokens an 8B model's MLP keeps three or four (tokens x 12,288) tensors for its backward, ~10 GiB in the
layer being recomputed: the largest part of what stays on the GPU once the layer inputs are offloaded. The MLP
acts on every token alone, so it can run tile by tile: each tile's MLP is checkpointed (torch.utils.checkpoint,
non-reentrant), its intermediates are dropped after the forward and rebuilt, one tile at a time, in the backward.
This is DeepSpeed's TiledMLP (Arctic long sequence training), which Liger ships as LigerTiledMLPFunction; it is
composed here from torch's own checkpoint instead, so that it runs the same code on the CPU in CI as on the GPU
(liger-kernel needs triton, which the CPU lock does not have) and wraps whatever the MLP's forward is (Liger's
SwiGLU, Gemma's GELU, PEFT's LoRA layers inside).

The cost: one more MLP forward per layer in the backward (reprotune.flops.lora_step_flops_per_token counts it).
The numbers: each tile's products are the same products on fewer rows, so the loss and gradients match the whole
MLP's to float rounding (tests/test_long_context.py states the tolerance); the adapters' LoRA dropout draws its
masks tile by tile (the checkpoint replays the same draws in the backward), so with dropout on, tiled and whole
runs differ as two seeds do, and each reruns to the same bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

MLP_NAME = re.compile(r"(^|\.)layers\.\d+\.mlp$")


def tiled(forward, tile: int):
    """forward(x) over tiles of `tile` positions along the sequence axis (-2) when it records gradients."""
    import torch
    from torch.utils.checkpoint import checkpoint

    def tiled_forward(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or x.shape[-2] <= tile:
            return forward(x)  # a checkpointed layer's first forward (no graph), generation, short rows
        return torch.cat([checkpoint(forward, part, use_reentrant=False) for part in x.split(tile, dim=-2)],
                         dim=-2)

    return tiled_forward


@contextmanager
def tiled_mlp(model, tile: int) -> Iterator[int]:
    """Every decoder layer's MLP runs over tiles of `tile` tokens inside the block (0: untouched); yields how many
    MLPs were tiled. The forwards are restored afterwards, so the saved adapter and a later eval see the model as
    it was."""
    if not tile:
        yield 0
        return
    patched = []
    for name, module in model.named_modules():
        if MLP_NAME.search(name):
            had = "forward" in vars(module)
            patched.append((module, had, vars(module).get("forward")))
            module.forward = tiled(module.forward, tile)
    try:
        yield len(patched)
    finally:
        for module, had, original in patched:
            if had:
                module.forward = original
            else:
                del module.forward
