"""Prepare stage: turn a user's dataset into clean, private, versioned train/holdout sets.

    python -m reprotune.prepare [hydra overrides]          e.g. data.path=my_chats.jsonl data.format=sharegpt
    make prepare ARGS="data.path=<file or folder>"

Reads   data.path (a file or a folder of .jsonl/.json files) in any supported format (reprotune.formats)
Writes  data/prepared/train.jsonl, holdout.jsonl    one {"messages": [...]} per line (what train/eval read)
        data/prepared/report.json                   counts, token lengths, roles, near-duplicates
        data/prepared/pii_report.json               PII found per entity type (counts only, never values)
        data/prepared/lengths.png                   token length histogram against data.max_length

Steps, top to bottom: read and validate every file (all problems reported at once, nothing written on bad
input); drop exact duplicates; assign each example to train or holdout by a hash of its content (so
appending data never moves an old example); scrub PII with consistent fakes (reprotune.pii); measure token
lengths with the model's tokenizer and chat template and apply the over-length policy; report
near-duplicates across the split; write every output to a temporary file and rename them all at the end.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from reprotune.config import CONF_DIR
from reprotune.errors import ReprotuneError, user_errors
from reprotune.formats import Record, read_dataset
from reprotune.io import content_key, key_fraction, replace_all

log = logging.getLogger("reprotune.prepare")


# --- split ---------------------------------------------------------------------------------------------------


def example_key(example: dict) -> str:
    """Content hash of an example (its messages, as read, before scrubbing): identity for dedup and split."""
    return content_key(example["messages"])


def in_holdout(example: dict, fraction: float) -> bool:
    """Holdout membership depends on the example alone, never on its neighbours or a shuffle."""
    return key_fraction(example_key(example)) < fraction


def drop_duplicates(records: list[Record]) -> tuple[list[Record], int]:
    seen, kept = set(), []
    for record in records:
        key = example_key({"messages": record.messages})
        if key not in seen:
            seen.add(key)
            kept.append(record)
    return kept, len(records) - len(kept)


# --- scrubbing -----------------------------------------------------------------------------------------------


def scrub(records: list[Record], cfg: DictConfig) -> tuple[list[list[dict]], dict[str, Any]]:
    """Scrubbed messages per record and the PII report (counts only)."""
    from tqdm import tqdm

    from reprotune.pii import Scrubber, ScrubberUnavailable, detector_info

    pii = cfg.data.pii
    try:
        scrubber = Scrubber(seed=int(pii.seed), entities=list(pii.entities), names=bool(pii.names),
                            ner_model=str(pii.ner_model), phone_regions=list(pii.phone_regions))
    except (ScrubberUnavailable, ValueError) as err:
        raise ReprotuneError([f"{cfg.data.path}:0: data.pii: {err}"]) from err
    progress = lambda texts: tqdm(texts, desc="scrubbing PII", unit="text", leave=False,  # noqa: E731
                                  disable=None, mininterval=2)
    messages, report = scrubber.scrub([r.messages for r in records], progress=progress)
    return messages, {"scrub": True, **report.as_dict(), "detector": detector_info(scrubber)}


# --- token lengths -------------------------------------------------------------------------------------------


def load_tokenizer(cfg: DictConfig) -> Any:
    """The model's tokenizer with the chat template training uses (model.chat_template overrides it)."""
    from reprotune.models import load_tokenizer as load
    from reprotune.models import resolve_model_dir

    return load(resolve_model_dir(cfg.model, cfg.paths.model_cache), cfg.model)


def token_lengths(tokenizer: Any, conversations: list[list[dict]]) -> list[int]:
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def truncate_last_reply(tokenizer: Any, messages: list[dict], max_length: int) -> list[dict] | None:
    """Shorten the final assistant reply so the whole conversation fits; None when the prompt alone does not."""
    reply = messages[-1]["content"]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    overhead = token_lengths(tokenizer, [messages])[0] - len(reply_ids)
    budget = max_length - overhead
    while budget > 0:
        candidate = [*messages[:-1], {"role": "assistant", "content": tokenizer.decode(reply_ids[:budget])}]
        if candidate[-1]["content"].strip() and token_lengths(tokenizer, [candidate])[0] <= max_length:
            return candidate
        budget -= 1  # re-tokenising a cut can merge differently; step back until it fits
    return None


def apply_length_policy(tokenizer: Any, conversations: list[list[dict]], lengths: list[int], max_length: int,
                        policy: str) -> tuple[list[list[dict] | None], list[int], Counter]:
    """Over-long examples are dropped (policy drop) or have their last reply cut to fit (policy truncate)."""
    if policy not in ("drop", "truncate"):
        raise ReprotuneError([f"data.overlong: unknown policy {policy!r} (drop or truncate)"])
    counts: Counter = Counter()
    out, out_lengths = [], []
    for conv, n in zip(conversations, lengths, strict=True):
        if n <= max_length:
            out.append(conv)
            out_lengths.append(n)
            continue
        counts["overlong"] += 1
        cut = truncate_last_reply(tokenizer, conv, max_length) if policy == "truncate" else None
        if cut is None:
            counts["dropped"] += 1
            out.append(None)
            out_lengths.append(n)
        else:
            counts["truncated"] += 1
            out.append(cut)
            out_lengths.append(token_lengths(tokenizer, [cut])[0])
    return out, out_lengths, counts


# --- near-duplicates across the split ------------------------------------------------------------------------


def shingles(messages: list[dict], n: int = 3) -> frozenset[str]:
    """Word n-grams of the non-system turns (a shared system prompt says nothing about duplication)."""
    words = " ".join(m["content"] for m in messages if m["role"] != "system").lower().split()
    return frozenset(" ".join(words[i:i + n]) for i in range(max(len(words) - n + 1, 1)))


def near_duplicates(train: list[tuple[str, frozenset]], holdout: list[tuple[str, frozenset]],
                    threshold: float, max_listed: int = 20) -> dict[str, Any]:
    """Holdout examples whose Jaccard similarity to some train example is >= threshold (they leak the answer).

    Candidates come from an inverted index over shingles, leaving out shingles common to >10% of the
    train set (templates), so the cost grows with the data, not with its square.
    """
    index: dict[str, list[int]] = defaultdict(list)
    for i, (_, sh) in enumerate(train):
        for s in sh:
            index[s].append(i)
    common = max(10, len(train) // 10)
    pairs = []
    for where, sh in holdout:
        candidates = Counter(i for s in sh if len(index.get(s, ())) <= common for i in index.get(s, ()))
        best, best_where = 0.0, None
        for i, _ in candidates.most_common(50):
            other = train[i][1]
            similarity = len(sh & other) / len(sh | other)
            if similarity > best:
                best, best_where = similarity, train[i][0]
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


def relative(path: str, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


# --- output --------------------------------------------------------------------------------------------------


def jsonl_bytes(conversations: list[list[dict]]) -> bytes:
    return "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in conversations).encode()


# --- the stage -----------------------------------------------------------------------------------------------


def write_manifest(cfg: DictConfig, out: Path) -> None:
    """Inputs and outputs with their hashes, so 'make verify' can re-run and compare this stage."""
    from omegaconf import OmegaConf

    from reprotune import manifest as mf

    root = Path(cfg.paths.root)
    record = mf.base_manifest("prepare", OmegaConf.to_container(cfg, resolve=True))
    record.update({
        "manifest_path": os.path.relpath(out / "manifest.json", root),
        "inputs": {"raw_data": mf.path_record(Path(cfg.data.path), root)},
        "outputs": {name: mf.path_record(out / file, root) for name, file in
                    (("train", "train.jsonl"), ("holdout", "holdout.jsonl"), ("report", "report.json"),
                     ("pii_report", "pii_report.json"), ("lengths_plot", "lengths.png"))},
    })
    mf.write_json(out / "manifest.json", record)


def prepare(cfg: DictConfig) -> dict:
    started = time.perf_counter()
    data, out = cfg.data, Path(cfg.paths.prepared)
    root = Path(cfg.paths.root)

    files = read_dataset(Path(data.path), str(data.format))
    records = [r for f in files for r in f.records]
    log.info("read %d examples from %d file(s) (%s)", len(records), len(files),
             ", ".join(sorted({f.format for f in files if f.format})))
    records, n_duplicates = drop_duplicates(records)
    holdout_flags = [in_holdout({"messages": r.messages}, float(data.holdout_fraction)) for r in records]

    if data.scrub:
        conversations, pii_report = scrub(records, cfg)
    else:
        conversations, pii_report = [r.messages for r in records], {"scrub": False}
    log.info("PII: %s", {k: v["replacements"] for k, v in pii_report.get("entities", {}).items()} or "none")

    tokenizer = load_tokenizer(cfg)
    lengths = token_lengths(tokenizer, conversations)
    conversations, lengths, overlong = apply_length_policy(tokenizer, conversations, lengths,
                                                           int(data.max_length), str(data.overlong))
    keep = [c is not None for c in conversations]
    train_idx = [i for i in range(len(records)) if keep[i] and not holdout_flags[i]]
    holdout_idx = [i for i in range(len(records)) if keep[i] and holdout_flags[i]]

    where = [f"{relative(r.file, root)}:{r.line}" for r in records]
    sh = [shingles(c) if c is not None else frozenset() for c in conversations]
    near = near_duplicates([(where[i], sh[i]) for i in train_idx], [(where[i], sh[i]) for i in holdout_idx],
                           float(data.near_duplicate_threshold))
    roles = Counter(m["role"] for i in train_idx + holdout_idx for m in conversations[i])
    report = {
        "inputs": [{"file": relative(f.path, root), "format": f.format, "examples": len(f.records),
                    "sha256": hashlib.sha256(Path(f.path).read_bytes()).hexdigest()} for f in files],
        "holdout_fraction": float(data.holdout_fraction),
        "max_length": int(data.max_length),
        "examples": {
            "read": len(records) + n_duplicates, "duplicates_dropped": n_duplicates,
            "overlong": {"policy": str(data.overlong), "count": overlong["overlong"],
                         "dropped": overlong["dropped"], "truncated": overlong["truncated"]},
            "train": len(train_idx), "holdout": len(holdout_idx),
        },
        "tokens": {
            "model": str(cfg.model.name),
            "chat_template": str(cfg.model.chat_template) if cfg.model.chat_template else "tokenizer",
            "train": distribution([lengths[i] for i in train_idx]),
            "holdout": distribution([lengths[i] for i in holdout_idx]),
        },
        "roles": {r: roles[r] for r in ("system", "user", "assistant")},
        "near_duplicates": near,
        "scrub": bool(data.scrub),
    }
    if not train_idx:
        raise ReprotuneError([f"{data.path}:0: data: no training examples left after dedup, split and length policy "
                         f"({report['examples']})"])

    out.mkdir(parents=True, exist_ok=True)
    plot_tmp = out / "lengths.png.staging.png"
    plot_lengths([lengths[i] for i in train_idx], [lengths[i] for i in holdout_idx], int(data.max_length), plot_tmp)
    replace_all({
        out / "train.jsonl": jsonl_bytes([conversations[i] for i in train_idx]),
        out / "holdout.jsonl": jsonl_bytes([conversations[i] for i in holdout_idx]),
        out / "report.json": (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode(),
        out / "pii_report.json": (json.dumps(pii_report, indent=2, sort_keys=True) + "\n").encode(),
        out / "lengths.png": plot_tmp,
    })
    write_manifest(cfg, out)
    print_table(report, pii_report)
    log.info("prepared %d train and %d holdout examples in %s (%.1f s)", len(train_idx), len(holdout_idx), out,
             time.perf_counter() - started)
    return {"train": len(train_idx), "holdout": len(holdout_idx), "report": report, "pii": pii_report}


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    # one line per problem, no traceback: the user fixes the data, not our code
    with user_errors(summary=f"prepare: {{count}} problem(s); nothing written to {cfg.paths.prepared}"):
        prepare(cfg)


if __name__ == "__main__":
    main()
