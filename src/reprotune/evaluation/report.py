"""The eval outputs, written as one set: metrics.json, predictions.jsonl, report.md (summary table, then the examples
where base and tuned differ, worst regressions first), comparison.png, and the manifest hashing them."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from reprotune.io import atomic_write_text, fresh_dir, jsonl_text, replace_all, save_figure
from reprotune.preference import pair_eval

SYSTEM_LABELS = {"base": "base", "sft": "SFT adapter (start)", "tuned": "tuned", "baseline": "prompt baseline"}
# the order of the systems in metrics.json, report.md and comparison.png (sft: a preference run's start adapter)
SYSTEMS = ("base", "sft", "tuned", "baseline")
LOWER_IS_BETTER = {"loss", "perplexity"}
OUTPUT_FILES = {"metrics": "metrics.json", "predictions": "predictions.jsonl", "report": "report.md",
                "comparison_plot": "comparison.png"}
MANIFEST_FILE = "manifest.json"


def _fmt(value: float | None, name: str) -> str:
    if value is None:
        return "–"
    return f"{value:.3f}" if name in LOWER_IS_BETTER else f"{100 * value:.1f}%"


def _fmt_delta(value: float | None, name: str) -> str:
    if value is None:
        return "–"
    return f"{value:+.3f}" if name in LOWER_IS_BETTER else f"{100 * value:+.1f} pp"


def summary_table(metrics: dict[str, Any], names: Sequence[str]) -> str:
    systems = [s for s in SYSTEMS if s in metrics]
    others = [s for s in ("base", "sft", "baseline") if s in systems]
    header = ["metric", *(SYSTEM_LABELS[s] for s in systems), *(f"Δ tuned − {SYSTEM_LABELS[s]}" for s in others)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in [*names, "loss", "perplexity"]:
        if not any(name in metrics[s] for s in systems):
            continue
        label = f"{name} (lower is better)" if name in LOWER_IS_BETTER else name
        cells = [label, *(_fmt(metrics[s].get(name), name) for s in systems),
                 *(_fmt_delta(metrics[f"delta_tuned_vs_{s}"].get(name), name) for s in others)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(text: str, limit: int = 400) -> str:
    text = text if len(text) <= limit else text[:limit] + " …"
    return "<code>" + (text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
                       .replace("|", "&#124;").replace("\n", "<br>")) + "</code>"


def differing_examples(records: list[dict], primary: str, limit: int) -> list[dict]:
    """Examples where base and tuned answer differently, worst regression (tuned − base) first."""
    differ = [r for r in records if r["predictions"]["base"] != r["predictions"]["tuned"]]
    differ.sort(key=lambda r: (r["scores"]["tuned"][primary] - r["scores"]["base"][primary], r["index"]))
    return differ[:limit]


def write_report(path: Path, cfg: DictConfig, metrics: dict[str, Any], records: list[dict],
                 names: Sequence[str], primary: str, note: str | None = None) -> str:
    systems = [s for s in SYSTEMS if s in metrics]
    table = summary_table(metrics, names)
    n_differ = sum(r["predictions"]["base"] != r["predictions"]["tuned"] for r in records)
    limit = int(cfg.eval.report_examples)
    shown = differing_examples(records, primary, limit)
    parts = [
        f"# Evaluation: {cfg.model.name} base vs + adapter on the {cfg.data.name} holdout",
        "",
        f"{metrics['examples']} holdout examples; greedy decoding, max {cfg.eval.max_new_tokens} new tokens, "
        f"the adapter's chat template. Task type `{cfg.data.task.type}`; the examples below are ranked by "
        f"`{primary}`.",
        "",
        table,
        "",
        *([note, ""] if note else []),
        *([f"## Holdout {'pairs' if 'pairs' in metrics['preference'] else 'KTO rows'} (objective "
           f"{cfg.objective.name}): implicit reward against the base", "",
           pair_eval.table(metrics["preference"]), ""] if "preference" in metrics else []),
        f"## Where base and tuned differ ({n_differ} of {metrics['examples']}; "
        f"{len(shown)} shown, worst regressions first)",
        "",
    ]
    for r in shown:
        s = r["scores"]
        delta = s["tuned"][primary] - s["base"][primary]
        parts += [f"### Example {r['index'] + 1}: {primary} {_fmt(s['base'][primary], primary)} → "
                  f"{_fmt(s['tuned'][primary], primary)} ({_fmt_delta(delta, primary)})", "",
                  "Input: " + _cell(r["input"], 600), "",
                  "| reference | " + " | ".join(SYSTEM_LABELS[x] for x in systems) + " |",
                  "|---|" + "---|" * len(systems),
                  "| " + " | ".join([_cell(r["reference"]), *(_cell(r["predictions"][x]) for x in systems)]) + " |",
                  ""]
    text = "\n".join(parts) + "\n"
    atomic_write_text(path, text)
    return table


def plot_comparison(metrics: dict[str, Any], names: Sequence[str], out: Path) -> None:
    """Grouped bars: rate metrics in percent; loss and perplexity (lower is better) on their own axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = [s for s in SYSTEMS if s in metrics]
    rates = [n for n in names if not n.startswith("field/")]
    losses = [n for n in ("loss", "perplexity") if n in metrics["base"]]
    pairs = [2] if "preference" in metrics else []  # a preference run: reward and log-prob accuracy of pairs
    fig, axes = plt.subplots(1, 1 + len(losses) + len(pairs),
                             figsize=(3 + 1.1 * len(rates) + 2 * len(losses) + 3 * len(pairs), 4), dpi=100,
                             gridspec_kw={"width_ratios": [max(2, len(rates)), *([1] * len(losses)), *pairs]},
                             squeeze=False)
    if pairs:
        pair_eval.plot_axes(axes[0][-1], metrics["preference"])
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        values = [100 * metrics[system].get(n, 0.0) for n in rates]
        bars = axes[0][0].bar([i + k * width for i in range(len(rates))], values, width,
                              label=SYSTEM_LABELS[system])
        axes[0][0].bar_label(bars, fmt="%.0f", fontsize=7)
    axes[0][0].set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(rates))], rates, rotation=20,
                          ha="right")
    axes[0][0].set_ylabel("% of holdout examples (higher is better)")
    axes[0][0].set_ylim(0, 110)
    axes[0][0].legend(fontsize=8)
    for ax, name in zip(axes[0][1:1 + len(losses)], losses, strict=True):
        present = [s for s in systems if name in metrics[s]]
        ax.bar([SYSTEM_LABELS[s] for s in present], [metrics[s][name] for s in present],
               color=[f"C{systems.index(s)}" for s in present])
        ax.set_title(f"{name} (lower is better)", fontsize=9)
    for ax in axes[0]:
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


def write_predictions(path: Path, records: list[dict]) -> None:
    atomic_write_text(path, jsonl_text(records, sort_keys=True))


def write_outputs(out_dir: Path, root: Path, cfg: DictConfig, metrics: dict[str, Any], records: list[dict],
                  names: Sequence[str], primary: str, record: dict[str, Any], note: str | None = None) -> str:
    """Every output file, as one set: all are written into `<eval_dir>.tmp` first and renamed over the
    previous ones only once the last (the manifest, with their hashes) is there, so a failure or a kill while
    writing leaves the previous set byte for byte. DVC's declared paths stay the single files in eval_dir.
    Returns the summary table."""
    from reprotune import manifest as mf

    staged = fresh_dir(out_dir)
    write_predictions(staged / OUTPUT_FILES["predictions"], records)
    mf.write_json(staged / OUTPUT_FILES["metrics"], metrics)  # deterministic: timings go to the manifest
    if metrics["examples"]:
        table = write_report(staged / OUTPUT_FILES["report"], cfg, metrics, records, names, primary, note)
        plot_comparison(metrics, names, staged / OUTPUT_FILES["comparison_plot"])
    else:  # a preference holdout without a task pass
        table = write_preference_report(staged / OUTPUT_FILES["report"], cfg, metrics, note or "")
        plot_preference(metrics, staged / OUTPUT_FILES["comparison_plot"])
    # recorded under the paths they will have, hashed where they are now (the rename keeps the bytes)
    record["outputs"] = {key: {"path": Path(os.path.relpath(out_dir / name, root)).as_posix(),
                               "sha256": mf.sha256_file(staged / name)}
                         for key, name in OUTPUT_FILES.items()}
    mf.write_json(staged / MANIFEST_FILE, record)
    names_in_set = [*OUTPUT_FILES.values(), MANIFEST_FILE]
    replace_all({out_dir / name: staged / name for name in names_in_set})
    staged.rmdir()
    return table


def write_preference_report(path: Path, cfg: DictConfig, metrics: dict[str, Any], note: str) -> str:
    """report.md of a preference holdout without a task pass: the preference table and why the task is skipped."""
    what = "pairs" if "pairs" in metrics["preference"] else "KTO rows"
    table = pair_eval.table(metrics["preference"])
    text = "\n".join([f"# Evaluation: {cfg.model.name} base vs + adapter on the {cfg.data.name} holdout", "", note, "",
                      f"## Holdout {what} (objective {cfg.objective.name}): implicit reward against the base", "",
                      table, ""]) + "\n"
    atomic_write_text(path, text)
    return table


def plot_preference(metrics: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4), dpi=100)
    pair_eval.plot_axes(ax, metrics["preference"])
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)
