"""Preference tuning (DPO, ORPO, KTO): the objectives' trainers and configs (`trainers`), the preference data
formats (`formats`), their preparation into train/holdout pairs (`pairs`) and the built-in task's pairs
(reprotune.invoices.wrong_extraction). docs/preference.md says how to use it."""

from __future__ import annotations

from typing import Any

PREFERENCE_OBJECTIVES = ("dpo", "orpo", "kto")
# objectives with a reference model (the implicit reward is log pi/pi_ref); ORPO has none
WITH_REFERENCE = ("dpo", "kto")


def objective_name(cfg: Any) -> str:
    """The configured objective ('sft' when the config predates the objective group)."""
    node = cfg.get("objective") if hasattr(cfg, "get") else None
    return str(node.name) if node is not None else "sft"


def is_preference(cfg: Any) -> bool:
    return objective_name(cfg) in PREFERENCE_OBJECTIVES
