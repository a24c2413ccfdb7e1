"""Eval stage: the holdout through the base model and the fine-tuned one, side by side.

    python -m reprotune.evaluate [hydra overrides]      # == make eval ARGS="..."

"Before shutting the machine down, run your held-out examples through the base model and the tuned one
and compare them side by side." Optionally also through a prompt-only baseline (any OpenAI-compatible
endpoint, eval.baseline.url): if a well-prompted base model is almost as good, fine-tuning was not needed.

Reads  data/prepared/holdout.jsonl, the base model, outputs/adapter/ (PEFT adapter, tokenizer, chat template).
Writes outputs/eval/metrics.json (deterministic: no timings), predictions.jsonl (every example, every
       system), report.md (summary table, then the examples where base and tuned differ, worst regressions
       first), comparison.png (per-metric bars) and manifest.json (provenance and timings).
       All five are written into <eval_dir>.tmp and renamed in together (write_outputs): one set or the old one.

Both local systems use one loaded model (the adapter switched off for the base pass), one tokenizer, the
adapter's chat template, greedy decoding and the same generation settings, batched with left padding.

Read top to bottom: settings -> data -> the systems' passes -> score -> record -> report. The parts are
reprotune.evaluation's: holdout, generation, baseline, scoring, report, preference_pass.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from reprotune import metrics as mx
from reprotune.config import CONF_DIR
from reprotune.errors import user_errors
from reprotune.evaluation.baseline import run_baseline
from reprotune.evaluation.generation import SystemRun, load_model_and_tokenizer, run_local
from reprotune.evaluation.holdout import Example, read_holdout, read_prompt_holdout
from reprotune.evaluation.preference_pass import (
    add_preference,
    load_start_adapter,
    preference_holdout,
    preference_pass,
    task_pass_note,
)
from reprotune.evaluation.report import SYSTEMS, write_outputs
from reprotune.evaluation.scoring import score_runs, settle_task
from reprotune.objectives import Objective
from reprotune.run import Run, resolve
from reprotune.runtime import set_reproducibility

log = logging.getLogger("reprotune.evaluate")

# ------------------------------------------------------------------------------------------------- data
def read_inputs(cfg: DictConfig, obj: Objective, holdout: Path) -> tuple[list[dict], list[Example]]:
    """(a preference holdout's rows, the examples of the task pass): an SFT holdout has no rows."""
    if obj.preference:
        return preference_holdout(cfg, holdout)
    if obj.rl:  # the holdout prompts and their reference answers: base, the SFT adapter it started from, RL's
        return [], read_prompt_holdout(holdout, cfg.eval.max_examples)
    return [], read_holdout(holdout, cfg.eval.max_examples)


# ----------------------------------------------------------------------------------------------- passes
def run_systems(cfg: DictConfig, resolved: Run, examples: list[Example], rows: list[dict]
                ) -> tuple[dict[str, SystemRun], str, tuple[dict[str, Any], list[dict]] | None]:
    """Every system's task pass (the prompt baseline, base, the SFT start adapter, tuned), in SYSTEMS order, and
    a preference run's pairs' pass, on the Run's device with its batch size. Returns (runs, the base model's
    directory, the pairs' pass or None)."""
    import torch

    device, batch_size = str(resolved.device), int(resolved.eval_batch_size or 1)
    runs: dict[str, SystemRun] = {}
    if cfg.eval.baseline.url and examples:  # first: a wrong URL or key fails in seconds, before the local passes
        runs["baseline"] = run_baseline(cfg, examples)
    model, tokenizer, model_dir = load_model_and_tokenizer(cfg, resolved)
    with_sft = load_start_adapter(cfg, model)
    model.eval()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if examples:
        runs["base"] = run_local(model, tokenizer, examples, "base", cfg, batch_size, adapter=None)
        if with_sft:  # did the preference step beat the adapter it started from, on the task itself?
            runs["sft"] = run_local(model, tokenizer, examples, "sft", cfg, batch_size, adapter="sft")
        runs["tuned"] = run_local(model, tokenizer, examples, "tuned", cfg, batch_size, adapter="default")
    runs = {s: runs[s] for s in SYSTEMS if s in runs}
    preference = preference_pass(cfg, model, tokenizer, rows, with_sft) if rows else None
    return runs, model_dir, preference


# ------------------------------------------------------------------------------------------------ record
def timing_record(started: float, runs: dict[str, SystemRun], n_examples: int, device: str) -> dict[str, Any]:
    import torch

    return {"wall_seconds": round(time.time() - started, 2),
            **{s: {"seconds": round(run.seconds, 2),
                   "examples_per_second": round(n_examples / run.seconds, 3) if run.seconds else None,
                   "new_tokens_per_second": round(sum(run.new_tokens) / run.seconds, 1)
                   if run.seconds else None}
               for s, run in runs.items()},
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if device == "cuda" else None}


def eval_record(cfg: DictConfig, resolved: Run, holdout: Path, n_examples: int, model_dir: str, runs: dict[str, SystemRun],
                note: str | None, settings: dict[str, Any], timing: dict[str, Any]) -> dict[str, Any]:
    """outputs/eval/manifest.json: provenance, the run's settings (device, dtype, batch size), inputs, timings."""
    from reprotune import manifest as mf

    out_dir, root = resolved.path("eval_dir"), resolved.path("root")
    return mf.stage_record("eval", cfg, out_dir / "manifest.json", root, **{
        "seeds": mf.seeds_record(cfg, resolved),
        **settings,
        "inputs": {"holdout": {**mf.path_record(holdout, root), "examples": n_examples},
                   "adapter": mf.path_record(resolved.path("adapter"), root),
                   "base_model": mf.base_model_record(model_dir)},
        "baseline": {"url": cfg.eval.baseline.url, "model": cfg.eval.baseline.model} if "baseline" in runs else None,
        **({"task_pass": note} if note else {}),
        "timing": timing,
    })


# --------------------------------------------------------------------------------------------------- main
def evaluate(cfg: DictConfig, resolved: Run | None = None) -> dict[str, Any]:
    """resolved: the stage's Run (main resolves it first; a caller without one: resolve(cfg, "eval")): the
    objective, device, dtype and generation batch size."""
    started = time.time()
    resolved = resolved if resolved is not None else resolve(cfg, "eval")
    device, dtype, batch_size = str(resolved.device), str(resolved.dtype), int(resolved.eval_batch_size or 1)
    set_reproducibility(cfg, resolved)

    holdout = resolved.path("prepared") / "holdout.jsonl"
    rows, examples = read_inputs(cfg, resolved.objective, holdout)
    task = settle_task(cfg, resolved, examples)  # data.task.type auto, eval.max_new_tokens auto: from the data
    log.info("eval: %d holdout examples, device=%s dtype=%s batch_size=%d", len(examples), device, dtype,
             batch_size)
    runs, model_dir, preference = run_systems(cfg, resolved, examples, rows)

    names = mx.metric_names(task)
    primary = mx.primary_metric(task)
    metrics, records = score_runs(runs, examples, task, names)
    note = task_pass_note(rows, len(examples)) if rows else None
    if preference:  # the pairs' metrics next to the task's; each example's log-probabilities with it
        records = add_preference(metrics, records, examples, preference)

    out_dir = resolved.path("eval_dir")
    record = eval_record(cfg, resolved, holdout, len(examples), model_dir, runs, note,
                         {"device": device, "dtype": dtype, "batch_size": batch_size},
                         timing_record(started, runs, len(examples), device))
    table = write_outputs(out_dir, resolved.path("root"), cfg, metrics, records, names, primary, record, note)
    print(f"\n{table}\n\nreport: {out_dir / 'report.md'}   predictions: {out_dir / 'predictions.jsonl'}")
    log.info("eval done in %.1fs (%s)", record["timing"]["wall_seconds"],
             ", ".join(f"{s} {run.seconds:.1f}s" for s, run in runs.items()) or "preference metrics only")
    return {"metrics": metrics, "manifest": record}


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run = resolve(cfg, "eval")
        evaluate(cfg, run)


if __name__ == "__main__":
    main()
