"""Where and how the math runs: device, dtype, gradient checkpointing, seeds and determinism.

Every stage that runs a model asks here, so `hardware=` and `repro=` mean the same thing in train and eval.
"""

from __future__ import annotations

import logging
import os

from omegaconf import DictConfig

from reprotune.errors import ReprotuneError


def resolve_device(cfg: DictConfig) -> str:
    import torch

    wanted = cfg.hardware.device
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ReprotuneError("hardware.device: hardware=gpu asked for CUDA, but torch sees no GPU (try hardware=cpu)")
    return wanted


def resolve_dtype(cfg: DictConfig, device: str) -> str:
    if cfg.hardware.dtype != "auto":
        return cfg.hardware.dtype
    return "bfloat16" if device == "cuda" else "float32"


def set_reproducibility(cfg: DictConfig, device: str) -> None:
    """Seeds everywhere; in repro=strict also deterministic CUDA kernels (slower, byte-identical on GPU). The CPU
    kernel level was fixed before torch loaded (reprotune.kernels): here it is only checked against the config."""
    import torch
    from transformers import set_seed

    from reprotune import kernels

    mode = str(cfg.hardware.get("cpu_kernels", kernels.DEFAULT_MODE))
    warning = kernels.check_mode(mode)
    if warning:
        logging.getLogger("reprotune.runtime").warning(warning)
    else:
        kernels.route_matmul(mode)  # pinned: float32 CPU matrix products on OpenBLAS's pinned kernels
    # a GPU run's math is on the GPU: its CPU threads stay torch's unless hardware.num_threads says otherwise
    threads = kernels.thread_count(cfg.hardware.num_threads, mode if device == "cpu" else "native")
    if threads:
        user = os.environ.get("OMP_NUM_THREADS")
        if user and user != str(threads):
            logging.getLogger("reprotune.runtime").info(
                "OMP_NUM_THREADS=%s overridden: computing with %d threads (hardware.num_threads; the bytes depend on "
                "it)", user, threads)
        torch.set_num_threads(threads)
    if cfg.repro == "strict":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    elif cfg.repro != "default":
        raise ReprotuneError(f"repro: must be 'default' or 'strict', not {cfg.repro!r}")
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(cfg.hardware.tf32)
        torch.backends.cudnn.allow_tf32 = bool(cfg.hardware.tf32)
    set_seed(int(cfg.seed), deterministic=cfg.repro == "strict")


def local_rank() -> int:
    """This process's GPU on its host, as torchrun sets it (0 for a single process)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def attention(cfg: DictConfig, packing: bool, device: str, varlen: bool = False, pairs: bool = False) -> str | None:
    """hardware.attn_implementation, or auto: for packed CUDA runs, torch's FlashAttention varlen kernel where
    the GPU and torch have it (`varlen`: reprotune.varlen_attention, 1.35x flex attention's speed on the H200),
    and flex attention under repro=strict or without it (it computes only the blocks inside each example, and
    its backward is deterministic; varlen's is not); eager under repro=strict unpacked (the fused kernels'
    backward is not deterministic: the measured deterministic path); else None, the library's default (SDPA;
    on the CPU it takes a packed batch's block-diagonal mask as a dense mask). `pairs`: a preference objective's
    pairs: packed (DPO, reprotune.preference.packed: the prompt once, no padding) through `pair_varlen` (the varlen
    kernel over the pair layout) on CUDA, `pair_dense` (a deterministic masked softmax per document) on the CPU and
    under repro=strict; padded (ORPO, KTO, or packing off: TRL 1.16's trainers pad) on CUDA through the varlen
    kernel, which unpads each row from its mask, so no attention is computed over padding."""
    attn = cfg.hardware.get("attn_implementation", "auto")
    if attn not in (None, "auto"):
        return str(attn)
    if pairs and packing:  # DPO's packed pairs (reprotune.preference.packed): their own layout, one of two kernels
        return "pair_varlen" if device == "cuda" and varlen and cfg.repro != "strict" else "pair_dense"
    if pairs and device == "cuda" and varlen and cfg.repro != "strict":
        return "varlen_attention"
    if packing and device == "cuda":
        return "varlen_attention" if varlen and cfg.repro != "strict" else "flex_attention"
    return "eager" if cfg.repro == "strict" else None
