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
import re
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


def drop_duplicates(records: list[Record]) -> tuple[list[Record], int]:
    seen, kept = set(), []
    for record in records:
        key = example_key({"messages": record.messages, "tools": record.tools})
        if key not in seen:
            seen.add(key)
            kept.append(record)
    return kept, len(records) - len(kept)


# --- scrubbing -----------------------------------------------------------------------------------------------


# --- token lengths -------------------------------------------------------------------------------------------


def load_tokenizer(cfg: DictConfig) -> Any:
    """The model's tokenizer with the chat template training uses (model.chat_template overrides it)."""
    from reprotune.models import load_tokenizer as load
    from reprotune.models import resolve_model_dir

    return load(resolve_model_dir(cfg.model, cfg.paths.model_cache), cfg.model)


def token_lengths(tokenizer: Any, conversations: list[list[dict]], tools: list[list | None] | None = None) -> list[int]:
    tools = tools or [None] * len(conversations)
    texts = [tokenizer.apply_chat_template(c, tools=t, tokenize=False) for c, t in zip(conversations, tools, strict=True)]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def truncate_last_reply(tokenizer: Any, messages: list[dict], max_length: int,
                        tools: list | None = None) -> list[dict] | None:
    """Shorten the final assistant reply so the whole conversation fits; None when the prompt alone does not
    (or the reply is a tool call: half a call teaches nothing)."""
    if messages[-1].get("tool_calls"):
        return None
    reply = messages[-1]["content"]
    reply_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
    overhead = token_lengths(tokenizer, [messages], [tools])[0] - len(reply_ids)
    budget = max_length - overhead
    while budget > 0:
        candidate = [*messages[:-1], {**messages[-1], "content": tokenizer.decode(reply_ids[:budget])}]
        if candidate[-1]["content"].strip() and token_lengths(tokenizer, [candidate], [tools])[0] <= max_length:
            return candidate
        budget -= 1  # re-tokenising a cut can merge differently; step back until it fits
    return None


def apply_length_policy(tokenizer: Any, conversations: list[list[dict]], lengths: list[int], max_length: int,
                        policy: str, tools: list[list | None] | None = None
                        ) -> tuple[list[list[dict] | None], list[int], Counter]:
    """Over-long examples are dropped (policy drop) or have their last reply cut to fit (policy truncate)."""
    if policy not in ("drop", "truncate"):
        raise ReprotuneError([f"data.overlong: unknown policy {policy!r} (drop or truncate)"])
    counts: Counter = Counter()
    out, out_lengths = [], []
    tools = tools or [None] * len(conversations)
    for conv, n, conv_tools in zip(conversations, lengths, tools, strict=True):
        if n <= max_length:
            out.append(conv)
            out_lengths.append(n)
            continue
        counts["overlong"] += 1
        cut = truncate_last_reply(tokenizer, conv, max_length, conv_tools) if policy == "truncate" else None
        if cut is None:
            counts["dropped"] += 1
            out.append(None)
            out_lengths.append(n)
        else:
            counts["truncated"] += 1
            out.append(cut)
            out_lengths.append(token_lengths(tokenizer, [cut], [conv_tools])[0])
    return out, out_lengths, counts


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


def check_templates(cfg: DictConfig, tokenizer: Any, conversations: list[list[dict]], tools: list) -> None:
    """Tools and per-message weights need templates that honour them: say so before anything is written,
    instead of training on conversations whose tools were silently left out."""
    n_plain = sum(1 for conv, t in zip(conversations, tools, strict=True)
                  if plain_tool_turns(conv) and not t and not any(m.get("tool_calls") for m in conv))
    n_tools = sum(1 for conv, t in zip(conversations, tools, strict=True)
                  if t or any(m.get("tool_calls") or m["role"] == "tool" for m in conv)) - n_plain
    n_weight = sum(1 for conv in conversations if any(m.get("weight") == 0 for m in conv))
    if not n_tools and not n_weight and not n_plain:
        return
    model = cfg.model
    training = Path(model.training_chat_template).read_text() if model.get("training_chat_template") else None
    problems = []
    where = f"{cfg.data.path}:0"
    if n_tools:
        unable = [name for name, template, used in (
            (f"model.chat_template ({model.chat_template or f'the tokenizer of {model.name}'})", None, True),
            (f"model.training_chat_template ({model.get('training_chat_template')})", training, training is not None))
            if used and not renders_tools(tokenizer, template)]
        if unable:
            problems.append(f"{where}: tools: {n_tools} example(s) use tools, but {' and '.join(unable)} cannot "
                            f"render tools; set {TOOL_TEMPLATES} (or your model's own tool-capable templates)")
    if n_plain:
        unable = [name for name, template, used in (
            (f"model.chat_template ({model.chat_template or f'the tokenizer of {model.name}'})", None, True),
            (f"model.training_chat_template ({model.get('training_chat_template')})", training, training is not None))
            if used and not renders_tool_role(tokenizer, template)]
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


def overlong_summary(lengths: list[int], overlong: Counter, n_examples: int, max_length: int) -> str | None:
    """More than 5% dropped for length is rarely what the user wants: say how many, how long, and the fixes."""
    if not n_examples or overlong["dropped"] <= 0.05 * n_examples:
        return None
    ordered = sorted(lengths)
    p95, p99 = (ordered[min(len(ordered) - 1, int(p * len(ordered)))] for p in (0.95, 0.99))
    return (f"prepare: {overlong['dropped']} of {n_examples} examples ({100 * overlong['dropped'] / n_examples:.0f}%) "
            f"dropped as longer than data.max_length={max_length} tokens (p95 {p95}, p99 {p99}); keep them with "
            f"data.max_length={p99} (or {p95}), or data.overlong=truncate (cuts the last reply to fit)")


def rejected_bytes(rejected: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejected).encode()


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


def jsonl_bytes(conversations: list[list[dict]], tools: list[list | None] | None = None) -> bytes:
    """One {"messages": [...]} per line, plus "tools" where the example has them (TRL renders them)."""
    tools = tools or [None] * len(conversations)
    return "".join(json.dumps({"messages": c, **({"tools": t} if t else {})}, ensure_ascii=False) + "\n"
                   for c, t in zip(conversations, tools, strict=True)).encode()


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

    files = read_dataset(Path(data.path), str(data.format), str(data.get("extra_keys", "drop")),
                         str(data.get("on_invalid", "error")))
    records = [r for f in files for r in f.records]
    extra_keys = sum((f.extra_keys for f in files), Counter())
    if extra_keys:  # said once for the dataset, not per record
        log.warning("dropped unknown keys (data.extra_keys=drop): %s",
                    ", ".join(f"{k} ({n})" for k, n in sorted(extra_keys.items())))
    rejected = [{**r, "file": relative(r["file"], root)} for f in files for r in f.rejected]
    if data.scrub:  # a reason may quote a value from the record (an unknown role): never with scrubbing on
        rejected = [{**r, "reason": QUOTED.sub('"…"', r["reason"])} for r in rejected]
    if rejected:
        log.warning("skipped %d invalid record(s) (data.on_invalid=skip): see %s", len(rejected),
                    out / "rejected.jsonl")
    log.info("read %d examples from %d file(s) (%s)", len(records), len(files),
             ", ".join(sorted({f.format for f in files if f.format})))
    records, n_duplicates = drop_duplicates(records)
    holdout_flags = [in_holdout({"messages": r.messages, "tools": r.tools}, float(data.holdout_fraction))
                     for r in records]
    tools = [r.tools for r in records]

    if data.scrub:
        from reprotune.pii import scrub_records  # Presidio and spaCy load only when scrubbing

        conversations, pii_report = scrub_records(records, cfg)
    else:
        conversations, pii_report = [r.messages for r in records], {"scrub": False}
    log.info("PII: %s", {k: v["replacements"] for k, v in pii_report.get("entities", {}).items()} or "none")

    tokenizer = load_tokenizer(cfg)
    check_templates(cfg, tokenizer, conversations, tools)
    lengths = token_lengths(tokenizer, conversations, tools)
    conversations, lengths, overlong = apply_length_policy(tokenizer, conversations, lengths,
                                                           int(data.max_length), str(data.overlong), tools)
    keep = [c is not None for c in conversations]
    train_idx = [i for i in range(len(records)) if keep[i] and not holdout_flags[i]]
    holdout_idx = [i for i in range(len(records)) if keep[i] and holdout_flags[i]]

    where = [f"{relative(r.file, root)}:{r.line}" for r in records]
    sh = [shingles(c) if c is not None else frozenset() for c in conversations]
    near = near_duplicates([(where[i], sh[i]) for i in train_idx], [(where[i], sh[i]) for i in holdout_idx],
                           float(data.near_duplicate_threshold))
    roles = Counter(m["role"] for i in train_idx + holdout_idx for m in conversations[i])
    overlong_note = overlong_summary(lengths, overlong, len(records), int(data.max_length))
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
            "rejected": len(rejected),
            "with_tools": sum(1 for i in train_idx + holdout_idx if tools[i] or any(
                m.get("tool_calls") for m in conversations[i])),
        },
        "extra_keys_dropped": dict(sorted(extra_keys.items())),
        "tokens": {
            "model": str(cfg.model.name),
            "chat_template": str(cfg.model.chat_template) if cfg.model.chat_template else "tokenizer",
            "train": distribution([lengths[i] for i in train_idx]),
            "holdout": distribution([lengths[i] for i in holdout_idx]),
        },
        "roles": {r: roles[r] for r in ("system", "user", "assistant", "tool") if r != "tool" or roles[r]},
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
        out / "train.jsonl": jsonl_bytes([conversations[i] for i in train_idx], [tools[i] for i in train_idx]),
        out / "holdout.jsonl": jsonl_bytes([conversations[i] for i in holdout_idx], [tools[i] for i in holdout_idx]),
        out / "rejected.jsonl": rejected_bytes(rejected),
        out / "report.json": (json.dumps(report, indent=2, ensure_ascii=False) + "\n").encode(),
        out / "pii_report.json": (json.dumps(pii_report, indent=2, sort_keys=True) + "\n").encode(),
        out / "lengths.png": plot_tmp,
    })
    write_manifest(cfg, out)
    print_table(report, pii_report)
    if overlong_note:
        print(overlong_note)
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
