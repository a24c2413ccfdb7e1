"""GRPO's prompts prepared: what `make prepare ARGS="objective=grpo"` does (reprotune.prepare calls
`prepare_prompts` when the objective is an RL one).

Reads   data.prompts.path (default: data.path). SFT conversations (the built-in invoices, or a user's chat data):
        each conversation's turns before its last answer are the prompt, the last answer its reference (column
        `answer`). Else TRL's prompt-only formats, one record a line: standard {"prompt": "text", ...} or
        conversational {"prompt": [{"role": "user", "content": "..."}], ...}; every other key is a reference
        column the rewards read (e.g. `answer`, `solution`). data.prompts.keys maps other names onto these
        ({prompt: question}).
Writes  paths.prepared (data/prompts): train.jsonl and holdout.jsonl (one {prompt, <columns>} row a line),
        report.json, pii_report.json, metrics.json (numbers only); reprotune.prepare writes the manifest.

Steps: read and validate (every bad record one `file:line: field: problem`, all at once); drop exact duplicates;
scrub PII with one scrubber pass over each row's prompt and its text references together, so a value becomes the
same fake in both (reprotune.pii); split by a hash of the prompt as read (SFT conversations: by the conversation's
hash, exactly as the SFT prepare splits it, so the SFT adapter never trained on a holdout prompt).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from reprotune.errors import ReprotuneError
from reprotune.io import content_key, iter_jsonl, key_fraction, replace_all, unique_by_content
from reprotune.run import Run

log = logging.getLogger("reprotune.rl")
ROLES = ("system", "user", "assistant", "tool")
SFT_REFERENCE = "answer"  # the column an SFT conversation's last answer becomes


@dataclass(frozen=True)
class PromptRecord:
    row: dict[str, Any]   # {"prompt": str | list[message], <reference columns>}
    format: str           # standard | conversational | sft
    file: str
    line: int
    split_key: str        # what decides its split


def settings(cfg: DictConfig) -> dict[str, Any]:
    node = cfg.data.get("prompts")
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def source(cfg: DictConfig) -> Path:
    """What the RL run reads: data.prompts.path, or data.path where the data config has none."""
    return Path(str(settings(cfg).get("path") or cfg.data.path))


# ------------------------------------------------------------------------------------------------ reading
def is_conversation(record: Any) -> bool:
    return isinstance(record, dict) and "messages" in record and "prompt" not in record


def from_conversation(record: dict[str, Any], path: Path, line: int) -> PromptRecord:
    conv = record["messages"]
    if not isinstance(conv, list) or len(conv) < 2 or not isinstance(conv[-1], dict) \
            or conv[-1].get("role") != "assistant" or not isinstance(conv[-1].get("content"), str):
        raise ReprotuneError(f"{path}:{line}: messages: needs turns ending in an assistant answer (its reference)")
    check_messages(conv[:-1], path, line, "messages")
    return PromptRecord({"prompt": conv[:-1], SFT_REFERENCE: conv[-1]["content"]}, "sft", str(path), line,
                        content_key(conv))


def check_messages(messages: Any, path: Path, line: int, field: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ReprotuneError(f"{path}:{line}: {field}: a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ReprotuneError(f"{path}:{line}: {field}[{i}]: a message needs a role ({', '.join(ROLES)}) and "
                                 "string content")
    if messages[-1]["role"] == "assistant":
        raise ReprotuneError(f"{path}:{line}: {field}[{len(messages) - 1}]: the prompt ends with an assistant turn "
                             "(a prompt-only record ends with the turn the model answers)")


def from_prompt_only(record: Any, path: Path, line: int, keys: Mapping[str, str]) -> PromptRecord:
    if not isinstance(record, dict):
        raise ReprotuneError(f"{path}:{line}: record: a JSON object with a 'prompt'")
    row = {keys.get(k, k): v for k, v in record.items()}
    prompt = row.get("prompt")
    if prompt is None:
        raise ReprotuneError(f"{path}:{line}: prompt: missing (TRL's prompt-only formats: {{\"prompt\": \"...\"}} or "
                             "{\"prompt\": [messages]}; data.prompts.keys maps another name onto it)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ReprotuneError(f"{path}:{line}: prompt: empty")
        fmt = "standard"
    else:
        check_messages(prompt, path, line, "prompt")
        fmt = "conversational"
    for key, value in row.items():
        if key != "prompt" and not isinstance(value, str | int | float | bool | type(None)):
            raise ReprotuneError(f"{path}:{line}: {key}: a reference column holds text or a number, not "
                                 f"{type(value).__name__} (JSON answers as a string)")
    return PromptRecord(row, fmt, str(path), line, content_key(prompt))


def read_prompts(path: Path, keys: Mapping[str, str]) -> list[PromptRecord]:
    """Every record read; all problems raised at once, one line each."""
    records, problems = [], []
    for line, record in iter_jsonl(path, "run 'make data' first (or set data.prompts.path)"):
        try:
            records.append(from_conversation(record, path, line) if is_conversation(record)
                           else from_prompt_only(record, path, line, keys))
        except ReprotuneError as err:
            problems += err.problems
    if problems:
        raise ReprotuneError(problems)
    if not records:
        raise ReprotuneError(f"{path}:1: file: holds no prompts")
    formats = {r.format for r in records}
    if len(formats) > 1:
        raise ReprotuneError(f"{path}:{records[-1].line}: prompt: mixes {' and '.join(sorted(formats))} records "
                             "(one format a dataset: TRL applies the chat template to all or none)")
    columns = {tuple(sorted(r.row)) for r in records}
    if len(columns) > 1:
        first = sorted(records[0].row)
        odd = next(r for r in records if sorted(r.row) != first)
        raise ReprotuneError(f"{path}:{odd.line}: record: keys {sorted(odd.row)} differ from the first record's "
                             f"{first} (every prompt carries the same reference columns)")
    return records


# ---------------------------------------------------------------------------------------------- cleaning
def unique(records: list[PromptRecord]) -> list[PromptRecord]:
    return unique_by_content(records)


def scrub(cfg: DictConfig, records: list[PromptRecord]) -> tuple[list[dict], dict[str, Any]]:
    """Rows with PII replaced: a row's prompt and its text references are one conversation to the scrubber, and
    the dataset one scrub, so a value gets the same fake in a prompt and in its reference answer."""
    rows = [r.row for r in records]
    if not cfg.data.scrub:
        return rows, {"scrub": False}
    from reprotune.formats import Record
    from reprotune.pii import scrub_records

    texts = [[k for k, v in row.items() if k != "prompt" and isinstance(v, str)] for row in rows]
    flat = [Record(messages=_prompt_messages(row["prompt"]) + [{"role": "assistant", "content": row[k]}
                                                                for k in keys], file=r.file, line=r.line)
            for r, row, keys in zip(records, rows, texts, strict=True)]
    scrubbed, report = scrub_records(flat, cfg)
    out = []
    for row, keys, conv in zip(rows, texts, scrubbed, strict=True):
        n = 1 if isinstance(row["prompt"], str) else len(row["prompt"])
        new = dict(row)
        new["prompt"] = conv[0]["content"] if isinstance(row["prompt"], str) else conv[:n]
        new.update({k: conv[n + i]["content"] for i, k in enumerate(keys)})
        out.append(new)
    return out, report


def _prompt_messages(prompt: str | list[dict]) -> list[dict]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


# -------------------------------------------------------------------------------------------------- stage
def row_line(row: dict[str, Any]) -> bytes:
    return (json.dumps(row, ensure_ascii=False) + "\n").encode()


def relative(path: Path, root: Path) -> str:
    """The input as the report names it: relative to paths.root where it lies under it."""
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def prepare_prompts(cfg: DictConfig, run: Run, work: Path) -> dict[str, Any]:
    """The prompts read, deduplicated, scrubbed and split into the Run's paths.prepared (all but the manifest)."""
    out, path, fraction = run.path("prepared"), source(cfg), float(cfg.data.holdout_fraction)
    records = read_prompts(path, dict(settings(cfg).get("keys") or {}))
    kept = unique(records)
    rows, pii_report = scrub(cfg, kept)
    holdout = [key_fraction(r.split_key) < fraction for r in kept]  # the prompt as read, before scrubbing
    train_rows = [row for row, h in zip(rows, holdout, strict=True) if not h]
    holdout_rows = [row for row, h in zip(rows, holdout, strict=True) if h]
    if not train_rows:
        raise ReprotuneError(f"{path}:0: data: no training prompts left after dedup and split")
    report = {"objective": str(cfg.objective.name), "inputs": [{"file": relative(path, run.path("root")),
                                                                "format": records[0].format, "records": len(records)}],
              "holdout_fraction": fraction, "columns": sorted(k for k in records[0].row if k != "prompt"),
              "split_key": "conversation (as the SFT prepare)" if records[0].format == "sft" else "prompt",
              "prompts": {"read": len(records), "duplicates_dropped": len(records) - len(kept),
                          "train": len(train_rows), "holdout": len(holdout_rows)},
              "scrub": bool(cfg.data.scrub)}
    metrics = {"prompts_train": len(train_rows), "prompts_holdout": len(holdout_rows),
               "duplicates_dropped": len(records) - len(kept),
               "pii_replacements": sum(v.get("replacements", 0) for v in pii_report.get("entities", {}).values())}
    replace_all({
        out / "train.jsonl": b"".join(row_line(r) for r in train_rows),
        out / "holdout.jsonl": b"".join(row_line(r) for r in holdout_rows),
        out / "report.json": (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode(),
        out / "pii_report.json": (json.dumps(pii_report, indent=2, sort_keys=True) + "\n").encode(),
        out / "metrics.json": (json.dumps(metrics, indent=2, sort_keys=True) + "\n").encode(),
    })
    log.info("prompts: %s", report["prompts"])
    return {"train": len(train_rows), "holdout": len(holdout_rows), "report": report, "pii": pii_report}


def write_manifest(cfg: DictConfig, run: Run, out: Path) -> None:
    """Inputs and outputs with their hashes (relative to the Run's paths.root), as reprotune.prepare's."""
    from reprotune import manifest as mf

    root = run.path("root")
    record = mf.stage_record("prepare", cfg, out / "manifest.json", root, **{
        "inputs": {"raw_data": mf.path_record(source(cfg), root)},
        "outputs": {name: mf.path_record(out / f"{name}.json" if "report" in name or name == "metrics"
                                         else out / f"{name}.jsonl", root)
                    for name in ("train", "holdout", "report", "pii_report", "metrics")},
    })
    mf.write_json(out / "manifest.json", record)
