"""Read a user's dataset (a file or a folder of files) into one canonical form, or say exactly what is wrong.

Canonical form: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` with at most
one system message, first; then user and assistant turns alternating, starting with user and ending with
assistant. Every input format is converted to it:

    chat               JSONL, one {"messages": [{"role", "content"}, ...]} per line
    chat_json          one JSON array of such objects (the format of the first seed guide)
    sharegpt           {"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}
    alpaca             {"instruction", "input" (optional), "output", "system" (optional)}
    prompt_completion  {"prompt", "completion", "system" (optional)}

A file is JSONL unless its first non-blank character is "[" (a JSON array). The record format is detected
per file from the keys of its records (``format=auto``) or forced. Problems are collected, never raised one
at a time: every problem in a file is reported as ``file:line: field: what is wrong`` (line 0 for problems
with the file itself), so a user fixes a file in one pass.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprotune.errors import ReprotuneError
from reprotune.formats_checks import (
    INVALID,
    MESSAGE_KEYS,
    RECORD_KEYS,
    ROLES,
    Problems,
    Reader,
    check_conversation,
    check_keys,
    parse_turns,
    text_of,
    tools_of,
    type_name,
)
from reprotune.io import scan_utf8, text_lf, text_lines
from reprotune.schema import DATA_FORMATS

FORMATS = DATA_FORMATS  # data.format's values but auto (reprotune.schema)
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool"}
SUFFIXES = (".jsonl", ".json")
EXTRA_KEYS = ("drop", "error")
ON_INVALID = ("error", "skip")


@dataclass
class Record:
    """One canonical example and where it came from (for error messages and the report)."""

    messages: list[dict[str, Any]]
    file: str
    line: int
    tools: list[dict] | None = None


@dataclass
class FileResult:
    path: str
    container: str  # jsonl | json_array
    format: str | None
    records: list[Record] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    total_problems: int = 0
    extra_keys: Counter = field(default_factory=Counter)  # key (messages[].key for per-message keys) -> count
    rejected: list[dict] = field(default_factory=list)  # data.on_invalid=skip: {file, line, reason}
    count: int = 0  # valid records (in `records`, or handed to read_file's sink)
    sha256: str = ""  # of the file's bytes


def list_input_files(path: Path) -> list[Path]:
    """The files a data.path names: the file itself, or every *.jsonl/*.json under a folder, sorted."""
    if not path.exists():
        if path.is_symlink():  # exists() follows links: a loop or a dangling link reads as missing
            raise ReprotuneError([f"{path}:0: path: a symbolic link that leads nowhere (a loop, or its target "
                                  f"{os.readlink(path)} is gone); point data.path at the file itself"])
        raise ReprotuneError([f"{path}:0: path: no such file or directory (set data.path=<file or folder>)"])
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ReprotuneError([f"{path}:0: path: folder holds no .jsonl or .json files"])
    return files


TOO_DEEP = "nested too deeply to parse (arrays/objects more than about 1,000 levels deep); flatten the record"


def _iter_jsonl(lines: Iterable[str], problems: Problems) -> Iterator[tuple[int, Any]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines are harmless
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            problems.add(number, "json", f"invalid JSON: {err.msg} at column {err.colno}")
        except RecursionError:  # the C decoder gives up past the interpreter's recursion limit
            problems.add(number, "json", TOO_DEEP)


def _iter_json_array(text: str, problems: Problems) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array with the line each starts on (json.loads would lose it)."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        problems.add(err.lineno, "json", f"invalid JSON: {err.msg} at column {err.colno}", record=False)
        return
    except RecursionError:
        problems.add(1, "json", TOO_DEEP, record=False)
        return
    if not isinstance(document, list):
        problems.add(1, "(top level)", f"expected a JSON array of examples, got {type_name(document)}", record=False)
        return
    decoder, pos = json.JSONDecoder(), text.index("[") + 1
    for element in document:  # re-scan only to learn each element's line number
        while text[pos] in " \t\n,":
            pos += 1
        _, end = decoder.raw_decode(text, pos)
        yield text.count("\n", 0, pos) + 1, element
        pos = end


def detect_record_format(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    for name, (required, _) in RECORD_KEYS.items():
        if required <= record.keys():
            return name
    # a record with one of the distinguishing keys but not all required ones: still say which format
    for key, name in (("messages", "chat"), ("conversations", "sharegpt"), ("instruction", "alpaca"),
                      ("output", "alpaca"), ("prompt", "prompt_completion"), ("completion", "prompt_completion")):
        if key in record:
            return name
    return None


def _chat(record: dict, line: int, reader: Reader) -> list[dict] | None:
    messages = parse_turns(record["messages"], line, reader, "messages", "role", "content",
                            {r: r for r in ROLES}, MESSAGE_KEYS)
    return messages if messages is not None and check_conversation(messages, line, "messages", reader) else None


def _sharegpt(record: dict, line: int, reader: Reader) -> list[dict] | None:
    messages = parse_turns(record["conversations"], line, reader, "conversations", "from", "value",
                            SHAREGPT_ROLES, {"from", "value"})
    if messages is None:
        return None
    if "system" in record:
        system = text_of(record["system"], line, "system", reader)
        if system is None:
            return None
        if messages[0]["role"] == "system":
            reader.add(line, "system", "given both as a key and as the first turn")
            return None
        messages = [{"role": "system", "content": system}, *messages]
    names = {"user": "human", "assistant": "gpt", "tool": "observation", "function_call": "function_call"}
    return messages if check_conversation(messages, line, "conversations", reader, names) else None


def _pair(record: dict, line: int, reader: Reader, prompt_keys: tuple[str, ...], answer_key: str) -> list | None:
    texts = {key: text_of(record[key], line, key, reader, allow_empty=(key == "input"))
             for key in (*prompt_keys, answer_key, "system") if key in record}
    if any(v is None for v in texts.values()):
        return None
    prompt = "\n\n".join(texts[k] for k in prompt_keys if texts.get(k, "").strip())
    messages = [{"role": "system", "content": texts["system"]}] if texts.get("system") else []
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": texts[answer_key]}]


def _prompt_completion(record: dict, line: int, reader: Reader) -> list[dict] | None:
    """Plain (strings) or conversational (TRL's layout: message lists); the loss covers the completion only,
    so assistant turns inside a conversational prompt get weight 0."""
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return _pair(record, line, reader, ("prompt",), "completion")
    parts = []
    for key, value, default_role in (("prompt", prompt, "user"), ("completion", completion, "assistant")):
        if isinstance(value, list):
            parts.append(parse_turns(value, line, reader, key, "role", "content", {r: r for r in ROLES},
                                      MESSAGE_KEYS))
        else:
            text = text_of(value, line, key, reader)
            parts.append(None if text is None else [{"role": default_role, "content": text}])
    system = text_of(record["system"], line, "system", reader) if "system" in record else ""
    if None in parts or system is None:
        return None
    prompt_messages = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in parts[0]]
    if any(m["role"] not in ("assistant", "tool") for m in parts[1]):
        reader.add(line, "completion", "holds only assistant (and tool) messages: the prompt holds the rest")
        return None
    if system and prompt_messages[0]["role"] != "system":
        prompt_messages.insert(0, {"role": "system", "content": system})
    messages = prompt_messages + parts[1]
    return messages if check_conversation(messages, line, "prompt+completion", reader) else None


CONVERTERS = {"chat": _chat, "sharegpt": _sharegpt, "prompt_completion": _prompt_completion,
              "alpaca": lambda record, line, reader: _pair(record, line, reader, ("instruction", "input"), "output")}


def to_record(record: dict, fmt: str, line: int, path: str, reader: Reader) -> Record | None:
    """Validate one record of a known format and convert it (None if invalid; every problem reported)."""
    complete = check_keys(record, fmt, line, reader)
    if not complete and not (RECORD_KEYS[fmt][0] <= record.keys()):
        return None
    messages = CONVERTERS[fmt](record, line, reader)  # still checked with unknown keys: report everything
    tools = tools_of(record["tools"], line, reader) if "tools" in record else None
    if messages is None or tools is INVALID or not complete:
        return None
    if not tools and any(m.get("tool_calls") for m in messages):
        tools = None  # calls without a tool list are still rendered; the template may then skip the schema
    return Record(messages=messages, file=path, line=line, tools=tools)


def _mismatch_line(forced: str, fmt: str, count: int, total: int, first: int, keys: list[str]) -> tuple[int, str, str]:
    return (first, "data.format",
            f"{forced} was forced, but {count} of {total} records look like {fmt} records (keys: {', '.join(keys)}); "
            f"set data.format={fmt} or data.format=auto")


def _first_character(path: Path) -> str:
    """The file's first non-blank character ("" for a blank file): "[" makes it a JSON array."""
    return next((line.lstrip()[0] for line in text_lines(path) if line.strip()), "")


Sink = Callable[[Record], None]


def read_file(path: Path, forced: str = "auto", extra_keys: str = "drop", on_invalid: str = "error",
              sink: Sink | None = None) -> FileResult:
    """Read, validate and convert one file; problems are collected in the result, never raised. With a sink,
    each valid record goes to it as it is read instead of into `records` (prepare keeps ~20 bytes of each)."""
    problems = Problems(str(path))
    reader = Reader(problems, extra_keys)
    utf8, sha256 = scan_utf8(path, problems.add)
    first = _first_character(path) if utf8 else ""
    container = "json_array" if first == "[" or forced == "chat_json" else "jsonl"
    result = FileResult(path=str(path), container=container, format=None if forced == "auto" else forced,
                        sha256=sha256)
    if utf8 and not first:
        problems.add(1, "file", "empty file (no examples)", record=False)
    if not utf8 or not first:
        return _finish(result, problems, reader, on_invalid)
    if forced == "chat_json" and first != "[":
        problems.add(1, "(top level)", "data.format=chat_json expects a JSON array of examples", record=False)
        return _finish(result, problems, reader, on_invalid)
    record_format = {"auto": None, "chat_json": "chat"}.get(forced, forced)
    first_line_of_format = 0
    mismatched: Counter = Counter()
    first_mismatch: dict[str, tuple[int, list[str]]] = {}
    rows = (_iter_json_array(text_lf(path), problems) if container == "json_array"
            else _iter_jsonl(text_lines(path), problems))
    n_rows = 0
    for line, record in rows:
        n_rows += 1
        if not isinstance(record, dict):
            problems.add(line, "(top level)", f"expected a JSON object per example, got {type_name(record)}")
            continue
        fmt = detect_record_format(record)
        if fmt is None:
            problems.add(line, "(keys)", f"not a known record format (keys: {', '.join(sorted(record)) or 'none'}); "
                                         f"expected messages, conversations, instruction/output or prompt/completion")
            continue
        if record_format is None:
            record_format, first_line_of_format = fmt, line
        elif fmt != record_format:
            if not first_line_of_format:  # forced: said once for the file, below
                mismatched[fmt] += 1
                first_mismatch.setdefault(fmt, (line, sorted(record)))
                continue
            problems.add(line, "(keys)", f"mixed formats in one file: this record is {fmt}, but line "
                                         f"{first_line_of_format} made the file {record_format}")
            continue
        converted = to_record(record, fmt, line, str(path), reader)
        if converted is not None:
            (sink or result.records.append)(converted)
            result.count += 1
    for fmt, count in mismatched.most_common():
        first, keys = first_mismatch[fmt]
        problems.add(*_mismatch_line(forced, fmt, count, n_rows, first, keys), record=False)
    if n_rows == 0 and not problems.all:
        problems.add(1, "file", "empty file (no examples)", record=False)
    if record_format is not None:
        result.format = "chat_json" if (record_format == "chat" and container == "json_array") else record_format
    return _finish(result, problems, reader, on_invalid)


def _finish(result: FileResult, problems: Problems, reader: Reader, on_invalid: str) -> FileResult:
    """Problems become errors, or (data.on_invalid=skip) record problems become rejected records."""
    fatal = [p for p in problems.all if not (on_invalid == "skip" and p.record)]
    if on_invalid == "skip":
        reasons: dict[int, list[str]] = {}
        for p in problems.all:
            if p.record:
                reasons.setdefault(p.line, []).append(f"{p.fld}: {p.what}")
        result.rejected = [{"file": result.path, "line": line, "reason": "; ".join(r)}
                           for line, r in sorted(reasons.items())]
    result.problems = problems.render(sorted(fatal, key=lambda p: p.line) if on_invalid == "skip" else fatal)
    result.total_problems = len(fatal)
    result.extra_keys = reader.extra
    return result


def read_dataset(path: Path, forced: str = "auto", extra_keys: str = "drop",
                 on_invalid: str = "error", sink: Sink | None = None) -> list[FileResult]:
    """Every file under data.path, read and validated; raises ReprotuneError with all problems of all files
    (after every record was read: a sink has then seen the valid ones of every file, in order)."""
    if forced not in ("auto", *FORMATS):
        raise ReprotuneError([f"{path}:0: data.format: unknown format {forced!r} (auto, {', '.join(FORMATS)})"])
    if extra_keys not in EXTRA_KEYS:
        raise ReprotuneError([f"{path}:0: data.extra_keys: unknown policy {extra_keys!r} ({', '.join(EXTRA_KEYS)})"])
    if on_invalid not in ON_INVALID:
        raise ReprotuneError([f"{path}:0: data.on_invalid: unknown policy {on_invalid!r} ({', '.join(ON_INVALID)})"])
    results = [read_file(p, forced, extra_keys, on_invalid, sink) for p in list_input_files(path)]
    problems = [line for r in results for line in r.problems]
    if problems:
        raise ReprotuneError(problems, total=sum(r.total_problems for r in results))
    return results
