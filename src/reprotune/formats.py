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
from reprotune.io import scan_utf8, text_lf, text_lines
from reprotune.schema import DATA_FORMATS

FORMATS = DATA_FORMATS  # data.format's values but auto (reprotune.schema)
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool"}
# Keys each record format needs, and the optional ones it uses; any other key is an extra key, dropped and
# counted (data.extra_keys=drop) or reported (data.extra_keys=error). "id"/"metadata" are carried by many
# exporters and dropped quietly: train/eval read only the messages (and tools).
RECORD_KEYS: dict[str, tuple[set[str], set[str]]] = {  # format -> (required, optional)
    "chat": ({"messages"}, {"tools"}),
    "sharegpt": ({"conversations"}, {"system", "tools"}),
    "alpaca": ({"instruction", "output"}, {"input", "system"}),
    "prompt_completion": ({"prompt", "completion"}, {"system", "tools"}),
}
QUIET_KEYS = {"id", "metadata"}
# per-message keys of OpenAI's chat format that we keep (everything else in a message is an extra key)
MESSAGE_KEYS = {"role", "content", "tool_calls", "tool_call_id", "name", "weight"}
SUFFIXES = (".jsonl", ".json")
MAX_PROBLEMS_PER_FILE = 50
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


@dataclass
class _Problem:
    line: int
    fld: str
    what: str
    record: bool  # about one record (skippable with data.on_invalid=skip), not the whole file


class _Problems:
    """Collects problems for one file; printing is capped so a wholly wrong file does not print 100k lines,
    the total is not."""

    def __init__(self, path: str):
        self.path, self.all = path, []

    def add(self, line: int, fld: str, what: str, record: bool = True) -> None:
        self.all.append(_Problem(line, fld, what, record))

    def render(self, items: list[_Problem]) -> list[str]:
        lines = [f"{self.path}:{p.line}: {p.fld}: {p.what}" for p in items[:MAX_PROBLEMS_PER_FILE]]
        more = len(items) - len(lines)
        return lines + ([f"{self.path}: ... and {more} more problems"] if more else [])

    @property
    def items(self) -> list[_Problem]:
        return self.all


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


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
            bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


TOO_DEEP = "nested too deeply to parse (arrays/objects more than about 1,000 levels deep); flatten the record"


def _iter_jsonl(lines: Iterable[str], problems: _Problems) -> Iterator[tuple[int, Any]]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines are harmless
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            problems.add(number, "json", f"invalid JSON: {err.msg} at column {err.colno}")
        except RecursionError:  # the C decoder gives up past the interpreter's recursion limit
            problems.add(number, "json", TOO_DEEP)


def _iter_json_array(text: str, problems: _Problems) -> Iterator[tuple[int, Any]]:
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
        problems.add(1, "(top level)", f"expected a JSON array of examples, got {_type_name(document)}", record=False)
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


@dataclass
class _Reader:
    """What converting one file needs besides the record: where problems go and the extra-keys policy."""

    problems: _Problems
    extra_keys: str = "drop"
    extra: Counter = field(default_factory=Counter)

    def add(self, line: int, fld: str, what: str) -> None:
        self.problems.add(line, fld, what)

    def unknown_key(self, line: int, where: str, counted_as: str, allowed: set[str]) -> bool:
        """An extra key: counted and dropped (True), or a problem with data.extra_keys=error (False)."""
        if self.extra_keys == "error":
            self.add(line, where, f"unknown key (allowed: {', '.join(sorted(allowed))}; data.extra_keys=drop "
                                  f"drops unknown keys)")
            return False
        self.extra[counted_as] += 1
        return True


def _check_keys(record: dict, fmt: str, line: int, reader: _Reader) -> bool:
    """All required keys present (missing ones reported); unknown ones counted or reported."""
    required, optional = RECORD_KEYS[fmt]
    missing = sorted(required - record.keys())
    for key in missing:
        reader.add(line, key, f"missing (required in {fmt} records: {', '.join(sorted(required))})")
    known = all([reader.unknown_key(line, key, key, required | optional | QUIET_KEYS)
                 for key in sorted(record.keys() - required - optional - QUIET_KEYS)])
    return not missing and known


def _text(value: Any, line: int, fld: str, reader: _Reader, allow_empty: bool = False) -> str | None:
    """A message's text: a string, or OpenAI's list of text parts (joined); None (reported) otherwise."""
    if isinstance(value, list) and value and all(isinstance(p, dict) and p.get("type") == "text"
                                                 and isinstance(p.get("text"), str) for p in value):
        value = "".join(p["text"] for p in value)
    if isinstance(value, list):
        reader.add(line, fld, 'must be a string or a list of {"type": "text", "text": ...} parts, got an array '
                              'with other parts')
        return None
    if not isinstance(value, str):
        reader.add(line, fld, f"must be a string, got {_type_name(value)}")
        return None
    if not allow_empty and not value.strip():
        reader.add(line, fld, "is empty")
        return None
    return value


def _json_value(value: Any, line: int, fld: str, reader: _Reader) -> Any:
    """Tool schemas and call arguments arrive as JSON objects or as JSON text (ShareGPT, OpenAI arguments)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        reader.add(line, fld, f"invalid JSON text: {err.msg} at column {err.colno}")
        return _INVALID


_INVALID = object()


def _tool_calls(value: Any, line: int, fld: str, reader: _Reader) -> list[dict] | None:
    """Canonical calls: {"type": "function", "function": {"name", "arguments": JSON text}} (+ "id").

    Arguments are kept as JSON text (OpenAI's own form): as objects, a dataset of calls to different tools
    would be widened by Arrow to the union of every tool's argument names, each filled with null.
    """
    value = _json_value(value, line, fld, reader)
    if value is _INVALID:
        return None
    if isinstance(value, dict):
        value = [value]  # ShareGPT's function_call holds one call
    if not isinstance(value, list) or not value:
        reader.add(line, fld, f"must be a non-empty array of tool calls, got {_type_name(value)}")
        return None
    calls = []
    for i, call in enumerate(value):
        where = f"{fld}[{i}]"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            reader.add(line, where, "must be an object with function.name (or name) and arguments")
            return None
        arguments = _json_value(function.get("arguments", {}), line, f"{where}.arguments", reader)
        if arguments is _INVALID:
            return None
        if not isinstance(arguments, dict):
            reader.add(line, f"{where}.arguments", f"must be a JSON object, got {_type_name(arguments)}")
            return None
        canonical = {"type": "function",
                     "function": {"name": function["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}
        if isinstance(call.get("id"), str):
            canonical["id"] = call["id"]
        calls.append(canonical)
    return calls


def _tools(value: Any, line: int, reader: _Reader) -> list[dict] | None | object:
    """Canonical tool list [{"type": "function", "function": schema}]; None for none, _INVALID if wrong."""
    value = _json_value(value, line, "tools", reader)
    if value is _INVALID:
        return _INVALID
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        reader.add(line, "tools", f"must be an array of tool definitions, got {_type_name(value)}")
        return _INVALID
    out = []
    for i, tool in enumerate(value):
        schema = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str) or not schema["name"]:
            reader.add(line, f"tools[{i}]", "must be an object with function.name (or name)")
            return _INVALID
        out.append({"type": "function", "function": schema})
    return out


def _message(turn: dict, role: str, content: Any, line: int, where: str, content_key: str,
             reader: _Reader) -> dict | None:
    """One canonical message from a turn whose role is known."""
    has_calls = role == "assistant" and turn.get("tool_calls") is not None
    text = "" if has_calls and content is None else _text(content, line, f"{where}.{content_key}", reader,
                                                            allow_empty=has_calls or role == "tool")
    if text is None:
        return None
    message: dict[str, Any] = {"role": role, "content": text}
    if turn.get("tool_calls") is not None:
        if role != "assistant":
            reader.add(line, f"{where}.tool_calls", f"only assistant messages call tools (this one is {role})")
            return None
        calls = _tool_calls(turn["tool_calls"], line, f"{where}.tool_calls", reader)
        if calls is None:
            return None
        message["tool_calls"] = calls
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(turn.get(key), str):
                message[key] = turn[key]
    if "weight" in turn:
        if turn["weight"] not in (0, 1) or isinstance(turn["weight"], bool) or role != "assistant":
            reader.add(line, f"{where}.weight", "must be 0 or 1, on an assistant message (0: not learned from)")
            return None
        if turn["weight"] == 0:
            message["weight"] = 0
    return message


def _parse_turns(turns: Any, line: int, reader: _Reader, list_key: str, role_key: str, content_key: str,
                 role_map: dict[str, str], allowed: set[str]) -> list[dict] | None:
    """Turns as canonical messages (order not checked yet); every problem of every turn is reported."""
    if not isinstance(turns, list):
        reader.add(line, list_key, f"must be an array of turns, got {_type_name(turns)}")
        return None
    if not turns:
        reader.add(line, list_key, "is empty")
        return None
    out, ok = [], True
    for i, turn in enumerate(turns):
        where = f"{list_key}[{i}]"
        if not isinstance(turn, dict):
            reader.add(line, where, f"must be an object with {role_key} and {content_key}, got {_type_name(turn)}")
            ok = False
            continue
        for key in sorted({role_key, content_key} - turn.keys()):
            if not (key == content_key and turn.get("tool_calls") is not None):  # content may be absent on calls
                reader.add(line, f"{where}.{key}", "missing")
                ok = False
        for key in sorted(turn.keys() - allowed):
            ok = reader.unknown_key(line, f"{where}.{key}", f"{list_key}[].{key}", allowed) and ok
        if role_key not in turn or (content_key not in turn and turn.get("tool_calls") is None):
            continue
        role = turn[role_key]
        if role not in role_map:
            reader.add(line, f"{where}.{role_key}", f"unknown role {json.dumps(role)} "
                                                    f"(expected {', '.join(sorted(set(role_map)))})")
            ok = False
            continue
        if role == "function_call":  # ShareGPT tool-calling layout: the call is the assistant's turn
            message = _message({"tool_calls": turn[content_key]}, "assistant", "", line, where, content_key, reader)
        else:
            message = _message(turn, role_map[role], turn.get(content_key), line, where, content_key, reader)
        if message is None:
            ok = False
            continue
        out.append(message)
    return out if ok else None


def check_conversation(messages: list[dict[str, Any]], line: int, fld: str, problems: _Problems | _Reader,
                       role_names: dict[str, str] | None = None) -> bool:
    """Role order: optional system first; user, then assistant; an assistant turn that calls tools is
    followed by tool results, and those by the assistant again; the conversation ends with the assistant.
    Agent traces invoke tools in the assistant's text (no tool_calls) and follow with a tool turn: accepted too;
    prepare checks that the chat template has a tool role to render it (reprotune.prepare.check_templates)."""
    def shown(message: dict | None) -> str:  # name roles as the user's file does (human/gpt for ShareGPT)
        if message is None:
            return "the start"
        role = "function_call" if role_names and message.get("tool_calls") else message["role"]
        return role_names.get(role, role) if role_names else role

    def expected_after(message: dict | None) -> tuple[str, ...]:
        if message is None or message["role"] == "system":
            return ("user",)
        if message["role"] == "user":
            return ("assistant",)
        if message["role"] == "tool":
            return ("tool", "assistant")
        return ("tool",) if message.get("tool_calls") else ("user", "tool")

    previous = None
    for i, msg in enumerate(messages):
        if msg["role"] == "system" and i != 0:
            problems.add(line, f"{fld}[{i}]", f"roles out of order: {shown(msg)} is only allowed as the first turn")
            return False
        if i == 0 and msg["role"] == "system":
            previous = msg
            continue
        expected = expected_after(previous)
        if msg["role"] not in expected:
            names = " or ".join(shown({"role": r}) for r in expected)
            problems.add(line, f"{fld}[{i}]", f"roles out of order: {shown(msg)} after {shown(previous)} "
                                              f"(expected {names})")
            return False
        previous = msg
    if not any(m["role"] == "assistant" for m in messages):
        problems.add(line, fld, f"no {shown({'role': 'assistant'})} turn (nothing for the model to learn)")
        return False
    if messages[-1]["role"] != "assistant":
        problems.add(line, fld, f"conversation must end with an {shown({'role': 'assistant'})} turn "
                                f"(last is {shown(messages[-1])})")
        return False
    return True


def _chat(record: dict, line: int, reader: _Reader) -> list[dict] | None:
    messages = _parse_turns(record["messages"], line, reader, "messages", "role", "content",
                            {r: r for r in ROLES}, MESSAGE_KEYS)
    return messages if messages is not None and check_conversation(messages, line, "messages", reader) else None


def _sharegpt(record: dict, line: int, reader: _Reader) -> list[dict] | None:
    messages = _parse_turns(record["conversations"], line, reader, "conversations", "from", "value",
                            SHAREGPT_ROLES, {"from", "value"})
    if messages is None:
        return None
    if "system" in record:
        system = _text(record["system"], line, "system", reader)
        if system is None:
            return None
        if messages[0]["role"] == "system":
            reader.add(line, "system", "given both as a key and as the first turn")
            return None
        messages = [{"role": "system", "content": system}, *messages]
    names = {"user": "human", "assistant": "gpt", "tool": "observation", "function_call": "function_call"}
    return messages if check_conversation(messages, line, "conversations", reader, names) else None


def _pair(record: dict, line: int, reader: _Reader, prompt_keys: tuple[str, ...], answer_key: str) -> list | None:
    texts = {key: _text(record[key], line, key, reader, allow_empty=(key == "input"))
             for key in (*prompt_keys, answer_key, "system") if key in record}
    if any(v is None for v in texts.values()):
        return None
    prompt = "\n\n".join(texts[k] for k in prompt_keys if texts.get(k, "").strip())
    messages = [{"role": "system", "content": texts["system"]}] if texts.get("system") else []
    return messages + [{"role": "user", "content": prompt}, {"role": "assistant", "content": texts[answer_key]}]


def _prompt_completion(record: dict, line: int, reader: _Reader) -> list[dict] | None:
    """Plain (strings) or conversational (TRL's layout: message lists); the loss covers the completion only,
    so assistant turns inside a conversational prompt get weight 0."""
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return _pair(record, line, reader, ("prompt",), "completion")
    parts = []
    for key, value, default_role in (("prompt", prompt, "user"), ("completion", completion, "assistant")):
        if isinstance(value, list):
            parts.append(_parse_turns(value, line, reader, key, "role", "content", {r: r for r in ROLES},
                                      MESSAGE_KEYS))
        else:
            text = _text(value, line, key, reader)
            parts.append(None if text is None else [{"role": default_role, "content": text}])
    system = _text(record["system"], line, "system", reader) if "system" in record else ""
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


def to_record(record: dict, fmt: str, line: int, path: str, reader: _Reader) -> Record | None:
    """Validate one record of a known format and convert it (None if invalid; every problem reported)."""
    complete = _check_keys(record, fmt, line, reader)
    if not complete and not (RECORD_KEYS[fmt][0] <= record.keys()):
        return None
    messages = CONVERTERS[fmt](record, line, reader)  # still checked with unknown keys: report everything
    tools = _tools(record["tools"], line, reader) if "tools" in record else None
    if messages is None or tools is _INVALID or not complete:
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
    problems = _Problems(str(path))
    reader = _Reader(problems, extra_keys)
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


def _finish(result: FileResult, problems: _Problems, reader: _Reader, on_invalid: str) -> FileResult:
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
