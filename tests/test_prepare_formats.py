"""Input formats and validation (reprotune.formats): every format converts to canonical messages, every
problem is reported as file:line: field: what, all of them at once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.errors import ReprotuneError
from reprotune.formats import read_dataset, read_file
from reprotune.formats_checks import MAX_PROBLEMS_PER_FILE

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]


def write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    return path


def jsonl(*rows: object) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def problems_of(path: Path, fmt: str = "auto", **options: str) -> list[str]:
    with pytest.raises(ReprotuneError) as err:
        read_dataset(path, fmt, **options)
    return err.value.problems


# --- every format becomes the same canonical messages ---------------------------------------------------------


def test_chat_jsonl(tmp_path: Path) -> None:
    result = read_file(write(tmp_path, "a.jsonl", jsonl({"messages": CHAT}, {"messages": CHAT[1:], "id": 7})))
    assert result.format == "chat" and not result.problems
    assert [r.messages for r in result.records] == [CHAT, CHAT[1:]]
    assert [r.line for r in result.records] == [1, 2]


def test_chat_json_array_keeps_line_numbers(tmp_path: Path) -> None:
    text = "[\n  " + json.dumps({"messages": CHAT}) + ",\n\n  " + json.dumps({"messages": CHAT[1:]}, indent=2) + "\n]\n"
    result = read_file(write(tmp_path, "a.json", text))
    assert result.format == "chat_json" and not result.problems
    assert [r.messages for r in result.records] == [CHAT, CHAT[1:]]
    assert [r.line for r in result.records] == [2, 4]


def test_sharegpt(tmp_path: Path) -> None:
    row = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                             {"from": "gpt", "value": "Hello"}]}
    row2 = {"system": "Be brief.", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    result = read_file(write(tmp_path, "s.jsonl", jsonl(row, row2)))
    assert result.format == "sharegpt" and not result.problems
    assert [r.messages for r in result.records] == [CHAT, CHAT]


def test_alpaca(tmp_path: Path) -> None:
    rows = [{"instruction": "Translate to French", "input": "cat", "output": "chat"},
            {"instruction": "Say hi", "input": "", "output": "Hi", "system": "Be brief."}]
    result = read_file(write(tmp_path, "a.jsonl", jsonl(*rows)))
    assert result.format == "alpaca" and not result.problems
    assert result.records[0].messages == [{"role": "user", "content": "Translate to French\n\ncat"},
                                          {"role": "assistant", "content": "chat"}]
    assert result.records[1].messages == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"}]


def test_prompt_completion(tmp_path: Path) -> None:
    result = read_file(write(tmp_path, "p.jsonl", jsonl({"prompt": "2+2=", "completion": "4"})))
    assert result.format == "prompt_completion" and not result.problems
    assert result.records[0].messages == [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]


def test_bom_crlf_and_blank_lines_are_tolerated(tmp_path: Path) -> None:
    body = jsonl({"messages": CHAT}, {"messages": CHAT}).replace("\n", "\r\n")
    path = write(tmp_path, "w.jsonl", b"\xef\xbb\xbf" + ("\r\n" + body + "\r\n\r\n").encode())
    result = read_file(path)
    assert not result.problems
    assert [r.line for r in result.records] == [2, 3]
    assert result.records[0].messages == CHAT  # no \r left in the content


def test_forced_format(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl({"prompt": "a", "completion": "b"}))
    assert read_dataset(path, "prompt_completion")[0].format == "prompt_completion"
    assert problems_of(path, "chat") == [
        f"{path}:1: data.format: chat was forced, but 1 of 1 records look like prompt_completion records "
        f"(keys: completion, prompt); set data.format=prompt_completion or data.format=auto"]
    assert problems_of(path, "yaml") == [f"{path}:0: data.format: unknown format 'yaml' "
                                         f"(auto, chat, chat_json, sharegpt, alpaca, prompt_completion)"]


def test_folder_reads_every_json_file_sorted(tmp_path: Path) -> None:
    write(tmp_path, "b.jsonl", jsonl({"messages": CHAT}))
    write(tmp_path, "a.json", json.dumps([{"prompt": "a", "completion": "b"}]))
    write(tmp_path, "notes.txt", "ignored")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub", "c.jsonl", jsonl({"instruction": "x", "output": "y"}))
    results = read_dataset(tmp_path)
    assert [Path(r.path).name for r in results] == ["a.json", "b.jsonl", "c.jsonl"]
    assert [r.format for r in results] == ["prompt_completion", "chat", "alpaca"]


# --- every error: text and line number ------------------------------------------------------------------------


def test_invalid_json_reports_every_bad_line(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl({"messages": CHAT}) + '{"messages": [}\n' + jsonl({"messages": CHAT}) + "{oops\n")
    assert problems_of(path) == [f"{path}:2: json: invalid JSON: Expecting value at column 15",
                                 f"{path}:4: json: invalid JSON: Expecting property name enclosed in double quotes at column 2"]


def test_invalid_json_array(tmp_path: Path) -> None:
    path = write(tmp_path, "a.json", '[\n {"messages": []},\n {"messages": ]\n]')
    assert problems_of(path) == [f"{path}:3: json: invalid JSON: Expecting value at column 15"]


def test_wrong_top_level_type(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl({"messages": CHAT}, ["not", "an", "object"], "text"))
    assert problems_of(path) == [f"{path}:2: (top level): expected a JSON object per example, got an array",
                                 f"{path}:3: (top level): expected a JSON object per example, got a string"]
    obj = write(tmp_path, "o.json", jsonl({"messages": CHAT}))
    assert read_file(obj).format == "chat"  # one object per line is JSONL, even in a .json file
    forced = write(tmp_path, "f.json", jsonl({"messages": CHAT}))
    assert problems_of(forced, "chat_json") == [f"{forced}:1: (top level): data.format=chat_json expects a JSON array of examples"]


def test_missing_and_unknown_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl({"instruction": "x"}, {"prompt": "p", "completion": "c", "label": 1},
                                            {"messages": [{"role": "user", "content": "a", "name": "bob"},
                                                          {"content": "b"}]}, {"foo": 1}))
    assert problems_of(path) == [
        f"{path}:1: output: missing (required in alpaca records: instruction, output)",
        f"{path}:2: (keys): mixed formats in one file: this record is prompt_completion, but line 1 made the file alpaca",
        f"{path}:3: (keys): mixed formats in one file: this record is chat, but line 1 made the file alpaca",
        f"{path}:4: (keys): not a known record format (keys: foo); expected messages, conversations, "
        f"instruction/output or prompt/completion",
    ]
    chat = write(tmp_path, "c.jsonl", jsonl({"messages": [{"role": "user", "content": "a", "name": "bob"}, {"content": "b"}]},
                                            {"messages": CHAT, "label": 1}))
    assert problems_of(chat) == [f"{chat}:1: messages[1].role: missing"]  # extra keys are dropped by default
    assert problems_of(chat, extra_keys="error") == [
        f"{chat}:1: messages[1].role: missing",
        f"{chat}:2: label: unknown key (allowed: id, messages, metadata, tools; data.extra_keys=drop drops unknown keys)",
    ]


def test_unknown_role(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl({"messages": [{"role": "human", "content": "a"}, {"role": "assistant", "content": "b"}]}))
    assert problems_of(path) == [f'{path}:1: messages[0].role: unknown role "human" (expected assistant, system, tool, user)']
    sg = write(tmp_path, "s.jsonl", jsonl({"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}))
    assert problems_of(sg) == [f'{sg}:1: conversations[1].from: unknown role "bot" '
                               f'(expected assistant, function_call, gpt, human, observation, system, tool, user)']


def test_non_string_and_empty_content(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl(
        {"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "  "}]},
        {"prompt": 3, "completion": None}, ))
    assert problems_of(path) == [
        f'{path}:1: messages[0].content: must be a string or a list of {{"type": "text", "text": ...}} parts, '
        f"got an array with other parts",
        f"{path}:1: messages[1].content: is empty",
        f"{path}:2: (keys): mixed formats in one file: this record is prompt_completion, but line 1 made the file chat",
    ]
    pc = write(tmp_path, "p.jsonl", jsonl({"prompt": 3, "completion": None}))
    assert problems_of(pc) == [f"{pc}:1: prompt: must be a string, got a number",
                               f"{pc}:1: completion: must be a string, got null"]


def test_no_assistant_turn_and_not_ending_with_assistant(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl(
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]},
        {"messages": CHAT + [{"role": "user", "content": "and?"}]},
        {"messages": []}))
    assert problems_of(path) == [
        f"{path}:1: messages: no assistant turn (nothing for the model to learn)",
        f"{path}:2: messages: conversation must end with an assistant turn (last is user)",
        f"{path}:3: messages: is empty",
    ]
    sg = write(tmp_path, "s.jsonl", jsonl({"conversations": [{"from": "human", "value": "a"}]}))
    assert problems_of(sg) == [f"{sg}:1: conversations: no gpt turn (nothing for the model to learn)"]


def test_roles_out_of_order(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl(
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]},
        {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}, {"role": "assistant", "content": "c"}]}))
    assert problems_of(path) == [
        f"{path}:1: messages[1]: roles out of order: user after user (expected assistant)",
        f"{path}:2: messages[0]: roles out of order: assistant after the start (expected user)",
        f"{path}:3: messages[1]: roles out of order: system is only allowed as the first turn",
    ]


def test_invalid_utf8(tmp_path: Path) -> None:
    good = jsonl({"messages": CHAT}).encode()
    path = write(tmp_path, "a.jsonl", good + b'{"messages": "caf\xe9"}\n' + good + b"\xff\xfe\n")
    assert problems_of(path) == [f"{path}:2: encoding: invalid UTF-8 (byte 0xe9 at column 18); save the file as UTF-8",
                                 f"{path}:4: encoding: invalid UTF-8 (byte 0xff at column 1); save the file as UTF-8"]


def test_empty_file_and_missing_path(tmp_path: Path) -> None:
    empty = write(tmp_path, "e.jsonl", "\n  \r\n")
    assert problems_of(empty) == [f"{empty}:1: file: empty file (no examples)"]
    bom_only = write(tmp_path, "b.jsonl", b"\xef\xbb\xbf")
    assert problems_of(bom_only) == [f"{bom_only}:1: file: empty file (no examples)"]
    missing = tmp_path / "nope.jsonl"
    assert problems_of(missing) == [f"{missing}:0: path: no such file or directory (set data.path=<file or folder>)"]
    folder = tmp_path / "empty_dir"
    folder.mkdir()
    assert problems_of(folder) == [f"{folder}:0: path: folder holds no .jsonl or .json files"]


def test_mixed_formats_in_one_file(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl({"messages": CHAT}, {"instruction": "a", "output": "b"}, {"messages": CHAT}))
    assert problems_of(path) == [f"{path}:2: (keys): mixed formats in one file: this record is alpaca, "
                                 f"but line 1 made the file chat"]


def test_problems_of_all_files_are_collected_and_capped(tmp_path: Path) -> None:
    write(tmp_path, "a.jsonl", "\n".join(["{bad"] * (MAX_PROBLEMS_PER_FILE + 7)))
    write(tmp_path, "b.jsonl", jsonl({"messages": CHAT[:2]}))
    problems = problems_of(tmp_path)
    assert len(problems) == MAX_PROBLEMS_PER_FILE + 2
    assert problems[MAX_PROBLEMS_PER_FILE] == f"{tmp_path / 'a.jsonl'}: ... and 7 more problems"
    assert problems[-1] == f"{tmp_path / 'b.jsonl'}:1: messages: no assistant turn (nothing for the model to learn)"


# --- tool calls, per-message weights, conversational prompt/completion, extra keys, skipping -----------------

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOL_CANONICAL = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "content": '{"temp_c": 21}'},
    {"role": "assistant", "content": "It is 21 °C in Paris."},
]


def test_openai_and_sharegpt_tool_calls_become_the_same_canonical_form(tmp_path: Path) -> None:
    openai = write(tmp_path, "o.jsonl", jsonl({
        "tools": [{"type": "function", "function": WEATHER}],
        "messages": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "call_1", "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
                     {"role": "assistant", "content": "It is 21 °C in Paris."}]}))
    sharegpt = write(tmp_path, "s.jsonl", jsonl({
        "tools": json.dumps([WEATHER]),  # LLaMA-Factory's layout: tools as JSON text, bare schemas
        "conversations": [{"from": "human", "value": "Weather in Paris?"},
                          {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                                         "arguments": {"city": "Paris"}})},
                          {"from": "observation", "value": '{"temp_c": 21}'},
                          {"from": "gpt", "value": "It is 21 °C in Paris."}]}))
    (o,) = read_file(openai).records
    (s,) = read_file(sharegpt).records
    assert o.tools == s.tools == [{"type": "function", "function": WEATHER}]
    assert s.messages == TOOL_CANONICAL
    assert o.messages[1]["tool_calls"][0].pop("id") == "call_1" and o.messages[2].pop("tool_call_id") == "call_1"
    assert o.messages == TOOL_CANONICAL


def test_tool_call_problems_are_reported(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "",
                                                          "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]},
                      {"role": "tool", "content": "r"}, {"role": "assistant", "content": "b"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "r"},
                      {"role": "assistant", "content": "b"}]},
        {"conversations": [{"from": "human", "value": "a"}, {"from": "function_call", "value": '{"name": "f"}'},
                           {"from": "gpt", "value": "b"}]}))
    assert problems_of(path) == [
        f"{path}:1: messages[1].tool_calls[0].arguments: invalid JSON text: Expecting property name enclosed in "
        f"double quotes at column 2",
        f"{path}:2: messages[1]: roles out of order: tool after user (expected assistant)",
        f"{path}:3: (keys): mixed formats in one file: this record is sharegpt, but line 1 made the file chat",
    ]
    sg = write(tmp_path, "s.jsonl", jsonl({"conversations": [{"from": "human", "value": "a"},
                                                             {"from": "function_call", "value": '{"name": "f"}'},
                                                             {"from": "gpt", "value": "b"}]}))
    assert problems_of(sg) == [f"{sg}:1: conversations[2]: roles out of order: gpt after function_call "
                               f"(expected observation)"]


def test_weight_zero_is_kept_per_message(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "old", "weight": 0},
                      {"role": "user", "content": "b"}, {"role": "assistant", "content": "new", "weight": 1}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x", "weight": 0.5}]}))
    assert problems_of(path) == [f"{path}:2: messages[1].weight: must be 0 or 1, on an assistant message "
                                 f"(0: not learned from)"]
    (record,) = read_file(path, on_invalid="skip").records
    assert record.messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "old", "weight": 0},
                               {"role": "user", "content": "b"}, {"role": "assistant", "content": "new"}]


def test_openai_text_parts_are_joined(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": "Hi"}]}))
    assert read_file(path).records[0].messages[0] == {"role": "user", "content": "Hello, world"}


def test_conversational_prompt_completion(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl({
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Name a colour"}],
        "completion": [{"role": "assistant", "content": "Blue"}]}))
    (record,) = read_dataset(path)[0].records
    assert record.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello", "weight": 0},  # TRL: loss on the completion
                               {"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "Blue"}]


def test_extra_keys_are_dropped_and_counted(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl(
        {"messages": [{"role": "user", "content": "a", "trace_id": "t1"}, {"role": "assistant", "content": "b"}],
         "source": "x", "task": "qa"},
        {"instruction": "i", "output": "o", "source": "y"}, {"messages": CHAT, "id": 3, "source": "z"}))
    with pytest.raises(ReprotuneError):
        read_dataset(path)  # alpaca in a chat file is still wrong
    chat = write(tmp_path, "c.jsonl", jsonl(
        {"messages": [{"role": "user", "content": "a", "trace_id": "t1"}, {"role": "assistant", "content": "b"}],
         "source": "x", "task": "qa"}, {"messages": CHAT, "id": 3, "source": "z"}))
    (result,) = read_dataset(chat)
    assert len(result.records) == 2 and result.records[0].messages[0] == {"role": "user", "content": "a"}
    assert dict(result.extra_keys) == {"messages[].trace_id": 1, "source": 2, "task": 1}


def test_on_invalid_skip_rejects_records_with_reasons(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl({"messages": CHAT}, {"messages": CHAT[:2]}) + "{bad\n" +
                 jsonl({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}))
    (result,) = read_dataset(path, on_invalid="skip")
    assert [r.line for r in result.records] == [1]
    assert result.rejected == [
        {"file": str(path), "line": 2, "reason": "messages: no assistant turn (nothing for the model to learn)"},
        {"file": str(path), "line": 3, "reason": "json: invalid JSON: Expecting property name enclosed in double "
                                                 "quotes at column 2"},
        {"file": str(path), "line": 4, "reason": "messages[1].content: is empty"}]
    empty = write(tmp_path, "e.jsonl", "")
    assert problems_of(empty, on_invalid="skip") == [f"{empty}:1: file: empty file (no examples)"]


def test_total_counts_problems_past_the_cap(tmp_path: Path) -> None:
    write(tmp_path, "a.jsonl", "\n".join(["{bad"] * (MAX_PROBLEMS_PER_FILE + 238)))
    with pytest.raises(ReprotuneError) as err:
        read_dataset(tmp_path)
    assert err.value.total == MAX_PROBLEMS_PER_FILE + 238
    assert err.value.problems[-1].endswith("... and 238 more problems")


def test_forced_format_mismatch_is_said_once(tmp_path: Path) -> None:
    path = write(tmp_path, "a.jsonl", jsonl(*[{"instruction": f"q{i}", "output": "a"} for i in range(300)]))
    assert problems_of(path, "sharegpt") == [
        f"{path}:1: data.format: sharegpt was forced, but 300 of 300 records look like alpaca records "
        f"(keys: instruction, output); set data.format=alpaca or data.format=auto"]
