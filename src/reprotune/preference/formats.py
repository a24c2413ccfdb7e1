"""Preference data formats: each record read into one canonical row, in TRL's own layout, meaning unchanged.

Canonical rows (what data/prepared/{train,holdout}.jsonl hold for objective=dpo|orpo|kto):
    paired    {"prompt": P, "chosen": C, "rejected": R}          conversational (P, C, R lists of messages) or
                                                                 standard (P, C, R strings: no chat template)
    unpaired  {"prompt": P, "completion": C, "label": bool}      KTO's layout

Formats read (auto-detected per record from its keys; data.format names one to insist on):
    trl           prompt + chosen + rejected (explicit prompt), or chosen + rejected alone (implicit prompt: the
                  shared leading turns, or for text the shared leading characters, are the prompt; TRL's
                  extract_prompt), conversational or standard; a text prompt beside conversations that contain it
                  (UltraFeedback binarized) is read as the implicit prompt, as TRL's maybe_extract_prompt does
    openai        input {messages, ...} + preferred_output + non_preferred_output (OpenAI preference fine-tuning)
    sharegpt_pairwise  conversations [{from, value}] + chosen {from, value} + rejected {from, value}, optional
                  system (LLaMA-Factory)
    kto           messages + label (the last message is the completion), or prompt + completion + label (TRL)
    hh            chosen + rejected full transcripts in "\\n\\nHuman: ...\\n\\nAssistant: ..." text (Anthropic HH)
Other names: data.preference.keys maps a record's keys onto these (e.g. {prompt: question, chosen: response_j,
rejected: response_k}) before detection.

A record that fits none, or half of one, is one line `file:line: field: what`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprotune.errors import ReprotuneError

FORMATS = ("trl", "openai", "sharegpt_pairwise", "kto", "hh")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}
HH_TURN = re.compile(r"\n\n(Human|Assistant): ")
PARTIAL_WORD = re.compile(r"\s*\S*$")


class FormatError(ValueError):
    """What is wrong with one record: the field and the problem (the caller adds file:line)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")


@dataclass(frozen=True)
class PairRecord:
    row: dict[str, Any]  # the canonical row
    format: str
    file: str
    line: int
    split_key: str | None = None  # what decides its split when not its prompt (pairs derived from SFT data)

    @property
    def paired(self) -> bool:
        return "chosen" in self.row


# ------------------------------------------------------------------------------------------------ checks
def sft_checked(check: Any, *args: Any) -> Any:
    """One of reprotune.formats' checks (the SFT reader's: tool calls, tool results, tool lists, so both read them
    alike) on one value; its first problem raised as a FormatError."""
    from reprotune.formats_checks import Problems, Reader

    reader = Reader(Problems(""))
    out = check(*args, reader)
    if reader.problems.items:
        problem = reader.problems.items[0]
        raise FormatError(problem.fld, problem.what)
    return out


def tool_message(msg: dict[str, Any], where: str) -> dict[str, Any]:
    """An assistant message with tool_calls or a tool result, canonical as the SFT reader makes it (arguments as JSON
    text, tool_call_id and name kept)."""
    from reprotune.formats_checks import message_of

    role = msg.get("role")
    return sft_checked(message_of, {k: v for k, v in msg.items() if k != "weight"}, role, msg.get("content"), 0, where,
                       "content")


def messages(value: Any, field: str, last_assistant: bool = False) -> list[dict[str, Any]]:
    """A list of {role, content} messages, roles system/user/assistant, contents strings; assistant tool calls
    and tool results (role tool) as the SFT reader reads them."""
    if not isinstance(value, list) or not value:
        raise FormatError(field, "expected a non-empty list of messages")
    out = []
    for i, msg in enumerate(value):
        if isinstance(msg, dict) and (msg.get("role") == "tool" or
                                      (msg.get("role") == "assistant" and msg.get("tool_calls") is not None)):
            out.append(tool_message(msg, f"{field}[{i}]"))
            continue
        if not isinstance(msg, dict) or not isinstance(msg.get("content"), str):
            raise FormatError(f"{field}[{i}]", "expected {role, content} with a string content")
        if msg.get("role") not in ROLES:
            raise FormatError(f"{field}[{i}].role", f"unknown role {msg.get('role')!r} (system, user, assistant, "
                                                    "tool)")
        out.append({"role": msg["role"], "content": msg["content"]})
    if last_assistant and out[-1]["role"] != "assistant":
        raise FormatError(f"{field}[{len(out) - 1}].role", "the answer must be an assistant message")
    return out


def text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise FormatError(field, "expected a non-empty string")
    return value


def answer(value: Any, field: str) -> list[dict[str, str]] | str:
    """A completion: assistant message(s), or text."""
    return text(value, field) if isinstance(value, str) else messages(value, field, last_assistant=True)


def same_kind(row: dict[str, Any]) -> dict[str, Any]:
    """Prompt and answers all messages or all text: TRL reads one or the other, never a mix."""
    kinds = {k: isinstance(v, str) for k, v in row.items() if k in ("prompt", "chosen", "rejected", "completion")}
    if len(set(kinds.values())) > 1:
        raise FormatError(",".join(kinds), "mixes text and message lists (use one or the other)")
    return row


# ----------------------------------------------------------------------------------------------- formats
def with_tools(row: dict[str, Any], value: Any) -> dict[str, Any]:
    """The row with the record's tool list, canonical as for SFT and kept as JSON text (TRL's "tools" column: it
    json-loads text, and Arrow would widen a column of differing schemas)."""
    if value is None or value == []:
        return row
    if isinstance(row["prompt"], str):
        raise FormatError("tools", "tools need conversational rows (a chat template renders them)")
    from reprotune.formats_checks import tools_of

    tools = sft_checked(tools_of, value, 0)
    return {**row, "tools": json.dumps(tools, ensure_ascii=False)} if tools else row


def from_trl(rec: dict[str, Any]) -> dict[str, Any]:
    return with_tools(trl_row(rec), rec.get("tools"))


def trl_row(rec: dict[str, Any]) -> dict[str, Any]:
    if "prompt" in rec and not text_prompt_with_conversations(rec):
        prompt = text(rec["prompt"], "prompt") if isinstance(rec["prompt"], str) else messages(rec["prompt"], "prompt")
        return same_kind({"prompt": prompt, "chosen": answer(rec["chosen"], "chosen"),
                          "rejected": answer(rec["rejected"], "rejected")})
    from trl.data_utils import extract_prompt

    if isinstance(rec["chosen"], str):
        row = whole_words(extract_prompt({"chosen": text(rec["chosen"], "chosen"),
                                          "rejected": text(rec["rejected"], "rejected")}))
    else:
        row = extract_prompt({"chosen": messages(rec["chosen"], "chosen", True),
                              "rejected": messages(rec["rejected"], "rejected", True)})
    if not row["prompt"]:
        raise FormatError("chosen", "implicit prompt: chosen and rejected share no leading turns (no prompt)")
    if not row["chosen"] or not row["rejected"]:
        raise FormatError("rejected", "implicit prompt: chosen and rejected are the same conversation")
    if "prompt" in rec and not any(m["role"] == "user" and m["content"] == rec["prompt"] for m in row["prompt"]):
        raise FormatError("prompt", "is not a user turn of the conversation that chosen and rejected share")
    return row


def text_prompt_with_conversations(rec: dict[str, Any]) -> bool:
    """A text prompt beside chosen/rejected conversations that hold it (HuggingFaceH4/ultrafeedback_binarized's
    layout: prompt = the user's question, chosen/rejected = the whole conversations): TRL's maybe_extract_prompt
    then takes the implicit prompt from the conversations, and so does this reader; the text prompt must be one of
    the shared prompt's user turns, so nothing of it is lost."""
    chosen, rejected = rec.get("chosen"), rec.get("rejected")
    return (isinstance(rec["prompt"], str) and isinstance(chosen, list) and isinstance(rejected, list)
            and any(isinstance(m, dict) and m.get("role") == "user" for m in chosen))


def whole_words(row: dict[str, str]) -> dict[str, str]:
    """A text prompt that ends inside a word the two answers share the start of ("...Assistant: D" + "uck..." /
    "DG...", or "I" + "'m sorry" / " would") gives that partial word back to both answers: TRL's extract_prompt takes the shared leading
    characters, which cut 41 of 200 Anthropic HH transcripts inside the answer's first word. The texts joined are
    unchanged; only where the prompt ends moves (back to before the last whitespace)."""
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    if not (prompt and chosen and rejected):  # no prompt, or one answer empty: from_trl says so in one line
        return row
    inside_a_word = not prompt[-1].isspace() and (not chosen[0].isspace() or not rejected[0].isspace())
    if not inside_a_word:
        return row
    cut = PARTIAL_WORD.search(prompt).start()
    if cut == 0:
        return row
    return {"prompt": prompt[:cut], "chosen": prompt[cut:] + chosen, "rejected": prompt[cut:] + rejected}


def from_openai(rec: dict[str, Any]) -> dict[str, Any]:
    body = rec["input"]
    if not isinstance(body, dict) or "messages" not in body:
        raise FormatError("input", "expected an object with a messages list")
    row = {"prompt": messages(body["messages"], "input.messages"),
           "chosen": messages(rec["preferred_output"], "preferred_output", True),
           "rejected": messages(rec["non_preferred_output"], "non_preferred_output", True)}
    try:
        return with_tools(row, body.get("tools"))
    except FormatError as err:
        raise FormatError(f"input.{err}".split(": ", 1)[0], str(err).split(": ", 1)[1]) from None


def sharegpt_turn(turn: Any, field: str) -> dict[str, Any]:
    """One turn; LLaMA-Factory's function_call (the value: the call as JSON text) and observation (the tool's
    result) become an assistant tool call and a tool message, as the SFT reader makes them."""
    if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
        raise FormatError(field, "expected {from, value} with a string value")
    if turn.get("from") == "function_call":
        return tool_message({"role": "assistant", "content": "", "tool_calls": turn["value"]}, f"{field}.value")
    if turn.get("from") == "observation":
        return {"role": "tool", "content": turn["value"]}
    role = SHAREGPT_ROLES.get(str(turn.get("from")))
    if role is None:
        raise FormatError(f"{field}.from", f"unknown speaker {turn.get('from')!r} (human, gpt, system, "
                                           "function_call, observation)")
    return {"role": role, "content": turn["value"]}


def from_sharegpt_pairwise(rec: dict[str, Any]) -> dict[str, Any]:
    turns = rec["conversations"]
    if not isinstance(turns, list) or not turns:
        raise FormatError("conversations", "expected a non-empty list of {from, value} turns")
    prompt = [sharegpt_turn(t, f"conversations[{i}]") for i, t in enumerate(turns)]
    if rec.get("system"):
        prompt = [{"role": "system", "content": text(rec["system"], "system")}, *prompt]
    chosen, rejected = sharegpt_turn(rec["chosen"], "chosen"), sharegpt_turn(rec["rejected"], "rejected")
    for name, turn in (("chosen", chosen), ("rejected", rejected)):
        if turn["role"] != "assistant":
            raise FormatError(f"{name}.from", "the answer must come from gpt")
    return with_tools({"prompt": prompt, "chosen": [chosen], "rejected": [rejected]}, rec.get("tools"))


def label(value: Any) -> bool:
    if not isinstance(value, bool):
        raise FormatError("label", f"expected true or false, got {json.dumps(value)}")
    return value


def from_kto(rec: dict[str, Any]) -> dict[str, Any]:
    return with_tools(kto_row(rec), rec.get("tools"))


def kto_row(rec: dict[str, Any]) -> dict[str, Any]:
    if "messages" in rec:
        conv = messages(rec["messages"], "messages", last_assistant=True)
        if len(conv) < 2:
            raise FormatError("messages", "needs a prompt before the answer")
        return {"prompt": conv[:-1], "completion": conv[-1:], "label": label(rec["label"])}
    prompt = text(rec["prompt"], "prompt") if isinstance(rec["prompt"], str) else messages(rec["prompt"], "prompt")
    return same_kind({"prompt": prompt, "completion": answer(rec["completion"], "completion"),
                      "label": label(rec["label"])})


def hh_messages(transcript: str, field: str) -> list[dict[str, str]]:
    """'\\n\\nHuman: ...\\n\\nAssistant: ...' -> messages (the text before the first turn must be empty)."""
    parts = HH_TURN.split(transcript)
    if parts[0].strip() or len(parts) < 3:
        raise FormatError(field, "expected a transcript of '\\n\\nHuman: ' and '\\n\\nAssistant: ' turns")
    return [{"role": "user" if who == "Human" else "assistant", "content": said}
            for who, said in zip(parts[1::2], parts[2::2], strict=True)]


def from_hh(rec: dict[str, Any]) -> dict[str, Any]:
    from trl.data_utils import extract_prompt

    row = extract_prompt({"chosen": hh_messages(text(rec["chosen"], "chosen"), "chosen"),
                          "rejected": hh_messages(text(rec["rejected"], "rejected"), "rejected")})
    for name in ("chosen", "rejected"):
        if not row[name] or row[name][-1]["role"] != "assistant":
            raise FormatError(name, "the transcript must end on an Assistant turn after the shared prompt")
    if not row["prompt"]:
        raise FormatError("chosen", "chosen and rejected share no leading Human turn")
    return row


READERS = {"trl": from_trl, "openai": from_openai, "sharegpt_pairwise": from_sharegpt_pairwise, "kto": from_kto,
           "hh": from_hh}


def detect(rec: dict[str, Any]) -> str:
    """The format of one record, from its keys (and, for chosen/rejected text, from the HH turn markers)."""
    keys = set(rec)
    if {"input", "preferred_output", "non_preferred_output"} <= keys:
        return "openai"
    if {"conversations", "chosen", "rejected"} <= keys:
        return "sharegpt_pairwise"
    if "label" in keys and ({"messages"} <= keys or {"prompt", "completion"} <= keys):
        return "kto"
    if {"chosen", "rejected"} <= keys:
        transcript = "prompt" not in keys and isinstance(rec["chosen"], str) and rec["chosen"].startswith("\n\nHuman: ")
        return "hh" if transcript else "trl"
    raise FormatError("record", f"no preference format has these keys ({', '.join(sorted(keys)) or 'none'}): "
                      "expected prompt/chosen/rejected, input/preferred_output/non_preferred_output, "
                      "conversations/chosen/rejected, messages+label or chosen/rejected transcripts; other names: "
                      "data.preference.keys")


def renamed(rec: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
    """data.preference.keys ({canonical: the record's name}) applied: the record's names become the canonical."""
    if not mapping:
        return rec
    theirs = {v: k for k, v in mapping.items()}
    return {theirs.get(k, k): v for k, v in rec.items()}


def read_record(rec: Any, fmt: str, mapping: dict[str, str], path: str, line: int) -> PairRecord:
    """One raw record as a canonical row; ReprotuneError `file:line: field: what` when it is not one."""
    found = fmt
    try:
        if not isinstance(rec, dict):
            raise FormatError("record", "expected a JSON object")
        rec = renamed(rec, mapping)
        found = detect(rec) if fmt == "auto" else fmt
        if found not in READERS:
            raise FormatError("data.format", f"unknown preference format {fmt!r} (auto, {', '.join(FORMATS)})")
        return PairRecord(row=READERS[found](rec), format=found, file=path, line=line)
    except FormatError as err:
        raise ReprotuneError(f"{path}:{line}: {err}") from None
    except KeyError as err:
        raise ReprotuneError(f"{path}:{line}: {err.args[0]}: missing (format {found})") from None


def data_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".jsonl", ".json") and p.is_file())
        if not files:
            raise ReprotuneError(f"{path}:0: data.path: no .jsonl or .json files in this folder")
        return files
    if not path.is_file():
        raise ReprotuneError(f"{path}:0: data.path: not found")
    return [path]


def raw_records(path: Path) -> list[tuple[int, Any]]:
    """(line, record) of a .jsonl file (one record per line) or a .json file (a list: line 0 = the file)."""
    from reprotune.io import iter_jsonl

    if path.suffix == ".json":
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ReprotuneError(f"{path}:{err.lineno}: json: not valid JSON ({err.msg})") from None
        if not isinstance(value, list):
            raise ReprotuneError(f"{path}:1: json: expected a list of records")
        return [(i + 1, r) for i, r in enumerate(value)]
    return list(iter_jsonl(path))


def read_preference_data(path: Path, fmt: str, mapping: dict[str, str], on_invalid: str
                         ) -> tuple[list[PairRecord], list[dict[str, Any]], list[str]]:
    """Every record of data.path as a canonical row; (records, skipped {file, line, reason}, files read).
    on_invalid=error: every problem at once, nothing kept; skip: bad records listed and left out."""
    records, problems = [], []
    files = data_files(path)
    for file in files:
        for line, rec in raw_records(file):
            try:
                records.append(read_record(rec, fmt, mapping, str(file), line))
            except ReprotuneError as err:
                problems.append({"file": str(file), "line": line, "reason": str(err).split(": ", 1)[1]})
    if problems and on_invalid != "skip":
        raise ReprotuneError([f"{p['file']}:{p['line']}: {p['reason']}" for p in problems])
    kinds = {(r.paired, isinstance(r.row["prompt"], str)) for r in records}
    if len(kinds) > 1:
        first = {k: next(r for r in records if (r.paired, isinstance(r.row["prompt"], str)) == k) for k in kinds}
        where = ", ".join(f"{r.file}:{r.line} ({'paired' if r.paired else 'unpaired'}, "
                          f"{'text' if isinstance(r.row['prompt'], str) else 'messages'})" for r in first.values())
        raise ReprotuneError(f"{where}: data: mixes paired/unpaired or text/message records; TRL reads one kind")
    return records, problems, [str(f) for f in files]
