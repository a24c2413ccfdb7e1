"""The frozen input embedding kept in host memory for a training run (hardware.embedding_on_host).

A LoRA/QLoRA run never updates the input embedding, and a lookup is a gather: on an untied 8B (Qwen3-8B: 151,936 x
4,096 bf16) the table is 1.16 GiB of GPU memory that only ever copies a few rows a token. With the table on the
host, each forward gathers its rows on the CPU into pinned memory and copies them to the GPU (~8 KB a token); the
values are the same bytes the GPU's gather gives, so the adapter's bytes do not change. What the GPU gains is room
for more pairs a micro-step (docs/preference.md). Packed preference batches gather their rows in the collator, with
the packing, while the GPU still runs the previous micro-step (offer_rows): their forwards neither read the ids
back from the GPU nor gather again for the reference forward. Decided once in reprotune.sizing.decide (memory model:
reprotune.sizing.memory.weight_bytes); train.fit applies it for the run and puts the table back after.

The module object itself stays in the model: the hooks registered on it (transformers' enable_input_require_grads,
which reentrant checkpointing needs) keep running. Its weight stops being a parameter for the run, so the
Trainer's and accelerate's model.to(device) leave the host table where it is.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any


def _host_forward(self: Any, input_ids: Any) -> Any:
    offered = getattr(self, "offered", None)
    if offered is not None and offered[0] is input_ids:
        # a fresh view a call: the hooks' requires_grad_ and the backward's .grad stay with this call's tensor
        return offered[1].view_as(offered[1])
    ids = input_ids.to("cpu")  # waits for the ids: one synchronisation a forward
    return _to_gpu(self, gather_rows(self.weight, ids.reshape(-1)).view(*ids.shape, self.embedding_dim))


def _to_gpu(emb: Any, rows: Any) -> Any:
    # from pinned memory the copy does not wait; the caching host allocator keeps `rows` until it has run
    return rows.to(emb.gpu_device, non_blocking=True)


def host_table(model: Any) -> Any:
    """The model's input embedding table while it is on the host (None: on the GPU, or not a host run)."""
    emb = model.get_input_embeddings()
    return emb.weight if getattr(emb, "gpu_device", None) is not None else None


def gather_rows(table: Any, ids: Any) -> Any:
    """table[ids] for ids on the host, into pinned memory where there is a GPU to copy them to (in a DataLoader
    worker, a fork that must not touch CUDA, into plain memory: the DataLoader's pin thread pins the batch)."""
    import torch
    from torch.utils.data import get_worker_info

    pin = get_worker_info() is None and torch.cuda.is_available()
    rows = torch.empty((ids.numel(), table.shape[1]), dtype=table.dtype, pin_memory=pin)
    return torch.index_select(table, 0, ids.reshape(-1), out=rows)


def offer_rows(emb: Any, input_ids: Any, rows: Any | None, host_ids: Any | None) -> None:
    """The next lookup of `input_ids` (on the GPU) answered with `rows` (gathered on the host with the batch, or
    now from `host_ids`, the same ids on the host): no synchronisation to read the ids back. Kept for the calls
    on the same ids (DPO's reference forward), replaced by the next batch's. Nothing while the table is on the
    GPU."""
    if getattr(emb, "gpu_device", None) is None or (rows is None and host_ids is None):
        return
    offered = getattr(emb, "offered", None)
    if offered is not None and offered[0] is input_ids:
        return
    emb.offered = None  # the previous batch's rows go before this one's are copied
    rows = gather_rows(emb.weight, host_ids)[None] if rows is None else rows
    emb.offered = (input_ids, _to_gpu(emb, rows))


def why_not_on_host(model: Any) -> str | None:
    """Why this model's input embedding cannot stay on the host for training (None: it can)."""
    import torch

    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(emb) is not torch.nn.Embedding:  # a scaled (Gemma) or trainable-tokens embedding computes more
        return f"the input embedding is a {type(emb).__name__}, not a plain torch.nn.Embedding"
    if head is not None and getattr(head, "weight", None) is emb.weight:
        return "the input embedding is tied to the LM head, which the GPU needs"
    if emb.weight.requires_grad:
        return "the input embedding is trained"
    return None


@contextlib.contextmanager
def embedding_on_host(model: Any, active: bool) -> Iterator[int]:
    """For the block: the model's input embedding table in host memory, its lookups gathered there and copied to
    the GPU; yields the GPU bytes freed (0: not active). Refuses a model whose embedding cannot (why_not_on_host)."""
    if not active:
        yield 0
        return
    import torch

    from reprotune.errors import ReprotuneError

    why = why_not_on_host(model)
    if why:
        raise ReprotuneError(f"hardware.embedding_on_host: {why}; set hardware.embedding_on_host=false")
    emb = model.get_input_embeddings()
    param = emb.weight
    device, freed = param.device, param.numel() * param.element_size()
    del emb.weight                                # no longer a parameter: model.to(device) leaves it on the host
    emb.weight = param.detach().to("cpu")         # a plain attribute (what get_input_embeddings().weight reads)
    emb.gpu_device = device
    emb.forward = types.MethodType(_host_forward, emb)
    del param
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        yield freed
    finally:
        table = emb.weight
        del emb.forward, emb.gpu_device, emb.weight
        emb.__dict__.pop("offered", None)
        emb.weight = torch.nn.Parameter(table.to(device), requires_grad=False)
