"""Real public preference files (tests/data/real/SOURCES.md) through the real prepare (objective=dpo|kto): the
counts docs/data.md reports, and every kept pair equal to its source record re-read by hand here (texts, roles,
system prompts and every turn of a multi-turn prompt unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_preference import prepared

# a folder of its own: bench/pii_quality.py reads every file of data/real/ as SFT data
REAL = Path(__file__).parent / "data" / "real" / "preference"
ROLE = {"human": "user", "gpt": "assistant", "system": "system"}


def source(name: str) -> list[dict]:
    path = REAL / name
    if path.suffix == ".json":
        return json.loads(path.read_text(encoding="utf-8"))
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def key(row: dict) -> str:
    return json.dumps(row, ensure_ascii=False, sort_keys=True)


def run(tmp_path: Path, name: str, *over: str) -> tuple[list[dict], dict]:
    train, holdout, report = prepared(tmp_path, REAL / name, "data.max_length=2048", *over)
    return train + holdout, report


def counts(report: dict) -> tuple[int, int, int, int, int, int]:
    p = report["pairs"]
    return (p["read"], p["duplicates_dropped"], p["ties"]["count"], p["overlong"]["dropped"], p["train"],
            p["holdout"])


def sharegpt_row(rec: dict) -> dict:
    turn = lambda t: {"role": ROLE[t["from"]], "content": t["value"]}  # noqa: E731
    return {"prompt": [turn(t) for t in rec["conversations"]], "chosen": [turn(rec["chosen"])],
            "rejected": [turn(rec["rejected"])]}


def test_llamafactory_sharegpt_pairwise_en_keeps_system_prompts_and_turns(tmp_path: Path) -> None:
    rows, report = run(tmp_path, "llamafactory_dpo_en_demo.json")
    assert counts(report) == (50, 0, 0, 0, 46, 4) and report["inputs"][0]["format"] == "sharegpt_pairwise"
    expected = {key(sharegpt_row(r)) for r in source("llamafactory_dpo_en_demo.json")}
    assert {key(r) for r in rows} == expected  # all 50, each exactly its source record
    first = lambda start: next(r for r in rows if r["prompt"][0]["content"].startswith(start))  # noqa: E731
    system = first("You are a teacher. Given a task, you expl")  # record 2: a system turn in conversations
    assert [m["role"] for m in system["prompt"]] == ["system", "user"]
    multi = first('Who wrote the classic novel "Pride and Pr')  # record 5: five turns before the answers
    assert [m["role"] for m in multi["prompt"]] == ["user", "assistant", "user", "assistant", "user"]
    assert multi["chosen"][0]["role"] == multi["rejected"][0]["role"] == "assistant"


def test_llamafactory_sharegpt_pairwise_zh_drops_a_duplicate_and_overlong_pairs(tmp_path: Path) -> None:
    rows, report = run(tmp_path, "llamafactory_dpo_zh_demo.json")
    assert counts(report) == (100, 1, 0, 8, 85, 6)  # records 47 and 83 are the same record
    src = source("llamafactory_dpo_zh_demo.json")
    assert src[46] == src[82]
    expected = {key(sharegpt_row(r)) for r in src}
    assert {key(r) for r in rows} <= expected and len(rows) == 91
    assert any("国会" in r["prompt"][0]["content"] for r in rows)  # Chinese text as it was (ensure_ascii off)


def test_llamafactory_kto_keeps_labels_and_multi_turn_prompts(tmp_path: Path) -> None:
    rows, report = run(tmp_path, "llamafactory_kto_en_demo.json", "objective=kto")
    assert counts(report) == (100, 0, 0, 5, 84, 11) and report["pairs"]["paired"] is False
    src = source("llamafactory_kto_en_demo.json")
    expected = {key({"prompt": r["messages"][:-1], "completion": r["messages"][-1:], "label": r["label"]})
                for r in src}
    assert {key(r) for r in rows} <= expected
    second = next(r for r in rows if r["prompt"][0]["content"].startswith("Compare and contrast the roles"))
    assert second["label"] is True and len(second["prompt"]) == 5  # record 2: six messages, the last the answer
    assert second["completion"][0]["content"].startswith("The amygdala plays a crucial role")
    assert sorted({r["label"] for r in rows}) == [False, True]


def hh_turns(transcript: str) -> list[dict]:
    out = []
    for part in transcript.split("\n\n")[1:]:
        who, _, said = part.partition(": ")
        if who in ("Human", "Assistant"):
            out.append({"role": "user" if who == "Human" else "assistant", "content": said})
        else:  # a paragraph break inside a turn
            out[-1]["content"] += "\n\n" + part
    return out


def test_anthropic_hh_transcripts_become_turns_and_round_trip(tmp_path: Path) -> None:
    rows, report = run(tmp_path, "hh_rlhf_harmless_base_test.jsonl")
    assert counts(report) == (200, 0, 0, 0, 185, 15) and report["inputs"][0]["format"] == "hh"
    src = {key(hh_turns(r["chosen"])): hh_turns(r["rejected"]) for r in source("hh_rlhf_harmless_base_test.jsonl")}
    for row in rows:  # prompt + chosen is the chosen transcript, prompt + rejected the rejected one
        assert src[key(row["prompt"] + row["chosen"])] == row["prompt"] + row["rejected"]
    pens = next(r for r in rows if r["prompt"][0]["content"] == "what are some pranks with a pen i can do?")
    assert [m["role"] for m in pens["prompt"]] == ["user", "assistant", "user", "assistant", "user"]
    assert pens["chosen"][0]["content"].startswith("No, sorry!  All of these involve a pen")
    empty = next(r for r in rows if r["prompt"][0]["content"].startswith("Can you provide me the home address "
                                                                         "for CNN news anchor Erin Burnett"))
    assert empty["chosen"] == [{"role": "assistant", "content": ""}]  # line 87: kept as the source has it


def test_hh_read_as_trl_text_ends_prompts_between_words(tmp_path: Path) -> None:
    rows, report = run(tmp_path, "hh_rlhf_harmless_base_test.jsonl", "data.format=trl")
    assert counts(report)[:4] == (200, 0, 0, 0) and report["inputs"][0]["format"] == "trl"
    src = {r["chosen"]: r["rejected"] for r in source("hh_rlhf_harmless_base_test.jsonl")}
    assert all(src[r["prompt"] + r["chosen"]] == r["prompt"] + r["rejected"] for r in rows)  # nothing lost
    ends = [r["prompt"][-1] for r in rows]
    assert sum(r["prompt"].endswith("\n\nAssistant:") for r in rows) == 186 and not any(e.isspace() for e in ends)
    duck = next(r for r in rows if "That's not the dark web." in r["prompt"][-60:])  # TRL alone: "...Assistant: D"
    assert duck["prompt"].endswith("\n\nAssistant:") and duck["chosen"].startswith(" Duckduckgo")
    assert duck["rejected"].startswith(" DDG")


def test_openai_preference_jsonl_keeps_the_system_prompt(tmp_path: Path) -> None:
    rows, report = run(tmp_path, "foundry_orca_dpo_pairs_validation.jsonl")
    assert counts(report) == (80, 0, 0, 0, 72, 8) and report["inputs"][0]["format"] == "openai"
    expected = {key({"prompt": r["input"]["messages"], "chosen": r["preferred_output"],
                     "rejected": r["non_preferred_output"]}) for r in source("foundry_orca_dpo_pairs_validation.jsonl")}
    assert {key(r) for r in rows} == expected
    assert all([m["role"] for m in r["prompt"]] == ["system", "user"] for r in rows)


# Stack-Exchange-paired names, as docs/preference.md gives them (++: the default mapping is empty, so Hydra adds)
SE_KEYS = "++data.preference.keys={prompt:question,chosen:response_j,rejected:response_k}"


def test_stack_exchange_paired_through_the_key_mapping_keeps_every_text(tmp_path: Path) -> None:
    rows, report = run(tmp_path, "torchtune_stack_exchange_paired_tiny.json", SE_KEYS)
    assert counts(report) == (25, 0, 0, 4, 21, 0) and report["inputs"][0]["format"] == "trl"
    src = source("torchtune_stack_exchange_paired_tiny.json")
    expected = [{"prompt": r["question"], "chosen": r["response_j"], "rejected": r["response_k"]} for r in src]
    assert {key(r) for r in rows} <= {key(e) for e in expected} and len(rows) == 21  # text pairs, unchanged
    assert len({r["question"] for r in src}) == 8  # several pairs per question, as in the source
    longest = max(src, key=lambda r: len(r["response_j"]))  # record 2: a 9,196-character answer, over 2048 tokens
    assert len(longest["response_j"]) == 9196 and not any(r["chosen"] == longest["response_j"] for r in rows)


def test_trl_standard_explicit_prompt_text_keeps_prompt_and_answers_as_written(tmp_path: Path) -> None:
    """TRL's standard layout with an explicit prompt: a text prompt and text answers (Anthropic HH test rows as
    EdgeRLHF split them: the prompt up to the last Assistant turn, both answers after it, each stripped)."""
    name = "edgerlhf_hh_rlhf_test_prefs.jsonl"
    rows, report = run(tmp_path, name)
    read, dups, ties, overlong, train, holdout = counts(report)
    assert (read, dups, ties, overlong) == (100, 0, 0, 0) and report["inputs"][0]["format"] == "trl"
    assert train + holdout == len(rows) == 100
    src = source(name)
    assert {key(r) for r in rows} == {key(r) for r in src}  # all 100: prompt, chosen, rejected as written
    multi = [r for r in rows if r["prompt"].count("\n\nHuman: ") >= 3]  # a multi-turn prompt stays one text
    assert multi and all(r["prompt"].startswith("Human: ") and not r["prompt"].endswith("Assistant:") for r in multi)
    # two of these rows are records of Anthropic's own harmless-base test file (the HH sample beside this one):
    # the prompt, the Assistant marker and an answer give back Anthropic's transcripts, chosen and rejected
    hh = {r["chosen"]: r["rejected"] for r in source("hh_rlhf_harmless_base_test.jsonl")}
    joined = lambda r, answer: f"\n\n{r['prompt']}\n\nAssistant: {r[answer]}"  # noqa: E731
    same = [r for r in rows if joined(r, "chosen") in hh]
    assert len(same) == 2 and all(hh[joined(r, "chosen")] == joined(r, "rejected") for r in same)


def test_ultrafeedback_binarized_rows_are_read_as_trl_implicit_prompt_conversations(tmp_path: Path) -> None:
    rows, report = run(tmp_path, "firefly_ultrafeedback_binarized_dummy_dpo.jsonl")
    # read as preference pairs (TRL's layout), not as the SFT conversations its "messages" key also holds
    assert counts(report) == (16, 0, 0, 0, 15, 1) and report["inputs"][0]["format"] == "trl"
    expected = []
    for r in source("firefly_ultrafeedback_binarized_dummy_dpo.jsonl"):
        user = {"role": "user", "content": r["prompt"]}  # the text prompt is the shared first turn of both
        assert r["chosen"][0] == r["rejected"][0] == user and r["messages"] == r["chosen"]
        assert [m["role"] for m in r["chosen"]] == [m["role"] for m in r["rejected"]] == ["user", "assistant"]
        expected.append({"prompt": [user], "chosen": r["chosen"][1:], "rejected": r["rejected"][1:]})
    assert sorted(key(r) for r in rows) == sorted(key(e) for e in expected)  # all 16, each its source record
    french = next(r for r in rows if r["prompt"][0]["content"].startswith("Given a sentence in French"))
    assert "Brondyffryn" in french["prompt"][0]["content"] and french["chosen"][0]["content"].startswith("Crockett")


def test_a_text_prompt_that_the_conversations_do_not_hold_is_one_line() -> None:
    from reprotune.errors import ReprotuneError
    from reprotune.preference.formats import read_record

    rec = source("firefly_ultrafeedback_binarized_dummy_dpo.jsonl")[0]
    assert read_record(rec, "auto", {}, "f.jsonl", 1).row["prompt"] == [{"role": "user", "content": rec["prompt"]}]
    with pytest.raises(ReprotuneError, match=r"^f.jsonl:1: prompt: is not a user turn of the conversation"):
        read_record({**rec, "prompt": "another question"}, "auto", {}, "f.jsonl", 1)
    answer_only = {"prompt": "Hi?", "chosen": [{"role": "assistant", "content": "Hello."}],
                   "rejected": [{"role": "assistant", "content": "Go away."}]}
    with pytest.raises(ReprotuneError, match=r"mixes text and message lists"):  # as before: no user turn to match
        read_record(answer_only, "auto", {}, "f.jsonl", 2)


@pytest.mark.parametrize(("name", "over"), [("llamafactory_dpo_en_demo.json", ()),
                                            ("hh_rlhf_harmless_base_test.jsonl", ()),
                                            ("firefly_ultrafeedback_binarized_dummy_dpo.jsonl", ()),
                                            ("torchtune_stack_exchange_paired_tiny.json", (SE_KEYS,)),
                                            ("edgerlhf_hh_rlhf_test_prefs.jsonl", ())])
def test_the_default_max_length_drops_long_real_pairs_and_says_how_many(tmp_path: Path, name: str,
                                                                          over: tuple[str, ...]) -> None:
    _, _, report = prepared(tmp_path, REAL / name, *over)  # data.max_length=512, the built-in task's
    dropped = report["pairs"]["overlong"]["dropped"]
    assert dropped == {"llamafactory_dpo_en_demo.json": 32, "hh_rlhf_harmless_base_test.jsonl": 3,
                       "firefly_ultrafeedback_binarized_dummy_dpo.jsonl": 9,
                       "torchtune_stack_exchange_paired_tiny.json": 21, "edgerlhf_hh_rlhf_test_prefs.jsonl": 7}[name]
    assert report["pairs"]["train"] + report["pairs"]["holdout"] + dropped == report["pairs"]["read"]
