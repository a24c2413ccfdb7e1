"""A preference run's eval: its holdout rows, the SFT adapter it started from loaded beside the trained one, the
pairs' implicit-reward pass, and what report.md says of the task pass on those rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from reprotune.evaluation.holdout import Example, read_holdout
from reprotune.preference import pair_eval


def load_start_adapter(cfg: DictConfig, model) -> bool:
    """A preference run that started from an SFT adapter (objective.init_adapter): that adapter next to the trained
    one, as PEFT adapter "sft", so the task pass and the pairs' pass score it too. False when there is none."""
    init = cfg.objective.get("init_adapter")  # only a preference objective has one
    if not init or not (Path(str(init)) / "adapter_config.json").is_file():
        return False
    model.load_adapter(str(init), adapter_name="sft")
    model.set_adapter("default")
    return True


def preference_pass(cfg: DictConfig, model, tokenizer, rows: list[dict], with_sft: bool
                    ) -> tuple[dict[str, Any], list[dict]]:
    """A preference run's holdout rows through base, the SFT adapter it started from and the trained adapter."""
    return pair_eval.preference_eval(model, tokenizer, rows, float(cfg.objective.get("beta") or 0.1), with_sft)


def task_pass_note(rows: list[dict], examples: int) -> str:
    """What report.md says of a preference holdout's task metrics: which rows they are computed on, or why none."""
    if isinstance(rows[0]["prompt"], str) and examples:
        which = "pairs: the chosen answer" if "chosen" in rows[0] else "KTO rows with label true: their completion"
        return (f"Task metrics on the {examples} holdout text rows ({which} is the reference), each prompt given as "
                "its raw text, with no chat template, as the model was trained on it.")
    if "chosen" in rows[0]:
        return f"Task metrics on the {examples} holdout pairs: the chosen answer is the reference."
    undesirable = sum(not r["label"] for r in rows)
    if not examples:
        return (f"Task metrics: skipped. All {undesirable} KTO holdout rows have label false: an undesirable "
                "completion is no reference to score generations against.")
    return (f"Task metrics on the {examples} KTO rows with label true (their completion is the reference); the "
            f"{undesirable} rows with label false have no reference.")


def preference_holdout(cfg: DictConfig, holdout: Path) -> tuple[list[dict], list[Example]]:
    """The rows of a preference holdout, and the examples of its task pass (none for KTO rows that are all
    undesirable)."""
    rows = pair_eval.read_pairs(holdout, cfg.eval.max_examples)  # one kind in a file, checked
    wanted = "chosen" in rows[0] or any(r["label"] for r in rows)
    return rows, read_holdout(holdout, cfg.eval.max_examples) if wanted else []


def add_preference(metrics: dict[str, Any], records: list[dict], examples: list[Example],
                   preference: tuple[dict[str, Any], list[dict]]) -> list[dict]:
    """The pairs' metrics next to the task's, and each example's log-probabilities with it; without a task pass
    the records are the pairs' own."""
    metrics["preference"] = preference[0]
    for rec, ex in zip(records, examples, strict=True):
        rec["logps"] = preference[1][ex.row if ex.row is not None else ex.index]
    if not examples:
        return [{"index": r["index"], "logps": r} for r in preference[1]]
    return records
