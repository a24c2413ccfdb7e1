"""Plan stage: memory, time and cost of a training run before renting the GPU.

    python -m reprotune.plan [hydra overrides]        # == make plan ARGS="<the same overrides as make train>"

Reads  the composed config, conf/plan/{memory,throughput,prices}.yaml, data/prepared/{report.json,train.jsonl}.
Writes outputs/plan.json (a what-if, outside the DVC pipeline; make train's own plan is outputs/train/plan.json)
and prints the same: parameters, predicted peak GPU memory by part, the pick on each of
24/40/48/80/141 GB cards (the one make train's preflight takes there: reprotune.sizing.decide), steps, time per
epoch and cost per provider, and warnings.

No weights are loaded and neither torch nor transformers is imported: the models are in reprotune.sizing (its
docstring lists them; docs/plan.md explains them).
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from reprotune.config import CONF_DIR
from reprotune.errors import user_errors
from reprotune.run import resolve
from reprotune.sizing.report import format_plan, make_plan, write_plan
from reprotune.sizing.shape import PlanError


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run = resolve(cfg, "plan")
        try:
            plan = make_plan(cfg, resolved=run)
        except PlanError as err:
            print(f"plan: {err}", file=sys.stderr)
            sys.exit(2)
        print(format_plan(plan))
        print(f"wrote {write_plan(plan, run.path('outputs') / 'plan.json')}")


if __name__ == "__main__":
    main()
