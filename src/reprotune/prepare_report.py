"""What prepare says about the data it prepared: near-duplicates across the split, token length
distributions and the over-length note, metrics.json's numbers, the length histogram and the printed table.

Pure functions of the prepared examples' numbers (and, for near-duplicates, of their shingles); the stage
itself (reading, scrubbing, measuring, writing) is reprotune.prepare.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


class AtLeast(int):
    """A token count known only as a lower bound (the cheap character check; see token_lengths)."""


def overlong_summary(lengths: list[int], overlong: Counter, n_examples: int, max_length: int) -> str | None:
    """More than 5% dropped for length is rarely what the user wants: say how many, how long, and the fixes."""
    if not n_examples or overlong["dropped"] <= 0.05 * n_examples:
        return None
    ordered = sorted(lengths)
    p95, p99 = (ordered[min(len(ordered) - 1, int(p * len(ordered)))] for p in (0.95, 0.99))
    if isinstance(p99, AtLeast):  # the cheap character check counted it: only a bound is known
        return (f"prepare: {overlong['dropped']} of {n_examples} examples "
                f"({100 * overlong['dropped'] / n_examples:.0f}%) dropped as longer than data.max_length="
                f"{max_length} tokens (p99 at least {p99}, not tokenized); data.overlong=truncate cuts the last "
                f"reply to fit")
    return (f"prepare: {overlong['dropped']} of {n_examples} examples ({100 * overlong['dropped'] / n_examples:.0f}%) "
            f"dropped as longer than data.max_length={max_length} tokens (p95 {p95}, p99 {p99}); keep them with "
            f"data.max_length={p99} (or {p95}; 'make plan ARGS=\"data.max_length={p99}\"' says what it costs on "
            f"each card), or data.overlong=truncate (cuts the last reply to fit)")


def rejected_bytes(rejected: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejected).encode()


# --- near-duplicates across the split ------------------------------------------------------------------------


def shingles(messages: list[dict], n: int = 3) -> frozenset[int]:
    """Word n-grams of the non-system turns (a shared system prompt says nothing about duplication), each kept
    as its hash: a third of the memory of the strings for every record, and the same Jaccard similarities
    (a 64-bit collision among one record's shingles is vanishingly rare)."""
    words = " ".join(m["content"] for m in messages if m["role"] != "system").lower().split()
    return frozenset(hash(" ".join(words[i:i + n])) for i in range(max(len(words) - n + 1, 1)))


def near_duplicates(train: Sequence[int], holdout: Sequence[int], shingles_of: Callable[[int], frozenset],
                    threshold: float, max_listed: int = 20) -> dict[str, Any]:
    """Holdout examples whose Jaccard similarity to some train example is >= threshold (they leak the answer).

    Candidates come from an inverted index over shingles, leaving out shingles common to >10% of the
    train set (templates), so the cost grows with the data, not with its square. Memory grows with the
    holdout side: the index keeps only shingles some holdout example has (no other key is ever looked up),
    and a train example's shingles are computed again only when it is among the 50 best candidates, never
    held for the whole train set. `shingles_of(i)` gives example i's shingles.
    """
    held = {i: shingles_of(i) for i in holdout}
    wanted = set().union(*held.values()) if held else set()
    index: dict[int, list[int]] = defaultdict(list)
    for i in train:
        for s in shingles_of(i):
            if s in wanted:
                index[s].append(i)
    del wanted
    common = max(10, len(train) // 10)
    shortlist = {}
    for where, sh in held.items():
        candidates = Counter(i for s in sh if len(index.get(s, ())) <= common for i in index.get(s, ()))
        shortlist[where] = [i for i, _ in candidates.most_common(50)]
    del index
    needed = sorted({i for ids in shortlist.values() for i in ids})
    train_shingles = {i: shingles_of(i) for i in needed}
    pairs = []
    for where, sh in held.items():
        best, best_where = 0.0, None
        for i in shortlist[where]:
            other = train_shingles[i]
            similarity = len(sh & other) / len(sh | other)
            if similarity > best:
                best, best_where = similarity, i
        if best >= threshold:
            pairs.append({"holdout": where, "train": best_where, "similarity": round(best, 3)})
    return {"threshold": threshold, "count": len(pairs), "pairs": pairs[:max_listed]}


# --- report --------------------------------------------------------------------------------------------------


def distribution(values: list[int]) -> dict[str, float]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def pct(p: float) -> int:
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    return {"n": len(values), "min": ordered[0], "mean": round(statistics.fmean(values), 1), "p50": pct(0.5),
            "p90": pct(0.9), "p99": pct(0.99), "max": ordered[-1], "total": sum(values)}


def prepare_metrics(report: dict[str, Any], pii_report: dict[str, Any]) -> dict[str, Any]:
    """metrics.json: the numbers of report.json and pii_report.json worth comparing between two versions of the
    data (DVC's metrics file), few enough for 'dvc metrics show' to read as a table; names, policies, package
    versions, role counts, per-entity PII counts and the near-duplicate pairs stay in the reports."""
    examples = report["examples"]
    out: dict[str, Any] = {
        "examples": {k: examples[k] for k in ("read", "duplicates_dropped", "train", "holdout", "rejected",
                                              "with_tools")},
        "overlong": {k: examples["overlong"][k] for k in ("count", "dropped", "truncated")},
        "tokens": {split: {k: v for k, v in report["tokens"][split].items() if k in ("mean", "p50", "p90", "max",
                                                                                    "total")}
                   for split in ("train", "holdout")},
        "near_duplicates": report["near_duplicates"]["count"],
    }
    if "entities" in pii_report:  # data.scrub=false: nothing was looked for, so nothing to count
        out["pii"] = {"examples_changed": pii_report["examples_changed"], "replacements": pii_report["total_replacements"]}
    return out


def plot_lengths(train: list[int], holdout: list[int], max_length: int, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    top = max([*train, *holdout, max_length])
    bins = list(range(0, top + max(top // 40, 1), max(top // 40, 1)))
    ax.hist([train, holdout], bins=bins, stacked=True, label=[f"train ({len(train)})", f"holdout ({len(holdout)})"])
    ax.axvline(max_length, color="red", linestyle="--", label=f"max_length {max_length}")
    ax.set_xlabel("tokens per example (chat template applied)")
    ax.set_ylabel("examples")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100, metadata={"Software": None})  # no version stamp: same data, same bytes
    plt.close(fig)


def print_table(report: dict[str, Any], pii: dict[str, Any]) -> None:
    ex, tok = report["examples"], report["tokens"]
    rows = [("examples read", ex["read"]), ("duplicates dropped", ex["duplicates_dropped"]),
            (f"over max_length {report['max_length']} ({ex['overlong']['policy']})",
             f"{ex['overlong']['count']} ({ex['overlong']['dropped']} dropped, {ex['overlong']['truncated']} truncated)"),
            ("train / holdout", f"{ex['train']} / {ex['holdout']}"),
            ("tokens p50 / p90 / max", f"{tok['train'].get('p50', '-')} / {tok['train'].get('p90', '-')} / "
                                       f"{max(tok['train'].get('max', 0), tok['holdout'].get('max', 0))}"),
            ("roles", ", ".join(f"{k} {v}" for k, v in report["roles"].items())),
            ("near-duplicates train~holdout", report["near_duplicates"]["count"]),
            ("PII replaced", ", ".join(f"{k} {v['replacements']}" for k, v in pii.get("entities", {}).items()
                                       if v["replacements"])
             or ("none found" if pii["scrub"] else "scrubbing off (data.scrub=false)"))]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
