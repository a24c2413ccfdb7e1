"""Prepare stage: turn a user's dataset into clean, private, versioned train/holdout sets.

    python -m reprotune.prepare [hydra overrides]          e.g. data.path=my_chats.jsonl data.format=sharegpt
    make prepare ARGS="data.path=<file or folder>"

Reads   data.path (a file or a folder of .jsonl/.json files) in any supported format (reprotune.formats)
Writes  data/prepared/train.jsonl, holdout.jsonl    one {"messages": [...]} per line (what train/eval read)
        data/prepared/metrics.json                  numbers only, what 'dvc metrics diff' compares: counts, token
                                                    lengths, near-duplicates, PII replacements
        data/prepared/report.json                   the report: counts, token lengths, roles, near-duplicates, policy
        data/prepared/pii_report.json               PII found per entity type (counts only, never values), detector
        data/prepared/lengths.png                   token length histogram against data.max_length

Steps, top to bottom: read and validate every file (all problems reported at once, nothing written on bad
input); drop exact duplicates; assign each example to train or holdout by a hash of its content (so
appending data never moves an old example); scrub PII with consistent fakes (reprotune.pii); measure token
lengths with the model's tokenizer and chat template and apply the over-length policy; report
near-duplicates across the split; write every output to a temporary file and rename them all at the end.

Memory stays proportional to the data without holding it (#22): files are read line by line, each valid
record is kept as its JSON line in a spool file under `<paths.prepared>.work/` (io.Spool: 8 bytes of offset
in memory per example), and the stages after reading go through the spool in batches of LENGTH_BATCH.
Scrubbing is the exception: reprotune.pii looks at every text of the dataset at once (a value found in one
example is replaced in all), so with data.scrub=true the conversations are in memory while it runs.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from reprotune.config import CONF_DIR
from reprotune.errors import ReprotuneError, user_errors
from reprotune.formats import Record, read_dataset
from reprotune.io import Spool, content_key, fresh_dir, key_fraction, replace_all
from reprotune.preference.pairs import prepare_pairs, source
from reprotune.prepare_lengths import LENGTH_BATCH, apply_length_policy, load_tokenizer, token_lengths
from reprotune.prepare_report import (
    distribution,
    near_duplicates,
    overlong_summary,
    plot_lengths,
    prepare_metrics,
    print_table,
    rejected_bytes,
    shingles,
)
from reprotune.run import Run, resolve

QUOTED = re.compile(r'"[^"]*"')
# a template renders tools if these names come out of it (a template that ignores tools= drops them silently)
PROBE_TOOLS = [{"type": "function", "function": {"name": "reprotune_probe_tool", "description": "probe",
                                                 "parameters": {"type": "object", "properties": {}}}}]
PROBE_CALL = [{"role": "user", "content": "probe"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "reprotune_probe_call", "arguments": "{}"}}]},
              {"role": "tool", "content": "reprotune_probe_result"},
              {"role": "assistant", "content": "done"}]
# an agent trace: the assistant invokes a tool in its text, a tool turn without tool_calls answers
PROBE_PLAIN_TOOL = [{"role": "user", "content": "probe"},
                    {"role": "assistant", "content": "calling reprotune_probe_tool"},
                    {"role": "tool", "content": "reprotune_probe_result"},
                    {"role": "assistant", "content": "done"}]
TOOL_TEMPLATES = ("model.chat_template=conf/chat_templates/qwen2_5_tools.jinja "
                  "model.training_chat_template=conf/chat_templates/qwen2_5_tools_training.jinja")

log = logging.getLogger("reprotune.prepare")


# --- split ---------------------------------------------------------------------------------------------------


def example_key(example: dict) -> str:
    """Content hash of an example (its messages and tools, as read, before scrubbing): identity for dedup and
    split. Without tools it is the hash of the messages alone, as before tools were supported."""
    return content_key({"messages": example["messages"], "tools": example["tools"]} if example.get("tools")
                       else example["messages"])


def in_holdout(example: dict, fraction: float) -> bool:
    """Holdout membership depends on the example alone, never on its neighbours or a shuffle."""
    return key_fraction(example_key(example)) < fraction


class Intake:
    """The sink of read_dataset: each record read is kept once (exact duplicates dropped), as its JSON line in a
    spool, with its split, file and line; the record itself is let go (#22: ~0.8 kB each when all were held)."""

    def __init__(self, spool: Spool, holdout_fraction: float) -> None:
        self.spool, self.fraction = spool, holdout_fraction
        self.seen: set[bytes] = set()  # 128 bits of each key: a collision among 10^9 examples is ~10^-21
        self.duplicates = 0
        self.holdout = bytearray()
        self.lines, self.files = array("q"), array("l")
        self.paths: list[str] = []
        self._file_index: dict[str, int] = {}
        self.needs = [0, 0, 0]  # template_needs, summed over the examples kept

    def __call__(self, record: Record) -> None:
        key = example_key({"messages": record.messages, "tools": record.tools})
        digest = bytes.fromhex(key[:32])
        if digest in self.seen:
            self.duplicates += 1
            return
        self.seen.add(digest)
        self.holdout.append(key_fraction(key) < self.fraction)
        self.lines.append(record.line)
        if record.file not in self._file_index:
            self._file_index[record.file] = len(self.paths)
            self.paths.append(record.file)
        self.files.append(self._file_index[record.file])
        self.spool.append(example_line(record.messages, record.tools))
        self.needs = [n + need for n, need in zip(self.needs, template_needs(record.messages, record.tools),
                                                  strict=True)]

    def where(self, index: int, root: Path) -> str:
        return f"{relative(self.paths[self.files[index]], root)}:{self.lines[index]}"


# --- what the chat templates can render ------------------------------------------------------------------------


def renders_tools(tokenizer: Any, template: str | None) -> bool:
    try:
        text = tokenizer.apply_chat_template(PROBE_CALL, tools=PROBE_TOOLS, chat_template=template, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that raises on tools cannot render them; that is the answer
        return False
    return all(name in text for name in ("reprotune_probe_tool", "reprotune_probe_call", "reprotune_probe_result"))


def renders_tool_role(tokenizer: Any, template: str | None) -> bool:
    """The template renders a tool turn that follows a plain-text assistant turn (its tool role), not drops it."""
    try:
        text = tokenizer.apply_chat_template(PROBE_PLAIN_TOOL, chat_template=template, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that raises on a tool turn has no tool role for it
        return False
    return "reprotune_probe_result" in text and text.index("reprotune_probe_result") < text.rindex("done")


def plain_tool_turns(conversation: list[dict]) -> bool:
    """A tool turn answering an assistant turn that invoked the tool in its text (no tool_calls)."""
    return any(m["role"] == "tool" and prev["role"] == "assistant" and not prev.get("tool_calls")
               for prev, m in zip(conversation, conversation[1:], strict=False))


def masks_weight_zero(tokenizer: Any, template: str) -> bool:
    """The training template leaves a weight-0 assistant reply out of the assistant mask (and keeps the rest)."""
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "skipped reply", "weight": 0},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": "learned reply"}]
    out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    learned = tokenizer.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m])
    return "learned reply" in learned and "skipped" not in learned


def template_needs(conv: list[dict], tools: list | None) -> tuple[bool, bool, bool]:
    """What of an example only some templates render: (tools, a tool turn answering a plain-text invocation
    (an agent trace), weight-0 replies). Scrubbing never changes it (only texts), so it is counted as read."""
    plain = plain_tool_turns(conv) and not tools and not any(m.get("tool_calls") for m in conv)
    uses_tools = bool(tools or any(m.get("tool_calls") or m["role"] == "tool" for m in conv)) and not plain
    return uses_tools, plain, any(m.get("weight") == 0 for m in conv)


def check_templates(cfg: DictConfig, tokenizer: Any, needs: list[int]) -> None:
    """Tools and per-message weights need templates that honour them: say so before anything is written,
    instead of training on conversations whose tools were silently left out. `needs`: template_needs, summed
    over the examples."""
    n_tools, n_plain, n_weight = needs
    if not n_tools and not n_weight and not n_plain:
        return
    model = cfg.model
    training = Path(model.training_chat_template).read_text() if model.get("training_chat_template") else None
    problems = []
    where = f"{cfg.data.path}:0"
    templates = (  # (name in a message, template text or None for the tokenizer's own, whether this run uses it)
        (f"model.chat_template ({model.chat_template or f'the tokenizer of {model.name}'})", None, True),
        (f"model.training_chat_template ({model.get('training_chat_template')})", training, training is not None))
    if n_tools:
        unable = [name for name, template, used in templates if used and not renders_tools(tokenizer, template)]
        if unable:
            problems.append(f"{where}: tools: {n_tools} example(s) use tools, but {' and '.join(unable)} cannot "
                            f"render tools; set {TOOL_TEMPLATES} (or your model's own tool-capable templates)")
    if n_plain:
        unable = [name for name, template, used in templates if used and not renders_tool_role(tokenizer, template)]
        if unable:
            problems.append(f"{where}: tool: {n_plain} example(s) answer a plain-text tool invocation with a tool "
                            f"turn, but {' and '.join(unable)} has no tool role to render it; use a template "
                            f"that renders role 'tool' ({TOOL_TEMPLATES})")
    if n_weight and bool(cfg.train.assistant_only_loss):
        if training is None:
            problems.append(f"{where}: weight: {n_weight} example(s) have assistant messages with weight 0, which "
                            f"need a training template that honours them; set model.training_chat_template="
                            f"(e.g. conf/chat_templates/chatml_training.jinja or qwen2_5_tools_training.jinja)")
        elif not masks_weight_zero(tokenizer, training):
            problems.append(f"{where}: weight: {n_weight} example(s) have assistant messages with weight 0, but "
                            f"model.training_chat_template ({model.training_chat_template}) still trains on them "
                            f"(wrap the reply's generation markers in {{% if message.weight != 0 %}})")
    elif n_weight:
        problems.append(f"{where}: weight: {n_weight} example(s) have assistant messages with weight 0, but "
                        f"train.assistant_only_loss=false trains on every token; set train.assistant_only_loss=true")
    if problems:
        raise ReprotuneError(problems)


def relative(path: str, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


# --- output --------------------------------------------------------------------------------------------------


def example_line(messages: list[dict], tools: list | None = None) -> bytes:
    """One line of train.jsonl / holdout.jsonl: {"messages": [...]}, plus "tools" where the example has them
    (TRL renders them)."""
    return (json.dumps({"messages": messages, **({"tools": tools} if tools else {})}, ensure_ascii=False)
            + "\n").encode()


# --- the stage -----------------------------------------------------------------------------------------------


def write_manifest(cfg: DictConfig, run: Run, out: Path, raw: Path) -> None:
    """Inputs and outputs with their hashes (relative to the Run's paths.root), so 'make verify' can re-run and
    compare this stage."""
    from reprotune import manifest as mf

    root = run.path("root")
    record = mf.stage_record("prepare", cfg, out / "manifest.json", root, **{
        "inputs": {"raw_data": mf.path_record(raw, root)},
        "outputs": {name: mf.path_record(out / file, root) for name, file in
                    (("train", "train.jsonl"), ("holdout", "holdout.jsonl"), ("report", "report.json"),
                     ("pii_report", "pii_report.json"), ("metrics", "metrics.json"),
                     ("lengths_plot", "lengths.png"))},
    })
    mf.write_json(out / "manifest.json", record)


def read_into_spool(cfg: DictConfig, run: Run, work: Path) -> tuple[list, Intake, list[dict], Counter]:
    """Every file of data.path read, validated and kept in a spool once (duplicates dropped); (files, intake,
    rejected records, extra keys dropped)."""
    data, out, root = cfg.data, run.path("prepared"), run.path("root")
    intake = Intake(Spool(work / "read.jsonl"), float(data.holdout_fraction))
    files = read_dataset(Path(data.path), str(data.format), str(data.get("extra_keys", "drop")),
                         str(data.get("on_invalid", "error")), sink=intake)
    intake.seen.clear()  # dedup is done: its keys are the largest thing left
    extra_keys = sum((f.extra_keys for f in files), Counter())
    if extra_keys:  # said once for the dataset, not per record
        log.warning("dropped unknown keys (data.extra_keys=drop): %s",
                    ", ".join(f"{k} ({n})" for k, n in sorted(extra_keys.items())))
    rejected = [{**r, "file": relative(r["file"], root)} for f in files for r in f.rejected]
    if data.scrub:  # a reason may quote a value from the record (an unknown role): never with scrubbing on
        rejected = [{**r, "reason": QUOTED.sub('"…"', r["reason"])} for r in rejected]
    if not len(intake.spool):  # every record skipped (or none there): nothing to split, scrub or measure
        first = f"; the first: {rejected[0]['file']}:{rejected[0]['line']}: {rejected[0]['reason']}" if rejected else ""
        raise ReprotuneError(f"{data.path}:0: data: no valid examples left ({len(rejected)} skipped with "
                             f"data.on_invalid=skip){first}")
    if rejected:
        log.warning("skipped %d invalid record(s) (data.on_invalid=skip): see %s", len(rejected),
                    out / "rejected.jsonl")
    log.info("read %d examples from %d file(s) (%s)", sum(f.count for f in files), len(files),
             ", ".join(sorted({f.format for f in files if f.format})))
    return files, intake, rejected, extra_keys


def scrubbed_spool(cfg: DictConfig, intake: Intake, work: Path) -> tuple[Spool, dict[str, Any]]:
    """The examples with PII replaced (a new spool) and the PII report; the same spool with data.scrub=false."""
    if not cfg.data.scrub:
        return intake.spool, {"scrub": False}
    from reprotune.pii import scrub_records  # Presidio and spaCy load only when scrubbing

    rows = [json.loads(line) for line in intake.spool.lines()]
    records = [Record(messages=row["messages"], file=intake.paths[intake.files[i]], line=intake.lines[i])
               for i, row in enumerate(rows)]
    conversations, pii_report = scrub_records(records, cfg)
    del records
    scrubbed = Spool(work / "scrubbed.jsonl")
    for row, conv in zip(rows, conversations, strict=True):
        scrubbed.append(example_line(conv, row.get("tools")))
    return scrubbed, pii_report


def batches(spool: Spool, size: int = LENGTH_BATCH) -> Iterator[list[tuple[bytes, dict]]]:
    """(line, parsed line) of every example of a spool, `size` at a time."""
    batch = []
    for line in spool.lines():
        batch.append((line, json.loads(line)))
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class Split:
    """The examples kept after the length policy, written as they come to the train or holdout file (in the
    order read), with what the report needs of each; `position[i]` is example i's index in its split's spool
    (-1: dropped for its length)."""

    def __init__(self, work: Path, holdout: bytearray) -> None:
        self.train, self.holdout = Spool(work / "train.jsonl"), Spool(work / "holdout.jsonl")
        self.in_holdout = holdout
        self.position = array("q")
        self.lengths: list[int] = []
        self.overlong: Counter = Counter()
        self.roles: Counter = Counter()
        self.with_tools = 0

    def add(self, line: bytes, messages: list[dict] | None, tools: list | None, changed: bool) -> None:
        if messages is None:
            self.position.append(-1)
            return
        spool = self.holdout if self.in_holdout[len(self.position)] else self.train
        self.position.append(spool.append(example_line(messages, tools) if changed else line))
        self.roles.update(m["role"] for m in messages)
        self.with_tools += bool(tools or any(m.get("tool_calls") for m in messages))

    def indices(self, holdout: bool) -> array:
        return array("q", (i for i, p in enumerate(self.position) if p >= 0 and self.in_holdout[i] == holdout))

    def messages(self, index: int) -> list[dict]:
        spool = self.holdout if self.in_holdout[index] else self.train
        return spool.row(self.position[index])["messages"]


def measure_and_split(cfg: DictConfig, run: Run, examples: Spool, intake: Intake, work: Path) -> Split:
    """Token lengths and the length policy, a batch at a time; the kept examples written to their split."""
    data = cfg.data
    tokenizer = load_tokenizer(cfg, run)
    check_templates(cfg, tokenizer, intake.needs)
    split = Split(work, intake.holdout)
    for batch in batches(examples):
        conversations = [row["messages"] for _, row in batch]
        tools = [row.get("tools") for _, row in batch]
        lengths = token_lengths(tokenizer, conversations, tools, int(data.max_length))
        kept, lengths, overlong = apply_length_policy(tokenizer, conversations, lengths, int(data.max_length),
                                                      str(data.overlong), tools)
        split.lengths += lengths
        split.overlong.update(overlong)
        for (line, _), before, after, t in zip(batch, conversations, kept, tools, strict=True):
            split.add(line, after, t, changed=after is not before)
    return split


def prepare(cfg: DictConfig, resolved: Run | None = None) -> dict:
    """resolved: the stage's Run (main resolves it first; a caller without one: resolve(cfg, "prepare"))."""
    resolved = resolved if resolved is not None else resolve(cfg, "prepare")
    started = time.perf_counter()
    out = resolved.path("prepared")
    work = fresh_dir(out, ".work")  # the spools and staged outputs; gone when prepare ends, however it ends
    try:
        if resolved.objective.preference:  # preference pairs (reprotune.preference.pairs)
            result = prepare_pairs(cfg, resolved, work)
            write_manifest(cfg, resolved, out, source(cfg))
        elif resolved.objective.rl:  # prompts with their reference answers (reprotune.rl.prompts)
            from reprotune.rl import prompts

            result = prompts.prepare_prompts(cfg, resolved, work)
            prompts.write_manifest(cfg, resolved, out)
        else:
            result = prepare_in(cfg, resolved, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("prepared %d train and %d holdout examples in %s (%.1f s)", result["train"], result["holdout"], out,
             time.perf_counter() - started)
    return result


def prepare_in(cfg: DictConfig, run: Run, work: Path) -> dict:
    data, out, root = cfg.data, run.path("prepared"), run.path("root")
    files, intake, rejected, extra_keys = read_into_spool(cfg, run, work)
    examples, pii_report = scrubbed_spool(cfg, intake, work)
    log.info("PII: %s", {k: v["replacements"] for k, v in pii_report.get("entities", {}).items()} or "none")
    split = measure_and_split(cfg, run, examples, intake, work)
    lengths, overlong = split.lengths, split.overlong
    train_idx, holdout_idx = split.indices(holdout=False), split.indices(holdout=True)

    near = near_duplicates(train_idx, holdout_idx, lambda i: shingles(split.messages(i)),
                           float(data.near_duplicate_threshold))
    # file:line only for the pairs listed (a string per record cost ~80 MB per million records)
    near["pairs"] = [{**pair, "holdout": intake.where(pair["holdout"], root), "train": intake.where(pair["train"], root)}
                     for pair in near["pairs"]]
    overlong_note = overlong_summary(lengths, overlong, len(examples), int(data.max_length))
    report = {
        "inputs": [{"file": relative(f.path, root), "format": f.format, "examples": f.count, "sha256": f.sha256}
                   for f in files],
        "holdout_fraction": float(data.holdout_fraction),
        "max_length": int(data.max_length),
        "examples": {
            "read": len(examples) + intake.duplicates, "duplicates_dropped": intake.duplicates,
            "overlong": {"policy": str(data.overlong), "count": overlong["overlong"],
                         "dropped": overlong["dropped"], "truncated": overlong["truncated"]},
            "train": len(train_idx), "holdout": len(holdout_idx),
            "rejected": len(rejected),
            "with_tools": split.with_tools,
        },
        "extra_keys_dropped": dict(sorted(extra_keys.items())),
        "tokens": {
            "model": str(cfg.model.name),
            "chat_template": str(cfg.model.chat_template) if cfg.model.chat_template else "tokenizer",
            "train": distribution([lengths[i] for i in train_idx]),
            "holdout": distribution([lengths[i] for i in holdout_idx]),
        },
        "roles": {r: split.roles[r] for r in ("system", "user", "assistant", "tool") if r != "tool" or split.roles[r]},
        "near_duplicates": near,
        "scrub": bool(data.scrub),
    }
    if not train_idx:
        raise ReprotuneError([f"{data.path}:0: data: no training examples left after dedup, split and length policy "
                         f"({report['examples']})"])

    plot_tmp = work / "lengths.png"
    plot_lengths([lengths[i] for i in train_idx], [lengths[i] for i in holdout_idx], int(data.max_length), plot_tmp)
    replace_all({
        out / "train.jsonl": split.train.close(),
        out / "holdout.jsonl": split.holdout.close(),
        out / "rejected.jsonl": rejected_bytes(rejected),
        out / "report.json": (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode(),
        out / "pii_report.json": (json.dumps(pii_report, indent=2, sort_keys=True) + "\n").encode(),
        out / "metrics.json": (json.dumps(prepare_metrics(report, pii_report), indent=2, sort_keys=True) + "\n").encode(),
        out / "lengths.png": plot_tmp,
    })
    write_manifest(cfg, run, out, Path(cfg.data.path))
    print_table(report, pii_report)
    if overlong_note:
        print(overlong_note)
    return {"train": len(train_idx), "holdout": len(holdout_idx), "report": report, "pii": pii_report}


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    # one line per problem, no traceback: the user fixes the data, not our code
    with user_errors():
        run = resolve(cfg, "prepare")
        with user_errors(summary=f"prepare: {{count}} problem(s); nothing written to {run.paths['prepared']}"):
            prepare(cfg, run)


if __name__ == "__main__":
    main()
