"""A stage's run, resolved once at its door: `resolve(cfg, stage) -> Run`, called first by every stage's main
(prepare, train, eval, merge, gguf, serve, publish, pii_review, plan) and by the door checks of `make`. The Run
holds what the stage would otherwise re-derive from the config in several places: the objective (an `Objective`
of reprotune.objectives), the stage's paths (conf/paths and the objective's conf/objective/paths, resolved: `Run.path`),
the `repro` mode (every stage's but prepare's and gguf's, whose outputs do not depend on it), and for the stages
whose math runs in torch on the configured hardware (train, eval) the device, the dtype and `hardware.cpu_kernels`;
eval's also its generation batch size. The code below the main takes these from the Run; the objective
(objective_of), the device and the dtype are decided here only, and `paths` and `repro` are read from the config
here only (tests/test_run_resolve.py checks both from the source).

DVC params follow what each stage's resolution reads (reprotune.pipeline follows `resolve(cfg, "<stage>")` into
the resolver of that stage, `resolver_of`), so prepare, merge and gguf gain no hardware keys from it, and prepare
and gguf no `repro` (`paths` is no param of any stage).

Pure: imports reprotune.objectives, reprotune.schema and reprotune.errors; torch only to see whether CUDA is there
(train's and eval's device)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from reprotune import schema
from reprotune.errors import ReprotuneError
from reprotune.objectives import OBJECTIVES, Objective

# the stages that run their math in torch on the device hardware= picks: device, dtype and kernels resolved
PLACED = ("train", "eval")
# every caller of resolve: the stages (reprotune.pipeline.STAGES' modules, and make pii-review) and `params`, the
# make wrapper's and the Hydra callback's view of a config before any stage runs (reprotune.runner, config)
# the stages whose outputs do not depend on the repro mode: their Run leaves it out (reading it would make it a
# DVC param of theirs, re-running them when only the mode changes)
UNSEEDED = ("prepare", "gguf")
STAGES = ("prepare", "train", "eval", "merge", "gguf", "plan", "serve", "publish", "pii_review", "params")
# padded generation keeps a (batch x length) KV cache and logits: safe starting points for a laptop CPU and for
# one GPU (eval.batch_size=N overrides)
AUTO_EVAL_BATCH = {"cpu": 8, "cuda": 32}


@dataclass(frozen=True)
class Run:
    """What one stage runs with, decided once (resolve)."""
    stage: str
    objective: Objective
    paths: Mapping[str, str]          # cfg.paths resolved (read-only)
    device: str | None = None         # cuda | cpu | mps: train and eval only (None: the stage places nothing)
    dtype: str | None = None          # float32 | bfloat16 | float16: with the device
    repro: str | None = None          # default | strict | fast (reprotune.schema.REPRO_MODES): all but UNSEEDED
    cpu_kernels: str | None = None    # hardware.cpu_kernels: with the device
    eval_batch_size: int | None = None  # eval's generation batch: eval only

    def path(self, name: str) -> Path:
        """paths.<name> (conf/paths, or the objective's conf/objective/paths) as a Path."""
        if name not in self.paths:
            raise ReprotuneError(f"paths.{name}: not in the config of this {self.stage} run")
        return Path(self.paths[name])


def objective_of(cfg: Any) -> Objective:
    """The configured objective (sft when the config predates the objective group)."""
    node = cfg.get("objective") if hasattr(cfg, "get") else None
    name = str(node.name) if node is not None else schema.SFT
    if name not in OBJECTIVES:
        raise ReprotuneError(f"objective.name: {name!r} is not one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def dtype_for(configured: str, device: str) -> str:
    """hardware.dtype on `device`: auto is bfloat16 on CUDA, float32 elsewhere. The one rule: the resolver applies it
    to a stage's device, the planner (reprotune.sizing.decide) to the card it describes."""
    if configured != "auto":
        return configured
    return "bfloat16" if device == "cuda" else "float32"


def _device(cfg: Any) -> str:
    import torch

    wanted = cfg.hardware.device
    if wanted == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ReprotuneError("hardware.device: hardware=gpu asked for CUDA, but torch sees no GPU (try hardware=cpu)")
    return str(wanted)


def _plain(cfg: Any, stage: str) -> Run:
    """The objective and the paths: every stage's (a path set to null is left out, as if not configured)."""
    paths = ({str(k): str(v) for k, v in cfg.paths.items() if v is not None} if cfg.get("paths") is not None
             else {})
    return Run(stage=stage, objective=objective_of(cfg), paths=MappingProxyType(paths))


def _seeded(cfg: Any, stage: str) -> Run:
    """And the repro mode (checked against reprotune.schema at the door; `make plan` plans a card it only
    describes, but with the configured mode)."""
    return replace(_plain(cfg, stage), repro=str(cfg.repro))


def _placed(cfg: Any, stage: str) -> Run:
    """And where the math runs: the device torch sees for hardware.device, the dtype, the CPU kernels
    (cpu_kernels was checked against reprotune.schema at the door)."""
    device = _device(cfg)
    return replace(_seeded(cfg, stage), device=device, dtype=dtype_for(str(cfg.hardware.dtype), device),
                   cpu_kernels=str(cfg.hardware.cpu_kernels))


def _evaluated(cfg: Any, stage: str) -> Run:
    """And eval's generation batch size (eval.batch_size; auto: AUTO_EVAL_BATCH for the device)."""
    run = _placed(cfg, stage)
    size = cfg.eval.batch_size
    if size == "auto":
        size = AUTO_EVAL_BATCH.get(str(run.device), 8)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ReprotuneError(f"eval.batch_size: must be a positive integer or 'auto', not {size!r}")
    return replace(run, eval_batch_size=size)


_RESOLVERS: dict[str, Callable[[Any, str], Run]] = {"plain": _plain, "seeded": _seeded, "placed": _placed,
                                                    "eval": _evaluated}


def _resolver(stage: str) -> Callable[[Any, str], Run]:
    if stage not in STAGES:
        raise ReprotuneError(f"resolve: unknown stage {stage!r} (one of {', '.join(STAGES)})")
    kind = ("eval" if stage == "eval" else "placed" if stage in PLACED else "plain" if stage in UNSEEDED
            else "seeded")
    return _RESOLVERS[kind]


def resolver_of(stage: str) -> str:
    """The name of the function that resolves `stage` (reprotune.pipeline follows it for the stage's params)."""
    return _resolver(stage).__name__


def resolve(cfg: Any, stage: str) -> Run:
    """The stage's Run, from the composed (and at the door checked) config: called first by every stage's main."""
    return _resolver(stage)(cfg, stage)
