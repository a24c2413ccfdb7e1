"""Eval of a preference run on the holdout pairs: did the preference move?

For each system (the base with the adapter disabled; the SFT adapter the run started from, when
objective.init_adapter names one; the trained adapter) and each holdout pair: the summed log-probability of the
chosen and of the rejected answer given the prompt, tokenized as TRL's DPOTrainer does (prompt with the generation
prompt, then prompt + answer; the answer is what follows their common prefix). From those:

    logp_accuracy     share of pairs where the chosen answer is more likely than the rejected one
    reward_accuracy   share of pairs where the implicit reward r = beta * (logp_system - logp_base) of the chosen
                      answer beats the rejected one's (DPO's reward, measured against the base for every system,
                      so the SFT and the preference adapter are on one scale; undefined for the base itself)
    reward_margin     mean r(chosen) - r(rejected)
    logp_chosen, logp_rejected   mean summed log-probabilities

Reads the holdout pairs, the loaded PEFT model and its tokenizer; writes nothing (reprotune.evaluate writes
metrics.json, report.md, predictions.jsonl and comparison.png).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from reprotune.errors import ReprotuneError
from reprotune.io import iter_jsonl

SYSTEMS = ("base", "sft", "tuned")
LABELS = {"base": "base", "sft": "SFT adapter (start)", "tuned": "preference adapter"}


def read_pairs(path: Path, max_pairs: int | None = None) -> list[dict[str, Any]]:
    """The holdout's conversational pairs (prompt, chosen, rejected: lists of messages)."""
    rows = []
    for line, row in iter_jsonl(path, "run 'make prepare' first"):
        if not isinstance(row, dict) or not all(isinstance(row.get(k), list) for k in ("prompt", "chosen", "rejected")):
            raise ReprotuneError(f"{path}:{line}: chosen: the preference eval reads conversational pairs (prompt, "
                                 "chosen, rejected as message lists); text pairs and unpaired KTO rows are not "
                                 "evaluated yet")
        rows.append(row)
        if max_pairs and len(rows) >= max_pairs:
            break
    if not rows:
        raise ReprotuneError(f"{path}:1: file: holds no pairs")
    return rows


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def answer_logp(model: Any, tokenizer: Any, prompt: list[dict], answer: list[dict]) -> float:
    """Summed log-probability of the answer's tokens after the prompt (TRL's split of prompt and completion)."""
    import torch

    prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    full = tokenizer.apply_chat_template(prompt + answer, tokenize=True, return_dict=True)["input_ids"]
    start = common_prefix(prompt_ids, full)
    ids = torch.tensor([full], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, start - 1:-1].float()
    targets = ids[0, start:]
    return float(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())


def system_logps(model: Any, tokenizer: Any, rows: list[dict], system: str) -> list[tuple[float, float]]:
    """(chosen, rejected) log-probabilities of every pair under one system of the PEFT model."""
    if system != "base":
        model.set_adapter("sft" if system == "sft" else "default")
    context = model.disable_adapter() if system == "base" else nullcontext()
    with context:
        return [(answer_logp(model, tokenizer, r["prompt"], r["chosen"]),
                 answer_logp(model, tokenizer, r["prompt"], r["rejected"])) for r in rows]


def summary(logps: list[tuple[float, float]], base: list[tuple[float, float]] | None, beta: float
            ) -> dict[str, float]:
    n = len(logps)
    out = {"logp_chosen": sum(c for c, _ in logps) / n, "logp_rejected": sum(r for _, r in logps) / n,
           "logp_accuracy": sum(c > r for c, r in logps) / n}
    if base is not None:
        margins = [beta * ((c - bc) - (r - br)) for (c, r), (bc, br) in zip(logps, base, strict=True)]
        out["reward_accuracy"] = sum(m > 0 for m in margins) / n
        out["reward_margin"] = sum(margins) / n
    return {k: round(v, 6) for k, v in out.items()}


def preference_eval(model: Any, tokenizer: Any, rows: list[dict], beta: float, init_adapter: Path | None
                    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metrics per system, per-pair log-probabilities) for base, the starting SFT adapter and the trained one."""
    model.eval()
    if init_adapter is not None:
        model.load_adapter(str(init_adapter), adapter_name="sft")
    systems = [s for s in SYSTEMS if s != "sft" or init_adapter is not None]
    logps = {s: system_logps(model, tokenizer, rows, s) for s in systems}
    model.set_adapter("default")
    metrics: dict[str, Any] = {"pairs": len(rows), "beta": beta,
                               **{s: summary(logps[s], logps["base"] if s != "base" else None, beta)
                                  for s in systems}}
    records = [{"index": i, **{s: {"chosen": round(logps[s][i][0], 6), "rejected": round(logps[s][i][1], 6)}
                               for s in systems}} for i in range(len(rows))]
    return metrics, records


def cell(value: float | None, name: str) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.1f}%" if name.endswith("accuracy") else f"{value:.3f}"


def table(metrics: dict[str, Any]) -> str:
    """report.md's preference table."""
    systems = [s for s in SYSTEMS if s in metrics]
    names = ("reward_accuracy", "reward_margin", "logp_accuracy", "logp_chosen", "logp_rejected")
    lines = ["| metric | " + " | ".join(LABELS[s] for s in systems) + " |", "|" + "---|" * (len(systems) + 1)]
    for name in names:
        cells = [cell(metrics[s].get(name), name) for s in systems]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_axes(ax: Any, metrics: dict[str, Any]) -> None:
    """Reward and log-prob accuracy per system, in percent, on one axis of comparison.png."""
    systems = [s for s in SYSTEMS if s in metrics]
    names = ("reward_accuracy", "logp_accuracy")
    width = 0.8 / len(systems)
    for k, s in enumerate(systems):
        bars = ax.bar([i + k * width for i in range(len(names))], [100 * metrics[s].get(n, 0.0) for n in names],
                      width, label=LABELS[s])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylim(0, 110)
    ax.set_title(f"holdout pairs ({metrics['pairs']}), beta {metrics['beta']}", fontsize=9)
    ax.legend(fontsize=7)
