"""Host memory as a budget beside the card's (issue #48): the host's MemAvailable, hardware.host_memory_budget_gib
and hardware.offload_layers (how many layer inputs an offloading run sends to the host). docs/gpu.md, "Host memory
as a budget", says how the fit uses them. No torch."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from reprotune.errors import ReprotuneError
from reprotune.sizing.memory import GIB
from reprotune.sizing.shape import Shape

# What the default host budget leaves to everything else on the host: the OS, the page cache a data loader reads
# through, a desktop, another process (the training process's own share is in memory.yaml's host_process_gib)
HOST_MARGIN_GIB = 4.0


def host_available_bytes(processes: int = 1, meminfo: str | Path = "/proc/meminfo") -> float | None:
    """This host's available memory (/proc/meminfo's MemAvailable), shared by the processes of the run; None where
    the file or the line is missing (not Linux)."""
    try:
        lines = Path(meminfo).read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / max(1, processes)
    return None


def host_budget(cfg: DictConfig, available: float | None) -> float | None:
    """hardware.host_memory_budget_gib: what offloaded activations (and the process beside them) may take of host
    memory, never more than `available` when it is known; null/auto: `available` less HOST_MARGIN_GIB. None: not
    checked (null for a card make plan only describes: its host is not this one)."""
    value = cfg.hardware.get("host_memory_budget_gib")
    if value is None or value == "auto":
        return None if available is None else max(0.0, available - HOST_MARGIN_GIB * GIB)
    configured = float(value) * GIB
    return configured if available is None else min(configured, available)


# hardware.offload_layers=auto as the fit receives it: offload the fewest layer inputs the card cannot keep (issue #48;
# modelled, not yet measured on a card). None (the default, null): every layer's, as measured on cards; N: the first N.
FEWEST = -1


def configured_offload_layers(cfg: DictConfig) -> int | None:
    """hardware.offload_layers: how many decoder layers' inputs an offloading run sends to the host, the first ones;
    None (null, the default): every layer's, the offloading measured on cards; auto: FEWEST,
    the fit offloads only those the card cannot keep (modelled; its GPU side not yet measured on a card)."""
    value = cfg.hardware.get("offload_layers")
    return None if value is None else FEWEST if value == "auto" else int(value)


def check_offload_layers(cfg: DictConfig, offload: bool | None, shape: Shape | None) -> None:
    """hardware.offload_layers only with offloading possible, and at most the model's decoder layers: one line."""
    n = configured_offload_layers(cfg)
    if n is None or n < 1:
        return
    if offload is False and cfg.hardware.activation_offloading is False:
        raise ReprotuneError(f"hardware.offload_layers={n}: hardware.activation_offloading=false offloads nothing; "
                             "leave offload_layers null or turn offloading on")
    if shape is not None and n > shape.layers:
        raise ReprotuneError(f"hardware.offload_layers={n}: the model has {shape.layers} decoder layers (at most "
                             f"{shape.layers}; null: the fit offloads those the card cannot keep)")
