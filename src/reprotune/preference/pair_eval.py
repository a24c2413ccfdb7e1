"""Eval of a preference run on the holdout pairs: did the preference move?

For each system (the base with the adapter disabled; the SFT adapter the run started from, when
objective.init_adapter names one; the trained adapter) and each holdout row: the summed log-probability of each
answer given the prompt, tokenized as TRL 1.16's DPOTrainer/KTOTrainer do: conversational rows with the chat
template (prompt with the generation prompt, then prompt + answer), standard (text) rows without one
(`tokenizer(text=prompt)`, `tokenizer(text=prompt + answer + eos)`: TRL appends the EOS to text answers); the
answer is what follows the common prefix of the two (for a pair, the shorter of its two common prefixes).

Paired rows (prompt, chosen, rejected; conversational or text):
    logp_accuracy     share of pairs where the chosen answer is more likely than the rejected one
    reward_accuracy   share of pairs where the implicit reward r = beta * (logp_system - logp_base) of the chosen
                      answer beats the rejected one's (DPO's reward, measured against the base for every system,
                      so the SFT and the preference adapter are on one scale; undefined for the base itself)
    reward_margin     mean r(chosen) - r(rejected)
    logp_chosen, logp_rejected   mean summed log-probabilities
Unpaired KTO rows (prompt, completion, label):
    logp_desirable, logp_undesirable   mean summed log-probability of the label-true / label-false completions
    reward_desirable, reward_undesirable   mean implicit reward r (as above) of each
    reward_accuracy   share of rows whose reward has the label's sign: a desirable completion gained
                      log-probability over the base (r > 0), an undesirable one lost it (r < 0); KTO's objective
                      pushes exactly these two ways relative to the reference
    reward_margin     reward_desirable - reward_undesirable

Reads the holdout rows, the loaded PEFT model and its tokenizer; writes nothing (reprotune.evaluate writes
metrics.json, report.md, predictions.jsonl and comparison.png).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any

from reprotune.errors import ReprotuneError
from reprotune.io import iter_jsonl

SYSTEMS = ("base", "sft", "tuned")
LABELS = {"base": "base", "sft": "SFT adapter (start)", "tuned": "preference adapter"}
PAIR_METRICS = ("reward_accuracy", "reward_margin", "logp_accuracy", "logp_chosen", "logp_rejected")
KTO_METRICS = ("reward_accuracy", "reward_margin", "reward_desirable", "reward_undesirable", "logp_desirable",
               "logp_undesirable")


def row_kind(row: Any) -> str | None:
    """'pairs' (conversational or text), 'kto' (prompt, completion, label), or None (neither)."""
    if not isinstance(row, dict):
        return None
    text = isinstance(row.get("prompt"), str)
    fits = (lambda v: isinstance(v, str)) if text else (lambda v: isinstance(v, list))
    if not fits(row.get("prompt")):
        return None
    if fits(row.get("chosen")) and fits(row.get("rejected")):
        return "pairs"
    if fits(row.get("completion")) and isinstance(row.get("label"), bool):
        return "kto"
    return None


def read_pairs(path: Path, max_pairs: int | None = None) -> list[dict[str, Any]]:
    """The holdout's rows as prepare wrote them: pairs (prompt, chosen, rejected) or KTO rows (prompt, completion,
    label), conversational (message lists) or standard (text); one kind in a file."""
    rows, kinds = [], set()
    for line, row in iter_jsonl(path, "run 'make prepare' first"):
        kind = row_kind(row)
        if kind is None:
            raise ReprotuneError(f"{path}:{line}: prompt: not a preference row (prompt with chosen and rejected, or "
                                 "with completion and a true/false label; all message lists or all text)")
        kinds.add((kind, isinstance(row["prompt"], str)))
        if len(kinds) > 1:
            raise ReprotuneError(f"{path}:{line}: prompt: mixes pairs and KTO rows, or text and messages")
        rows.append(row)
        if max_pairs and len(rows) >= max_pairs:
            break
    if not rows:
        raise ReprotuneError(f"{path}:1: file: holds no pairs")
    return rows


def export_conversations(path: Path) -> list[list[dict[str, Any]]] | list[str]:
    """A preference holdout (data/pairs/holdout.jsonl) as the export stages' parity checks read it: each row's
    prompt followed by its chosen answer (a KTO row: its completion, whatever its label), one conversation per
    row in file order; text (standard) rows as their text, prompt + answer. The parity checks compare models on
    these tokens, so which answer a row prefers does not matter, only that the model sees real task text."""
    rows = read_pairs(path)  # one kind in a file, one line per bad row (file:line: field: what)
    answer = "chosen" if "chosen" in rows[0] else "completion"
    if isinstance(rows[0]["prompt"], str):
        return [row["prompt"] + row[answer] for row in rows]
    return [[*row["prompt"], *row[answer]] for row in rows]


def tokenized(tokenizer: Any, prompt: list[dict] | str, answers: list[list[dict] | str], tools: str | None = None
              ) -> tuple[list[list[int]], int]:
    """(prompt + answer token ids for each answer, where the answers start), as TRL 1.16 tokenizes a row (its tools,
    JSON text, passed to the chat template)."""
    import json

    from trl.data_utils import common_prefix_length

    if isinstance(prompt, str):
        eos = tokenizer.eos_token or ""
        prompt_ids = tokenizer(text=prompt)["input_ids"]
        full = [tokenizer(text=prompt + (a if a.endswith(eos) else a + eos))["input_ids"] for a in answers]
    else:
        kwargs = {"tools": json.loads(tools) if tools else None, "tokenize": True, "return_dict": True}
        prompt_ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, **kwargs)["input_ids"]
        full = [tokenizer.apply_chat_template(prompt + a, **kwargs)["input_ids"] for a in answers]
    return full, min(common_prefix_length(prompt_ids, ids) for ids in full)


def completion_logp(model: Any, ids: list[int], start: int) -> float:
    """Summed log-probability of ids[start:] given ids[:start]."""
    import torch

    if start < 1 or start >= len(ids):
        raise ReprotuneError(f"eval: a preference row has {'no prompt' if start < 1 else 'an empty answer'} "
                             "after tokenization")
    tensor = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=tensor).logits[0, start - 1:-1].float()
    targets = tensor[0, start:]
    return float(torch.log_softmax(logits, dim=-1).gather(1, targets[:, None]).sum())


def answers_of(row: dict[str, Any]) -> list[Any]:
    return [row["chosen"], row["rejected"]] if "chosen" in row else [row["completion"]]


def system_logps(model: Any, tokenizer: Any, rows: list[dict], system: str) -> list[tuple[float, ...]]:
    """Per row, the log-probability of each answer (chosen, rejected; or the KTO completion) under one system."""
    if system != "base":
        model.set_adapter("sft" if system == "sft" else "default")
    context = model.disable_adapter() if system == "base" else nullcontext()
    out = []
    with context:
        for r in rows:
            full, start = tokenized(tokenizer, r["prompt"], answers_of(r), r.get("tools"))
            out.append(tuple(completion_logp(model, ids, start) for ids in full))
    return out


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def summary(logps: list[tuple[float, ...]], base: list[tuple[float, ...]] | None, beta: float) -> dict[str, float]:
    n = len(logps)
    out = {"logp_chosen": sum(c for c, _ in logps) / n, "logp_rejected": sum(r for _, r in logps) / n,
           "logp_accuracy": sum(c > r for c, r in logps) / n}
    if base is not None:
        margins = [beta * ((c - bc) - (r - br)) for (c, r), (bc, br) in zip(logps, base, strict=True)]
        out["reward_accuracy"] = sum(m > 0 for m in margins) / n
        out["reward_margin"] = sum(margins) / n
    return {k: round(v, 6) for k, v in out.items()}


def kto_summary(logps: list[tuple[float, ...]], base: list[tuple[float, ...]] | None, labels: list[bool],
                beta: float) -> dict[str, float]:
    """The KTO rows' metrics (module docstring): desirable vs undesirable completions."""
    good = [lp for (lp,), ok in zip(logps, labels, strict=True) if ok]
    bad = [lp for (lp,), ok in zip(logps, labels, strict=True) if not ok]
    out = {"logp_desirable": mean(good), "logp_undesirable": mean(bad)}
    if base is not None:
        rewards = [beta * (lp - b) for (lp,), (b,) in zip(logps, base, strict=True)]
        good_r = [r for r, ok in zip(rewards, labels, strict=True) if ok]
        bad_r = [r for r, ok in zip(rewards, labels, strict=True) if not ok]
        signs = [(r > 0) if ok else (r < 0) for r, ok in zip(rewards, labels, strict=True)]
        out["reward_accuracy"] = sum(signs) / len(signs)
        out["reward_desirable"], out["reward_undesirable"] = mean(good_r), mean(bad_r)
        out["reward_margin"] = mean(good_r) - mean(bad_r)
    return {"desirable": len(good), "undesirable": len(bad), **{k: round(v, 6) for k, v in out.items()}}


def preference_eval(model: Any, tokenizer: Any, rows: list[dict], beta: float, with_sft: bool = False
                    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(metrics per system, per-row log-probabilities) for base, the starting SFT adapter (with_sft: loaded as PEFT
    adapter "sft" next to the trained one, "default") and the trained one."""
    model.eval()
    systems = [s for s in SYSTEMS if s != "sft" or with_sft]
    logps = {s: system_logps(model, tokenizer, rows, s) for s in systems}
    model.set_adapter("default")
    paired = "chosen" in rows[0]
    labels = [bool(r.get("label")) for r in rows]
    per_system = {s: summary(logps[s], logps["base"] if s != "base" else None, beta) if paired else
                  kto_summary(logps[s], logps["base"] if s != "base" else None, labels, beta) for s in systems}
    metrics: dict[str, Any] = {"pairs" if paired else "kto_rows": len(rows), "beta": beta, **per_system}
    names = ("chosen", "rejected") if paired else ("completion",)
    records = [{"index": i, **({} if paired else {"label": labels[i]}),
                **{s: {n: round(v, 6) for n, v in zip(names, logps[s][i], strict=True)} for s in systems}}
               for i in range(len(rows))]
    return metrics, records


def cell(value: float | None, name: str) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.1f}%" if name.endswith("accuracy") else f"{value:.3f}"


def table(metrics: dict[str, Any]) -> str:
    """report.md's preference table."""
    systems = [s for s in SYSTEMS if s in metrics]
    names = PAIR_METRICS if "pairs" in metrics else KTO_METRICS
    lines = ["| metric | " + " | ".join(LABELS[s] for s in systems) + " |", "|" + "---|" * (len(systems) + 1)]
    for name in names:
        cells = [cell(metrics[s].get(name), name) for s in systems]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_axes(ax: Any, metrics: dict[str, Any]) -> None:
    """Reward and log-prob accuracy per system, in percent, on one axis of comparison.png."""
    systems = [s for s in SYSTEMS if s in metrics]
    names = ("reward_accuracy", "logp_accuracy") if "pairs" in metrics else ("reward_accuracy",)
    width = 0.8 / len(systems)
    for k, s in enumerate(systems):
        bars = ax.bar([i + k * width for i in range(len(names))], [100 * metrics[s].get(n, 0.0) for n in names],
                      width, label=LABELS[s])
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylim(0, 110)
    what = f"holdout pairs ({metrics['pairs']})" if "pairs" in metrics else f"holdout KTO rows ({metrics['kto_rows']})"
    ax.set_title(f"{what}, beta {metrics['beta']}", fontsize=9)
    ax.legend(fontsize=7)
