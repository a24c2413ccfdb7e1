"""make train's preflight: before the model loads, decide the run on this GPU (reprotune.sizing.decide), write
the plan of it to outputs/train/plan.json (a declared DVC output of train: off a GPU it holds the decided settings
only), and stop with one line (exit 2) when it cannot fit the free memory."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from omegaconf import DictConfig

from reprotune.run import Run, resolve
from reprotune.run_settings import RunSettings
from reprotune.sizing.decide import Hardware, configured_settings, decide
from reprotune.sizing.fit import both_budgets, describe, overrides_for
from reprotune.sizing.memory import GIB
from reprotune.sizing.report import make_plan, write_plan
from reprotune.sizing.shape import PlanError, Shape, model_shape, shape_from_config

log = logging.getLogger("reprotune.preflight")


def train_shape(cfg: DictConfig, model_dir: str | Path) -> Shape | None:
    """The model's shape: from its preset, else from the config.json of the directory it was loaded from (a hub
    preset without an `architecture`), else None (the run goes on as configured)."""
    try:
        return model_shape(cfg.model)
    except PlanError:
        config = Path(model_dir) / "config.json"
        if not config.is_file():
            return None
        try:
            return shape_from_config(json.loads(config.read_text()), str(config))
        except PlanError:
            return None


def refusal(cfg: DictConfig, hw: Hardware, run: RunSettings, resolved: Run) -> str:
    """Why the run cannot start here, in one line: over the card, or (issue #48) over the host budget, naming what
    the smallest setting needs of each against its budget; with the overrides that would fit the whole free card
    and the host, where some do."""
    p, other = run.predicted, run.fallback
    hint = (f"settings that fit: {' '.join(overrides_for(other, configured_settings(cfg, hw, resolved)))} "
            f"({run.fallback_card_gib} GiB)" if other else "")
    if run.host_budget_bytes is not None and p["host_offload_gib"] * GIB > run.host_budget_bytes:
        budget = min(run.budget_bytes or hw.free_bytes, hw.free_bytes)
        return (f"nothing fits both budgets on {hw.name}: the smallest setting ({describe(run.planned)}) "
                + both_budgets(p["card_gib"], budget / GIB, p["host_offload_gib"], run.host_budget_bytes / GIB)
                + f"; {hint or 'a larger host budget, a shorter train.max_length, or a larger card'}")
    return (f"predicted {p['card_gib']} GiB (peak {p['peak_gib']} GiB allocated) > {hw.free_bytes / GIB:.1f} GiB "
            f"free on {hw.name}; {hint or 'nothing fits this GPU; use a larger card (make plan shows which)'}")


def preflight(cfg: DictConfig, hw: Hardware, shape: Shape | None, resolved: Run | None = None) -> RunSettings:
    """The run's settings on `hw`, written to outputs/train/plan.json (on a GPU with the whole plan for it); exit 2
    (one line, with the overrides that would fit) when the predicted need is over the free memory. resolved: train's
    reprotune.run.Run (None: decide's default, plan's): its paths.train_dir holds plan.json."""
    resolved = resolved if resolved is not None else resolve(cfg, "plan")
    run = decide(cfg, hw, shape, resolved=resolved)
    out = resolved.path("train_dir") / "plan.json"
    if hw.device != "cuda" or run.planned is None:
        write_plan({"device": run.device, "run_settings": run.as_record(), "memory": None,
                    "note": "nothing fitted off a GPU (or without the model's shape); make plan plans a GPU run"}, out)
        return run
    write_plan(make_plan(cfg, hw, shape, run, resolved) | {"run_settings": run.as_record()}, out)
    if not run.fits:
        print(f"train: preflight: {refusal(cfg, hw, run, resolved)}", file=sys.stderr)
        raise SystemExit(2)
    log.info("preflight: plan: %s: predicted %s GiB peak of a %.1f GiB budget (%.1f GiB free)", describe(run.planned),
             run.predicted["peak_gib"], run.budget_bytes / GIB, hw.free_bytes / GIB)
    return run
