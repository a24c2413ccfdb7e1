"""The checks behind reprotune.formats: each field, message and conversation of a record validated, every
problem collected as `file:line: field: what is wrong` (never raised one at a time, so a user fixes a file in one
pass), and the extra-keys policy (data.extra_keys) applied."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
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
MAX_PROBLEMS_PER_FILE = 50


@dataclass
class Problem:
    line: int
    fld: str
    what: str
    record: bool  # about one record (skippable with data.on_invalid=skip), not the whole file


class Problems:
    """Collects problems for one file; printing is capped so a wholly wrong file does not print 100k lines,
    the total is not."""

    def __init__(self, path: str):
        self.path, self.all = path, []

    def add(self, line: int, fld: str, what: str, record: bool = True) -> None:
        self.all.append(Problem(line, fld, what, record))

    def render(self, items: list[Problem]) -> list[str]:
        lines = [f"{self.path}:{p.line}: {p.fld}: {p.what}" for p in items[:MAX_PROBLEMS_PER_FILE]]
        more = len(items) - len(lines)
        return lines + ([f"{self.path}: ... and {more} more problems"] if more else [])

    @property
    def items(self) -> list[Problem]:
        return self.all


def type_name(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
            bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


@dataclass
class Reader:
    """What converting one file needs besides the record: where problems go and the extra-keys policy."""

    problems: Problems
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


def check_keys(record: dict, fmt: str, line: int, reader: Reader) -> bool:
    """All required keys present (missing ones reported); unknown ones counted or reported."""
    required, optional = RECORD_KEYS[fmt]
    missing = sorted(required - record.keys())
    for key in missing:
        reader.add(line, key, f"missing (required in {fmt} records: {', '.join(sorted(required))})")
    known = all([reader.unknown_key(line, key, key, required | optional | QUIET_KEYS)
                 for key in sorted(record.keys() - required - optional - QUIET_KEYS)])
    return not missing and known


def text_of(value: Any, line: int, fld: str, reader: Reader, allow_empty: bool = False) -> str | None:
    """A message's text: a string, or OpenAI's list of text parts (joined); None (reported) otherwise."""
    if isinstance(value, list) and value and all(isinstance(p, dict) and p.get("type") == "text"
                                                 and isinstance(p.get("text"), str) for p in value):
        value = "".join(p["text"] for p in value)
    if isinstance(value, list):
        reader.add(line, fld, 'must be a string or a list of {"type": "text", "text": ...} parts, got an array '
                              'with other parts')
        return None
    if not isinstance(value, str):
        reader.add(line, fld, f"must be a string, got {type_name(value)}")
        return None
    if not allow_empty and not value.strip():
        reader.add(line, fld, "is empty")
        return None
    return value


def json_value(value: Any, line: int, fld: str, reader: Reader) -> Any:
    """Tool schemas and call arguments arrive as JSON objects or as JSON text (ShareGPT, OpenAI arguments)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        reader.add(line, fld, f"invalid JSON text: {err.msg} at column {err.colno}")
        return INVALID


INVALID = object()


def tool_calls_of(value: Any, line: int, fld: str, reader: Reader) -> list[dict] | None:
    """Canonical calls: {"type": "function", "function": {"name", "arguments": JSON text}} (+ "id").

    Arguments are kept as JSON text (OpenAI's own form): as objects, a dataset of calls to different tools
    would be widened by Arrow to the union of every tool's argument names, each filled with null.
    """
    value = json_value(value, line, fld, reader)
    if value is INVALID:
        return None
    if isinstance(value, dict):
        value = [value]  # ShareGPT's function_call holds one call
    if not isinstance(value, list) or not value:
        reader.add(line, fld, f"must be a non-empty array of tool calls, got {type_name(value)}")
        return None
    calls = []
    for i, call in enumerate(value):
        where = f"{fld}[{i}]"
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            reader.add(line, where, "must be an object with function.name (or name) and arguments")
            return None
        arguments = json_value(function.get("arguments", {}), line, f"{where}.arguments", reader)
        if arguments is INVALID:
            return None
        if not isinstance(arguments, dict):
            reader.add(line, f"{where}.arguments", f"must be a JSON object, got {type_name(arguments)}")
            return None
        canonical = {"type": "function",
                     "function": {"name": function["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}
        if isinstance(call.get("id"), str):
            canonical["id"] = call["id"]
        calls.append(canonical)
    return calls


def tools_of(value: Any, line: int, reader: Reader) -> list[dict] | None | object:
    """Canonical tool list [{"type": "function", "function": schema}]; None for none, INVALID if wrong."""
    value = json_value(value, line, "tools", reader)
    if value is INVALID:
        return INVALID
    if value is None or value == []:
        return None
    if not isinstance(value, list):
        reader.add(line, "tools", f"must be an array of tool definitions, got {type_name(value)}")
        return INVALID
    out = []
    for i, tool in enumerate(value):
        schema = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(schema, dict) or not isinstance(schema.get("name"), str) or not schema["name"]:
            reader.add(line, f"tools[{i}]", "must be an object with function.name (or name)")
            return INVALID
        out.append({"type": "function", "function": schema})
    return out


def message_of(turn: dict, role: str, content: Any, line: int, where: str, content_key: str,
             reader: Reader) -> dict | None:
    """One canonical message from a turn whose role is known."""
    has_calls = role == "assistant" and turn.get("tool_calls") is not None
    text = "" if has_calls and content is None else text_of(content, line, f"{where}.{content_key}", reader,
                                                            allow_empty=has_calls or role == "tool")
    if text is None:
        return None
    message: dict[str, Any] = {"role": role, "content": text}
    if turn.get("tool_calls") is not None:
        if role != "assistant":
            reader.add(line, f"{where}.tool_calls", f"only assistant messages call tools (this one is {role})")
            return None
        calls = tool_calls_of(turn["tool_calls"], line, f"{where}.tool_calls", reader)
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


def parse_turns(turns: Any, line: int, reader: Reader, list_key: str, role_key: str, content_key: str,
                 role_map: dict[str, str], allowed: set[str]) -> list[dict] | None:
    """Turns as canonical messages (order not checked yet); every problem of every turn is reported."""
    if not isinstance(turns, list):
        reader.add(line, list_key, f"must be an array of turns, got {type_name(turns)}")
        return None
    if not turns:
        reader.add(line, list_key, "is empty")
        return None
    out, ok = [], True
    for i, turn in enumerate(turns):
        where = f"{list_key}[{i}]"
        if not isinstance(turn, dict):
            reader.add(line, where, f"must be an object with {role_key} and {content_key}, got {type_name(turn)}")
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
            message = message_of({"tool_calls": turn[content_key]}, "assistant", "", line, where, content_key, reader)
        else:
            message = message_of(turn, role_map[role], turn.get(content_key), line, where, content_key, reader)
        if message is None:
            ok = False
            continue
        out.append(message)
    return out if ok else None


def check_conversation(messages: list[dict[str, Any]], line: int, fld: str, problems: Problems | Reader,
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
