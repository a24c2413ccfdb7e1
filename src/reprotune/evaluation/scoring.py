"""The task as this run scores it (type and generation budget settled from the data), each system's scores and
their summary: metrics.json and the per-example records."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from reprotune import metrics as mx
from reprotune.errors import ReprotuneError
from reprotune.evaluation.generation import SystemRun, end_of_turn_ids
from reprotune.evaluation.holdout import Example, check_references, read_holdout, read_prompt_holdout
from reprotune.models import load_tokenizer
from reprotune.run import Run

log = logging.getLogger("reprotune.evaluate")


# the room an answer gets beyond the longest training answer: tokens, and a fraction of its length
ANSWER_MARGIN, ANSWER_MARGIN_FRACTION = 16, 0.25


def answer_budget(run: Run) -> int:
    """eval.max_new_tokens auto: the longest reference answer of the train split, in the adapter's tokenizer, plus
    its end-of-turn tokens and a margin (a 10-token answer is no reason to let a rambling base run 128 tokens)."""
    train_file = run.path("prepared") / "train.jsonl"
    adapter_dir = run.path("adapter")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise ReprotuneError(f"{adapter_dir / 'adapter_config.json'}: file: not found; run 'make train' first")
    tokenizer = load_tokenizer(adapter_dir)
    # the same reader: its last assistant turn (a pair's chosen; an RL prompt's answer column) is the answer
    answers = read_prompt_holdout(train_file) if run.objective.rl else read_holdout(train_file)
    longest = max(len(tokenizer.encode(ex.reference, add_special_tokens=False)) + len(end_of_turn_ids(tokenizer, ex))
                  for ex in answers)
    return longest + max(ANSWER_MARGIN, math.ceil(ANSWER_MARGIN_FRACTION * longest))


def settle_task(cfg: DictConfig, run: Run, examples: Sequence[Example]) -> dict[str, Any]:
    """data.task and eval.max_new_tokens as this run uses them, written back into cfg (the report and the manifest
    say what was used): the task type from the reference answers (metrics.resolve_task), the generation budget from
    the training answers (answer_budget). A value set explicitly wins; a wrong one is one line naming the setting."""
    task = mx.run_task(OmegaConf.to_container(cfg.data.task, resolve=True), [ex.reference for ex in examples],
                       str(cfg.data.path), run.paths["raw"])
    check_references(examples, task)
    budget = cfg.eval.max_new_tokens
    if budget == "auto":
        budget = answer_budget(run)
    elif isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ReprotuneError(f"eval.max_new_tokens: {budget!r} is not a positive integer or auto")
    with open_dict(cfg):
        cfg.data.task = task
        cfg.eval.max_new_tokens = int(budget)
    log.info("eval: task %s (metrics %s), max_new_tokens %d", task["type"], ", ".join(mx.metric_names(task)), budget)
    return task


def summarise(run: SystemRun, scores: list[dict[str, float]], names: Sequence[str]) -> dict[str, float]:
    summary = mx.mean_scores(scores, names)
    if run.n_tokens:
        loss = sum(run.nll) / max(1, sum(run.n_tokens))
        summary["loss"] = loss
        summary["perplexity"] = math.exp(loss)
    return {k: round(v, 6) for k, v in summary.items()}


def build_metrics(summaries: dict[str, dict[str, float]], n_examples: int) -> dict[str, Any]:
    """metrics.json: per system, and the deltas that answer 'was it worth it' (DVC flattens the nesting)."""
    out: dict[str, Any] = {"examples": n_examples, **summaries}
    for other in ("base", "sft", "baseline"):
        if other in summaries:
            out[f"delta_tuned_vs_{other}"] = {k: round(summaries["tuned"][k] - v, 6)
                                             for k, v in summaries[other].items() if k in summaries["tuned"]}
    return out


def example_record(ex: Example, i: int, runs: dict[str, SystemRun], scores: dict[str, list[dict[str, float]]]
                   ) -> dict[str, Any]:
    """predictions.jsonl's line of one example: its input, reference, every system's answer, scores and loss."""
    return {
        "index": ex.index,
        "input": ex.prompt if isinstance(ex.prompt, str) else
        next((m["content"] for m in reversed(ex.prompt) if m["role"] == "user"), ""),
        "reference": ex.reference,
        "predictions": {s: run.predictions[i] for s, run in runs.items()},
        "scores": {s: {k: round(v, 6) for k, v in scores[s][i].items()} for s in runs},
        "reference_loss": {s: round(run.nll[i] / max(1, run.n_tokens[i]), 6)
                           for s, run in runs.items() if run.n_tokens},
    }


def score_runs(runs: dict[str, SystemRun], examples: Sequence[Example], task: dict[str, Any], names: Sequence[str]
               ) -> tuple[dict[str, Any], list[dict]]:
    """(metrics.json, predictions.jsonl's records) of the task pass; without examples (KTO rows without a
    reference) no task metrics."""
    if not examples:
        return {"examples": 0}, []
    scores = {s: [mx.score(p, ex.reference, task) for p, ex in zip(run.predictions, examples, strict=True)]
              for s, run in runs.items()}
    metrics = build_metrics({s: summarise(run, scores[s], names) for s, run in runs.items()}, len(examples))
    return metrics, [example_record(ex, i, runs, scores) for i, ex in enumerate(examples)]
