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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprotune.errors import ReprotuneError

FORMATS = ("chat", "chat_json", "sharegpt", "alpaca", "prompt_completion")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
# Optional keys each record format tolerates besides its required ones ("id" and "metadata" are carried
# by many exporters and are dropped here: train/eval read only the messages).
RECORD_KEYS: dict[str, tuple[set[str], set[str]]] = {  # format -> (required, optional)
    "chat": ({"messages"}, {"id", "metadata"}),
    "sharegpt": ({"conversations"}, {"id", "metadata", "system"}),
    "alpaca": ({"instruction", "output"}, {"input", "system", "id", "metadata"}),
    "prompt_completion": ({"prompt", "completion"}, {"system", "id", "metadata"}),
}
SUFFIXES = (".jsonl", ".json")
MAX_PROBLEMS_PER_FILE = 50


@dataclass
class Record:
    """One canonical example and where it came from (for error messages and the report)."""

    messages: list[dict[str, str]]
    file: str
    line: int


@dataclass
class FileResult:
    path: str
    container: str  # jsonl | json_array
    format: str | None
    records: list[Record] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


class _Problems:
    """Collects problems for one file, capped so a wholly wrong file does not print 100k lines."""

    def __init__(self, path: str):
        self.path, self.items, self.dropped = path, [], 0

    def add(self, line: int, fld: str, what: str) -> None:
        if len(self.items) < MAX_PROBLEMS_PER_FILE:
            self.items.append(f"{self.path}:{line}: {fld}: {what}")
        else:
            self.dropped += 1

    def lines(self) -> list[str]:
        more = [f"{self.path}: ... and {self.dropped} more problems"] if self.dropped else []
        return self.items + more


def list_input_files(path: Path) -> list[Path]:
    """The files a data.path names: the file itself, or every *.jsonl/*.json under a folder, sorted."""
    if not path.exists():
        raise ReprotuneError([f"{path}:0: path: no such file or directory (set data.path=<file or folder>)"])
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise ReprotuneError([f"{path}:0: path: folder holds no .jsonl or .json files"])
    return files


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
            bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


def _decode(path: Path, problems: _Problems) -> str | None:
    """File bytes as text: UTF-8, a leading BOM and CRLF tolerated; invalid bytes reported by line."""
    raw = path.read_bytes()
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        for number, line in enumerate(raw.split(b"\n"), start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                problems.add(number, "encoding", f"invalid UTF-8 (byte 0x{line[err.start]:02x} at column "
                                                 f"{err.start + 1}); save the file as UTF-8")
        return None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _iter_jsonl(text: str, problems: _Problems) -> Iterator[tuple[int, Any]]:
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue  # blank lines are harmless
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            problems.add(number, "json", f"invalid JSON: {err.msg} at column {err.colno}")


def _iter_json_array(text: str, problems: _Problems) -> Iterator[tuple[int, Any]]:
    """Elements of a top-level JSON array with the line each starts on (json.loads would lose it)."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        problems.add(err.lineno, "json", f"invalid JSON: {err.msg} at column {err.colno}")
        return
    if not isinstance(document, list):
        problems.add(1, "(top level)", f"expected a JSON array of examples, got {_type_name(document)}")
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


def _check_keys(record: dict, fmt: str, line: int, problems: _Problems) -> tuple[bool, bool]:
    """(all required keys present, no unknown keys); both are reported."""
    required, optional = RECORD_KEYS[fmt]
    missing = sorted(required - record.keys())
    unknown = sorted(record.keys() - required - optional)
    for key in missing:
        problems.add(line, key, f"missing (required in {fmt} records: {', '.join(sorted(required))})")
    for key in unknown:
        problems.add(line, key, f"unknown key for a {fmt} record (allowed: {', '.join(sorted(required | optional))})")
    return not missing, not unknown


def _check_text(value: Any, line: int, fld: str, problems: _Problems, allow_empty: bool = False) -> bool:
    if not isinstance(value, str):
        problems.add(line, fld, f"must be a string, got {_type_name(value)}")
        return False
    if not allow_empty and not value.strip():
        problems.add(line, fld, "is empty")
        return False
    return True


def check_conversation(messages: list[dict[str, str]], line: int, fld: str, problems: _Problems,
                       role_names: dict[str, str] | None = None) -> bool:
    """Role order: optional system first, then user/assistant alternating, ending with assistant."""
    def shown(role: str) -> str:  # name roles as the user's file does (human/gpt for ShareGPT)
        return role_names.get(role, role) if role_names else role

    ok = True
    expected = "user"
    for i, msg in enumerate(messages):
        role = msg["role"]
        if role == "system":
            if i != 0:
                problems.add(line, f"{fld}[{i}]", f"roles out of order: {shown('system')} is only allowed as the first turn")
                ok = False
            continue
        if role != expected:
            previous = shown(messages[i - 1]["role"]) if i else "the start"
            problems.add(line, f"{fld}[{i}]", f"roles out of order: {shown(role)} after {previous} "
                                              f"(expected {shown(expected)})")
            return False
        expected = "assistant" if role == "user" else "user"
    if not any(m["role"] == "assistant" for m in messages):
        problems.add(line, fld, f"no {shown('assistant')} turn (nothing for the model to learn)")
        return False
    if messages[-1]["role"] != "assistant":
        problems.add(line, fld, f"conversation must end with an {shown('assistant')} turn (last is {shown(messages[-1]['role'])})")
        return False
    return ok


def _turns(record: dict, line: int, problems: _Problems, list_key: str, role_key: str, content_key: str,
           role_map: dict[str, str]) -> list[dict[str, str]] | None:
    turns = record[list_key]
    if not isinstance(turns, list):
        problems.add(line, list_key, f"must be an array of turns, got {_type_name(turns)}")
        return None
    if not turns:
        problems.add(line, list_key, "is empty")
        return None
    out, ok = [], True
    for i, turn in enumerate(turns):
        where = f"{list_key}[{i}]"
        if not isinstance(turn, dict):
            problems.add(line, where, f"must be an object with {role_key} and {content_key}, got {_type_name(turn)}")
            ok = False
            continue
        for key in sorted({role_key, content_key} - turn.keys()):
            problems.add(line, f"{where}.{key}", "missing")
            ok = False
        for key in sorted(turn.keys() - {role_key, content_key}):
            problems.add(line, f"{where}.{key}", f"unknown key (allowed: {role_key}, {content_key})")
            ok = False
        if role_key not in turn or content_key not in turn:
            continue
        role = turn[role_key]
        if role not in role_map:
            problems.add(line, f"{where}.{role_key}", f"unknown role {json.dumps(role)} "
                                                      f"(expected {', '.join(sorted(set(role_map)))})")
            ok = False
            continue
        if not _check_text(turn[content_key], line, f"{where}.{content_key}", problems):
            ok = False
            continue
        out.append({"role": role_map[role], "content": turn[content_key]})
    if not ok:
        return None
    names = {v: k for k, v in role_map.items() if k not in ("user", "assistant")} if list_key == "conversations" else None
    return out if check_conversation(out, line, list_key, problems, names) else None


def _pair(record: dict, line: int, problems: _Problems, prompt_keys: tuple[str, ...], answer_key: str) -> list | None:
    ok = True
    for key in (*prompt_keys, answer_key, "system"):
        if key in record and not _check_text(record[key], line, key, problems,
                                             allow_empty=(key == "input")):
            ok = False
    if not ok:
        return None
    prompt = "\n\n".join(record[k] for k in prompt_keys if record.get(k, "").strip())
    messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": record[answer_key]}]


def to_messages(record: dict, fmt: str, line: int, problems: _Problems) -> list[dict[str, str]] | None:
    """Validate one record of a known format and convert it to canonical messages (None if invalid)."""
    complete, known = _check_keys(record, fmt, line, problems)
    if not complete:
        return None
    messages = _convert(record, fmt, line, problems)  # still checked with unknown keys: report everything
    return messages if known else None


def _convert(record: dict, fmt: str, line: int, problems: _Problems) -> list[dict[str, str]] | None:
    if fmt == "chat":
        return _turns(record, line, problems, "messages", "role", "content", {r: r for r in ROLES})
    if fmt == "sharegpt":
        messages = _turns(record, line, problems, "conversations", "from", "value", SHAREGPT_ROLES)
        if messages is not None and "system" in record:
            if not _check_text(record["system"], line, "system", problems):
                return None
            if messages[0]["role"] == "system":
                problems.add(line, "system", "given both as a key and as the first turn")
                return None
            messages = [{"role": "system", "content": record["system"]}, *messages]
        return messages
    if fmt == "alpaca":
        return _pair(record, line, problems, ("instruction", "input"), "output")
    return _pair(record, line, problems, ("prompt",), "completion")


def read_file(path: Path, forced: str = "auto") -> FileResult:
    """Read, validate and convert one file; problems are collected in the result, never raised."""
    problems = _Problems(str(path))
    text = _decode(path, problems)
    stripped = (text or "").lstrip()
    container = "json_array" if stripped.startswith("[") or forced == "chat_json" else "jsonl"
    result = FileResult(path=str(path), container=container, format=None if forced == "auto" else forced)
    if text is not None and not stripped:
        problems.add(1, "file", "empty file (no examples)")
    if text is None or not stripped:
        result.problems = problems.lines()
        return result
    if forced == "chat_json" and not stripped.startswith("["):
        problems.add(1, "(top level)", "data.format=chat_json expects a JSON array of examples")
        result.problems = problems.lines()
        return result
    record_format = {"auto": None, "chat_json": "chat"}.get(forced, forced)
    first_line_of_format = 0
    rows = _iter_json_array(text, problems) if container == "json_array" else _iter_jsonl(text, problems)
    n_rows = 0
    for line, record in rows:
        n_rows += 1
        if not isinstance(record, dict):
            problems.add(line, "(top level)", f"expected a JSON object per example, got {_type_name(record)}")
            continue
        fmt = detect_record_format(record)
        if fmt is None:
            problems.add(line, "(keys)", f"not a known record format (keys: {', '.join(sorted(record)) or 'none'}); "
                                         f"expected messages, conversations, instruction/output or prompt/completion")
            continue
        if record_format is None:
            record_format, first_line_of_format = fmt, line
        elif fmt != record_format:
            origin = f"line {first_line_of_format}" if first_line_of_format else f"data.format={forced}"
            problems.add(line, "(keys)", f"mixed formats in one file: this record is {fmt}, but {origin} "
                                         f"made the file {record_format}")
            continue
        messages = to_messages(record, fmt, line, problems)
        if messages is not None:
            result.records.append(Record(messages=messages, file=str(path), line=line))
    if n_rows == 0 and not problems.items:
        problems.add(1, "file", "empty file (no examples)")
    if record_format is not None:
        result.format = "chat_json" if (record_format == "chat" and container == "json_array") else record_format
    result.problems = problems.lines()
    return result


def read_dataset(path: Path, forced: str = "auto") -> list[FileResult]:
    """Every file under data.path, read and validated; raises ReprotuneError with all problems of all files."""
    if forced not in ("auto", *FORMATS):
        raise ReprotuneError([f"{path}:0: data.format: unknown format {forced!r} (auto, {', '.join(FORMATS)})"])
    results = [read_file(p, forced) for p in list_input_files(path)]
    problems = [line for r in results for line in r.problems]
    if problems:
        raise ReprotuneError(problems)
    return results
