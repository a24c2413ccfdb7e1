"""Preference data prepared: what `make prepare` does when the objective is dpo, orpo or kto.

Reads   data.preference.path (default: data.path) in a preference format (reprotune.preference.formats), or,
        when it holds SFT conversations and data.preference.rejected names a generator (the built-in task: `invoices`), pairs whose last answer becomes `chosen` and a plausible wrong
        extraction (reprotune.invoices.wrong_extraction, seeded per example by data.preference.seed) `rejected`
        (SFT's last answer becomes `chosen`).
Writes  the same files as the SFT prepare (reprotune.prepare writes the manifest): train.jsonl and holdout.jsonl
        with one canonical row per line ({prompt, chosen, rejected} or KTO's {prompt, completion, label}),
        rejected.jsonl (records skipped with data.on_invalid=skip), report.json, pii_report.json, metrics.json
        (numbers only), lengths.png, train_lengths.json (each training pair's packed tokens, in train.jsonl's
        order: the plan sizes the micro-batches the run will draw from it, reprotune.sizing.draws).

Steps: read and validate (every problem at once); drop exact duplicates; report ties (chosen == rejected) and drop
or keep them (data.preference.ties); scrub PII in one pass over every pair's texts, so a value becomes the same
fake in prompt, chosen and rejected (reprotune.pii keeps one mapping per dataset); measure each sequence
(prompt + answer) with the model's chat template and drop pairs over data.max_length; split by a hash of the
prompt, so no prompt is in both train and holdout (pairs derived from SFT conversations: by the conversation's
hash, exactly as the SFT prepare splits it, so an SFT adapter never trained on a pair of the holdout). The whole dataset is in memory (no spool, unlike SFT's).
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from reprotune.errors import ReprotuneError
from reprotune.io import content_key, iter_jsonl, key_fraction, replace_all, unique_by_content
from reprotune.preference import PAIR_LENGTHS_FILE
from reprotune.preference.formats import FORMATS, PairRecord, raw_records, read_preference_data
from reprotune.run import Run

log = logging.getLogger("reprotune.preference")
ANSWERS = ("chosen", "rejected", "completion")


def settings(cfg: DictConfig) -> dict[str, Any]:
    node = cfg.data.get("preference")
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def source(cfg: DictConfig) -> Path:
    """What the preference run reads: data.preference.path, or data.path where the data config has none."""
    return Path(str(settings(cfg).get("path") or cfg.data.path))


# ------------------------------------------------------------------------------------------------ reading
def derived_pairs(cfg: DictConfig, rejected_by: str) -> list[PairRecord]:
    """Pairs from SFT conversations: the last answer is chosen, the task's wrong extraction rejected."""
    if rejected_by != "invoices":
        raise ReprotuneError(f"{source(cfg)}:0: data.preference.rejected: unknown generator {rejected_by!r} "
                             "(invoices)")
    from reprotune.invoices import wrong_extraction

    seed = int(settings(cfg).get("seed", 0))
    out = []
    for line, rec in iter_jsonl(source(cfg), "run 'make data' first"):
        conv = rec["messages"]
        rng = random.Random(f"{seed}:{content_key(conv)}")  # per example: appending data moves no old pair
        wrong = {"role": "assistant", "content": wrong_extraction(conv[-1]["content"], rng)}
        # split as the SFT prepare splits this conversation: an SFT adapter's holdout is the pairs' holdout
        out.append(PairRecord(row={"prompt": conv[:-1], "chosen": conv[-1:], "rejected": [wrong]},
                              format=f"sft+{rejected_by}", file=str(source(cfg)), line=line,
                              split_key=content_key(conv)))
    return out


def holds_conversations(path: Path) -> bool:
    """The file's first record is an SFT conversation (messages, no KTO label, no chosen/rejected: UltraFeedback
    binarized rows carry the chosen conversation as messages too): pairs are derived from it."""
    if not path.is_file():
        return False
    if path.suffix == ".json":  # a JSON list (LLaMA-Factory's .json files are indented: not one record a line)
        records = raw_records(path)
        first = records[0][1] if records else None
    else:
        first = next(iter_jsonl(path), (0, None))[1]
    return (isinstance(first, dict) and "messages" in first and "label" not in first
            and not {"chosen", "rejected"} & set(first))


def read_records(cfg: DictConfig) -> tuple[list[PairRecord], list[dict], list[str]]:
    data, pref, path = cfg.data, settings(cfg), source(cfg)
    if pref.get("rejected") and holds_conversations(path):
        return derived_pairs(cfg, str(pref["rejected"])), [], [str(path)]
    fmt = str(data.format)
    if fmt not in ("auto", *FORMATS):
        raise ReprotuneError(f"{path}:0: data.format: {fmt!r} is not a preference format (auto, "
                             f"{', '.join(FORMATS)}); objective={cfg.objective.name} trains on preference data")
    return read_preference_data(path, fmt, dict(pref.get("keys") or {}), str(data.on_invalid))


def is_tie(row: dict[str, Any]) -> bool:
    return "chosen" in row and row["chosen"] == row["rejected"]


# ------------------------------------------------------------------------------------------------ scrubbing
def as_messages(value: Any) -> list[dict[str, str]]:
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


def scrub_pairs(cfg: DictConfig, records: list[PairRecord]) -> tuple[list[dict], dict[str, Any]]:
    """Rows with PII replaced: prompt and answers of a pair are one conversation to the scrubber, and the whole
    dataset one scrub, so a value gets the same fake wherever it appears."""
    rows = [r.row for r in records]
    if not cfg.data.scrub:
        return rows, {"scrub": False}
    from reprotune.formats import Record
    from reprotune.pii import scrub_records

    parts = [[k for k in ("prompt", *ANSWERS) if k in row] for row in rows]
    flat = [Record(messages=[m for k in keys for m in as_messages(row[k])], file=r.file, line=r.line)
            for r, row, keys in zip(records, rows, parts, strict=True)]
    scrubbed, report = scrub_records(flat, cfg)
    out = []
    for row, keys, conv in zip(rows, parts, scrubbed, strict=True):
        new, at = dict(row), 0
        for k in keys:
            n = 1 if isinstance(row[k], str) else len(row[k])
            new[k] = conv[at]["content"] if isinstance(row[k], str) else conv[at:at + n]
            at += n
        out.append(new)
    return out, report


# ---------------------------------------------------------------------------------------------- lengths
def sequence_lengths(tokenizer: Any, row: dict[str, Any]) -> tuple[int, int, int]:
    """A pair's tokens as TRL renders it (with the row's tools, which the chat template writes into the prompt):
    (its longest sequence, prompt + chosen or prompt + rejected; the tokens of its packed row, the prompt once and
    both answers plus one, reprotune.preference.packed; the answers' tokens)."""
    lengths = []
    tools = json.loads(row["tools"]) if row.get("tools") else None
    if isinstance(row["prompt"], str):
        prompt = len(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
    else:
        prompt = len(tokenizer.apply_chat_template(row["prompt"], tools=tools, tokenize=True, return_dict=True,
                                                   add_generation_prompt=True)["input_ids"])
    for k in (k for k in ANSWERS if k in row):
        if isinstance(row["prompt"], str):
            lengths.append(len(tokenizer(row["prompt"] + row[k], add_special_tokens=False)["input_ids"]))
        else:
            ids = tokenizer.apply_chat_template(row["prompt"] + row[k], tools=tools, tokenize=True,
                                                return_dict=True)["input_ids"]
            lengths.append(len(ids))
    answers = sum(max(0, n - prompt) for n in lengths)
    packed = prompt + answers + (len(lengths) - 1)
    return max(lengths), packed, answers


def drops_tools(tokenizer: Any, row: dict[str, Any]) -> bool:
    """The chat template leaves out a tool of the row's tool list or a tool call of its messages (ChatML, e.g.,
    renders neither): training on it would teach answers to a prompt the model never saw."""
    tools = json.loads(row["tools"]) if row.get("tools") else None
    msgs = [m for k in ("prompt", *ANSWERS) if isinstance(row.get(k), list) for m in row[k]]
    names = [t["function"]["name"] for t in tools or []]
    calls = [c["function"] for m in msgs for c in m.get("tool_calls") or []]
    if not names and not calls:
        return False
    text = "".join(tokenizer.apply_chat_template(row["prompt"] + row[k], tools=tools, tokenize=False)
                   for k in ANSWERS if k in row)
    return any(n not in text for n in names) or any(c["name"] not in text for c in calls)


def check_tools(tokenizer: Any, records: list[PairRecord], rows: list[dict[str, Any]], cfg: DictConfig) -> None:
    lost = [r for r, row in zip(records, rows, strict=True) if drops_tools(tokenizer, row)]
    if lost:
        template = cfg.model.get("chat_template") or f"the tokenizer of {cfg.model.name}"
        raise ReprotuneError(f"{lost[0].file}:{lost[0].line}: tools: {len(lost)} record(s) use tools, but "
                             f"model.chat_template ({template}) leaves their tool list or tool calls out; set "
                             "model.chat_template=conf/chat_templates/qwen2_5_tools.jinja (or your model's own "
                             "tool-capable template)")


def load_tokenizer(cfg: DictConfig, run: Run) -> Any:
    from reprotune.models import load_tokenizer as load
    from reprotune.models import resolve_model_dir

    return load(resolve_model_dir(cfg.model, run.paths["model_cache"]), cfg.model)


# -------------------------------------------------------------------------------------------------- stage
def in_holdout(record: PairRecord, fraction: float) -> bool:
    """By the prompt alone: every pair of one prompt lands on the same side. Pairs derived from SFT conversations
    (one pair per conversation) by the conversation's key, as reprotune.prepare splits it."""
    return key_fraction(record.split_key or content_key(record.row["prompt"])) < fraction


def row_line(row: dict[str, Any]) -> bytes:
    return (json.dumps(row, ensure_ascii=False) + "\n").encode()


def lengths_bytes(packed: list[int]) -> bytes:
    """train_lengths.json: each training pair's packed tokens in train.jsonl's order, which the plan reads to
    size the micro-batches the run will draw (reprotune.sizing.draws)."""
    return (json.dumps({"unit": "tokens of the packed pair (the prompt once, both answers; "
                                "reprotune.preference.packed)", "packed_pair_tokens": packed}) + "\n").encode()


def drop_duplicates_and_ties(cfg: DictConfig, records: list[PairRecord]
                             ) -> tuple[list[PairRecord], list[PairRecord], list[PairRecord], str]:
    """(the unique records, the ties among them, those kept, data.preference.ties): a tie's two answers are the
    same, so it teaches nothing (dropped unless ties=keep)."""
    unique = unique_by_content(records)
    ties_policy = str(settings(cfg).get("ties", "drop"))
    if ties_policy not in ("drop", "keep"):
        raise ReprotuneError(f"{source(cfg)}:0: data.preference.ties: unknown policy {ties_policy!r} (drop or keep)")
    ties = [r for r in unique if is_tie(r.row)]
    kept = [r for r in unique if ties_policy == "keep" or not is_tie(r.row)]
    if not kept:
        raise ReprotuneError(f"{source(cfg)}:0: data: no preference records left ({len(records)} read, "
                             f"{len(ties)} ties dropped)")
    return unique, ties, kept, ties_policy


@dataclass
class PairSplit:
    """The pairs that fit max_length, split into train and holdout, with their lengths (train's measured whole:
    (longest sequence, packed pair tokens, answer tokens))."""
    train_rows: list[dict]
    holdout_rows: list[dict]
    train_len: list[int]
    holdout_len: list[int]
    train_measured: list[tuple]
    overlong: int


def split_pairs(cfg: DictConfig, kept: list[PairRecord], rows: list[dict], tokenizer: Any) -> PairSplit:
    """Measured in the training tokenizer, over-long pairs dropped, the rest split by the prompt as read (before
    scrubbing)."""
    data = cfg.data
    measured = [sequence_lengths(tokenizer, row) for row in rows]
    lengths = [m[0] for m in measured]
    fits = [n <= int(data.max_length) for n in lengths]
    holdout = [in_holdout(r, float(data.holdout_fraction)) for r in kept]  # the prompt as read, before scrubbing

    def part(values: list, in_holdout_part: bool) -> list:
        return [v for v, ok, h in zip(values, fits, holdout, strict=True) if ok and h == in_holdout_part]

    split = PairSplit(part(rows, False), part(rows, True), part(lengths, False), part(lengths, True),
                      part(measured, False), fits.count(False))
    if not split.train_rows:
        raise ReprotuneError(f"{source(cfg)}:0: data: no training pairs left after dedup, ties, split and length")
    return split


def pairs_report(cfg: DictConfig, records: list[PairRecord], skipped: list, unique: list[PairRecord],
                 ties: list[PairRecord], ties_policy: str, rows: list[dict], split: PairSplit) -> dict[str, Any]:
    """report.json of the prepared pairs: inputs, what was dropped and why, the split, the token lengths."""
    from reprotune.prepare_report import distribution

    data, pref = cfg.data, settings(cfg)
    packed_train = [m[1] for m in split.train_measured]
    return {
        "objective": str(cfg.objective.name),
        "inputs": [{"file": f, "format": fmt, "records": n} for (f, fmt), n in
                   sorted(Counter((r.file, r.format) for r in records).items())],
        "holdout_fraction": float(data.holdout_fraction), "max_length": int(data.max_length),
        "split_key": "conversation (as the SFT prepare)" if pref.get("rejected") and records and
        records[0].split_key else "prompt",
        "pairs": {"read": len(records) + len(skipped), "skipped_invalid": len(skipped),
                  "duplicates_dropped": len(records) - len(unique),
                  "ties": {"policy": ties_policy, "count": len(ties),
                           "dropped": len(ties) if ties_policy == "drop" else 0,
                           "where": [f"{r.file}:{r.line}" for r in ties[:20]]},
                  "overlong": {"policy": "drop", "dropped": split.overlong},
                  "train": len(split.train_rows), "holdout": len(split.holdout_rows),
                  "paired": all("chosen" in row for row in rows)},
        "tokens": {"model": str(cfg.model.name), "longest_sequence_of_pair": True,
                   "train": distribution(split.train_len), "holdout": distribution(split.holdout_len),
                   # what a packed DPO micro-batch holds per pair (the plan's unit): the prompt once, both answers
                   "packed_pair_train": distribution(packed_train),
                   "answer_share_train": round(sum(m[2] for m in split.train_measured) / max(1, sum(packed_train)),
                                               4)},
        "scrub": bool(data.scrub),
    }


def prepare_pairs(cfg: DictConfig, run: Run, work: Path) -> dict[str, Any]:
    """The pairs read, cleaned, scrubbed, measured and split into the Run's paths.prepared; every output but the
    manifest written at once."""
    from reprotune.prepare_report import plot_lengths, rejected_bytes

    out = run.path("prepared")
    records, skipped, files = read_records(cfg)
    unique, ties, kept, ties_policy = drop_duplicates_and_ties(cfg, records)
    rows, pii_report = scrub_pairs(cfg, kept)
    tokenizer = load_tokenizer(cfg, run)
    check_tools(tokenizer, kept, rows, cfg)
    split = split_pairs(cfg, kept, rows, tokenizer)
    report = pairs_report(cfg, records, skipped, unique, ties, ties_policy, rows, split)
    metrics = {"pairs_train": len(split.train_rows), "pairs_holdout": len(split.holdout_rows), "ties": len(ties),
               "duplicates_dropped": report["pairs"]["duplicates_dropped"], "overlong_dropped": split.overlong,
               "skipped_invalid": len(skipped), "tokens_train_mean": report["tokens"]["train"].get("mean", 0),
               "pii_replacements": sum(v.get("replacements", 0) for v in pii_report.get("entities", {}).values())}
    plot_tmp = work / "lengths.png"
    plot_lengths(split.train_len, split.holdout_len, int(cfg.data.max_length), plot_tmp)
    replace_all({
        out / "train.jsonl": b"".join(row_line(r) for r in split.train_rows),
        out / "holdout.jsonl": b"".join(row_line(r) for r in split.holdout_rows),
        out / "rejected.jsonl": rejected_bytes(skipped),
        out / "report.json": (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode(),
        out / "pii_report.json": (json.dumps(pii_report, indent=2, sort_keys=True) + "\n").encode(),
        out / "metrics.json": (json.dumps(metrics, indent=2, sort_keys=True) + "\n").encode(),
        out / PAIR_LENGTHS_FILE: lengths_bytes([m[1] for m in split.train_measured]),
        out / "lengths.png": plot_tmp,
    })
    log.info("pairs: %s", {k: v for k, v in report["pairs"].items() if k != "ties"} | {"ties": len(ties)})
    return {"train": len(split.train_rows), "holdout": len(split.holdout_rows), "report": report, "pii": pii_report}
