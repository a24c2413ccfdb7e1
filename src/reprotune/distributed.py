"""Several processes (GPUs, hosts) for the train stage: torchrun launches, the HF Trainer does DDP or FSDP2.

    python -m reprotune.distributed [hydra overrides]        # what 'make train NPROC=2' runs

The launcher only decides how many processes and where the rendezvous is, then hands over to torch's own
launcher (torch.distributed.run, i.e. torchrun); inside each process the Trainer (through accelerate) wraps the
model in DDP or FSDP2 from `hardware.distributed`. Environment, as torchrun names it:
NPROC (processes on this host; default: every visible GPU with hardware=gpu, else 1), NNODES, NODE_RANK,
MASTER_ADDR, MASTER_PORT.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from reprotune.errors import ReprotuneError
from reprotune.runtime import local_rank

log = logging.getLogger("reprotune.distributed")


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def world() -> World:
    """This process's place, as torchrun sets it (one process without it)."""
    return World(rank=int(os.environ.get("RANK", 0)), size=int(os.environ.get("WORLD_SIZE", 1)),
                 local_rank=local_rank())


def barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def init_process_group(device: str) -> None:
    """Join the process group early (the Trainer would, later), so the stage can order file work by rank."""
    import torch.distributed as dist

    if world().size > 1 and not dist.is_initialized():
        if device == "cuda":
            import torch

            torch.cuda.set_device(world().local_rank)
        dist.init_process_group(backend="nccl" if device == "cuda" else "gloo")


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """Rank 0 runs the block first (materialising a model, removing stale checkpoints), the others after it."""
    w = world()
    if not w.is_main:
        barrier()
    try:
        yield
    finally:
        if w.is_main:
            barrier()


def global_batch(cfg: DictConfig, rows: int, accum: int, size: int) -> tuple[int, str]:
    """Gradient accumulation on each of `size` processes that keeps the configured global batch
    (rows x accumulation), and a line saying what the effective global batch is."""
    keep = bool(cfg.hardware.get("keep_global_batch", True))
    if size > 1 and keep and accum % size == 0:
        accum //= size
        note = "configured global batch kept"
    elif size > 1 and keep:
        note = (f"accumulation {accum} is not divisible by {size} processes: the global batch is {size}x the "
                f"configured one (set train.gradient_accumulation_steps to a multiple of {size} to keep it)")
    else:
        note = "one process" if size == 1 else "hardware.keep_global_batch=false: global batch multiplied"
    return accum, f"global batch {rows} rows x {accum} accumulation x {size} process(es) = {rows * accum * size} ({note})"


def strategy(cfg: DictConfig, size: int) -> str:
    """ddp, fsdp2 or none (one process). hardware.distributed=auto: DDP (LoRA on a model that fits one GPU,
    which make plan / the memory fit decides; FSDP2 is chosen by naming it)."""
    if size <= 1:
        return "none"
    chosen = cfg.hardware.distributed
    return "ddp" if chosen in (None, "auto") else str(chosen)


def trainer_arguments(cfg: DictConfig, chosen: str) -> dict[str, Any]:
    """SFTConfig keys for the strategy (`strategy`'s answer; the Trainer and accelerate implement both)."""
    from omegaconf import OmegaConf

    if chosen == "fsdp2":
        fsdp_config = OmegaConf.to_container(cfg.hardware.fsdp_config, resolve=True)
        return {"fsdp": "full_shard auto_wrap", "fsdp_config": fsdp_config}
    if chosen == "ddp":
        # LoRA leaves every frozen weight without a gradient: no unused-parameter search per step
        return {"ddp_find_unused_parameters": False}
    if chosen != "none":
        raise ReprotuneError(f"hardware.distributed: must be auto, ddp or fsdp2, not {chosen!r}")
    return {}


# --------------------------------------------------------------------------------------------- launcher
def nproc(argv: list[str]) -> int:
    """NPROC, else every visible GPU when the run trains on CUDA (hardware=gpu, or auto on a GPU host: one
    process there unless NPROC says more), else 1. The device is read from the config the train stage will
    compose from the same arguments: under DVC that is params.yaml (`--config-dir . --config-name params`)."""
    if os.environ.get("NPROC"):
        return int(os.environ["NPROC"])
    import torch

    if not torch.cuda.is_available():
        return 1
    from reprotune.config import compose_argv

    try:
        device = compose_argv(argv).hardware.device
    except Exception:  # noqa: BLE001 - a config the stage can not compose: one process, which reports it
        return 1
    return torch.cuda.device_count() if device == "cuda" else 1


def launch_command(overrides: list[str], processes: int) -> list[str]:
    nnodes = os.environ.get("NNODES") or "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}", f"--nnodes={nnodes}"]
    if nnodes != "1" or os.environ.get("MASTER_ADDR"):
        cmd += [f"--node_rank={os.environ.get('NODE_RANK') or '0'}",
                f"--master_addr={os.environ.get('MASTER_ADDR') or '127.0.0.1'}",
                f"--master_port={os.environ.get('MASTER_PORT') or '29500'}"]
    else:
        cmd += ["--standalone"]  # one host: a free local port, no fixed rendezvous to collide on
    return [*cmd, "-m", "reprotune.train", *overrides]


def main(argv: list[str]) -> None:
    processes = nproc(argv)
    if processes <= 1 and (os.environ.get("NNODES") or "1") == "1":
        cmd = [sys.executable, "-m", "reprotune.train", *argv]
    else:
        cmd = launch_command(argv, processes)
    print("+ " + " ".join(cmd[1:]), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
