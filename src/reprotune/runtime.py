"""How the math runs on the device the stage resolved (reprotune.run): seeds, determinism, threads, attention.

Every stage that runs a model applies its settings here, so `hardware=` and `repro=` mean the same thing in train
and eval.
"""

from __future__ import annotations

import logging
import os

from omegaconf import DictConfig

from reprotune.errors import ReprotuneError
from reprotune.run import Run
from reprotune.schema import REPRO_MODES


def deterministic_kernels(repro: str, device: str) -> bool:
    """Whether torch runs only deterministic kernels (torch.use_deterministic_algorithms): on CUDA in the default
    and strict modes, on the CPU in strict (the CPU's kernels are deterministic already, pinned by
    reprotune.kernels). Under it the FlashAttention varlen backward accumulates dQ per split in a fixed order instead
    of with atomics, index_put_/index_add_ sort before they add, cuBLAS works in a fixed workspace, and any op
    without a deterministic kernel raises instead of running. `fast` leaves every CUDA kernel to its fastest form."""
    if repro not in REPRO_MODES:
        raise ReprotuneError(f"repro: must be one of {', '.join(REPRO_MODES)}, not {repro!r}")
    return repro == "strict" or (repro == "default" and device == "cuda")


def set_reproducibility(cfg: DictConfig, run: Run) -> None:
    """Seeds everywhere, and the kernels `repro` asks for (deterministic_kernels). strict also fills every
    uninitialised tensor with NaN (torch.utils.deterministic.fill_uninitialized_memory), which turns a read of
    memory no kernel wrote into a visible NaN: a check, not a source of determinism, so the default leaves it off
    (it costs a write of every new buffer). The CPU kernel level was fixed before torch loaded (reprotune.kernels):
    here it is only checked against the config. run: the stage's (its device, repro mode and CPU kernels)."""
    import torch
    import torch.utils.deterministic
    from transformers import set_seed

    from reprotune import kernels

    device, mode = str(run.device), str(run.cpu_kernels)
    warning = kernels.check_mode(mode)
    if warning:
        logging.getLogger("reprotune.runtime").warning(warning)
    elif device == "cpu":
        # pinned: float32 CPU matrix products on OpenBLAS's pinned kernels. A GPU run's products are on the GPU:
        # it is not routed (under pytest on the GPU host a plugin loaded numpy's OpenBLAS before the pin, so it
        # ran its SkylakeX kernels and the route refused, stopping a run whose CPU products are none)
        kernels.route_matmul(mode)
    # a GPU run's math is on the GPU: its CPU threads stay torch's unless hardware.num_threads says otherwise
    threads = kernels.thread_count(cfg.hardware.num_threads, mode if device == "cpu" else "native")
    if threads:
        user = os.environ.get("OMP_NUM_THREADS")
        if user and user != str(threads):
            logging.getLogger("reprotune.runtime").info(
                "OMP_NUM_THREADS=%s overridden: computing with %d threads (hardware.num_threads; the bytes depend on "
                "it)", user, threads)
        torch.set_num_threads(threads)
    deterministic = deterministic_kernels(str(run.repro), device)
    if deterministic:
        # read when cuBLAS creates its handle (the first matrix product, after this): a fixed workspace per stream
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=False)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    else:
        torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = run.repro == "strict"
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = bool(cfg.hardware.tf32)
        torch.backends.cudnn.allow_tf32 = bool(cfg.hardware.tf32)
    set_seed(int(cfg.seed))


def local_rank() -> int:
    """This process's GPU on its host, as torchrun sets it (0 for a single process)."""
    return int(os.environ.get("LOCAL_RANK", 0))


def attention(cfg: DictConfig, repro: str, packing: bool, device: str, varlen: bool = False,
              pairs: bool = False) -> str | None:
    """hardware.attn_implementation, or auto: for packed CUDA runs, torch's FlashAttention varlen kernel where
    the GPU and torch have it (`varlen`: reprotune.varlen_attention, faster than flex attention),
    else flex attention (it computes only the blocks inside each example). Both backwards are deterministic under
    the default and strict modes (deterministic_kernels: the varlen backward then sums dQ in a fixed order).
    Unpacked: eager under repro=strict on the CPU (the measured deterministic path there), else None, the library's
    default (SDPA; on the CPU it takes a packed batch's block-diagonal mask as a dense mask). `pairs`: a preference
    objective's pairs: packed (DPO, reprotune.preference.packed: the prompt once, no padding) through `pair_varlen`
    (the varlen kernel over the pair layout) on CUDA, `pair_dense` (a masked softmax per document) on the CPU;
    padded (ORPO, KTO, or packing off: TRL 1.16's trainers pad) on CUDA through the varlen kernel, which unpads
    each row from its mask, so no attention is computed over padding. repro: the stage Run's mode."""
    deterministic_kernels(repro, device)  # an unknown mode is refused here too: make plan asks here first
    attn = cfg.hardware.attn_implementation
    if attn not in (None, "auto"):
        return str(attn)
    fast = device == "cuda" and varlen
    if pairs and packing:  # DPO's packed pairs (reprotune.preference.packed): their own layout, one of two kernels
        return "pair_varlen" if fast else "pair_dense"
    if pairs and fast:
        return "varlen_attention"
    if packing and device == "cuda":
        return "varlen_attention" if varlen else "flex_attention"
    return "eager" if repro == "strict" and device != "cuda" else None
