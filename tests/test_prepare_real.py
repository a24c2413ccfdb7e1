"""Real public datasets (tests/data/real, see its SOURCES.md) through the readers, the scrubber and the
prepare stage: what is kept, what is dropped and why, and that scrubbing leaves public text alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from reprotune.formats import read_file

REAL = Path(__file__).parent / "data/real"
EXPECTED = {  # file: (format, kept, dropped, the reason of the first dropped record)
    "fastchat_dummy_conversation.json": ("sharegpt", 200, 0, None),
    "llamafactory_alpaca_en_demo.json": ("alpaca", 300, 0, None),
    "llamafactory_alpaca_zh_demo.json": ("alpaca", 200, 0, None),
    "llamafactory_glaive_toolcall_en_demo.json": ("sharegpt", 100, 0, None),
    "llamafactory_identity.json": ("alpaca", 91, 0, None),
    "llamafactory_reason_tool_use_demo.jsonl": ("chat", 0, 20, "messages[0].content: must be a string or a list of {\"type\": \"text\", \"text\": ...} parts"),
    "llamafactory_v1_sft_demo.jsonl": ("chat", 0, 100, "messages[0].content: must be a string or a list of {\"type\": \"text\", \"text\": ...} parts"),
    "openai_cookbook_drone_training.jsonl": ("chat", 2, 1, "messages[2].tool_calls[0].arguments: must be a JSON "
                                                           "object, got a string"),
    "openai_cookbook_toy_chat_fine_tuning.jsonl": ("chat", 3, 1, "messages[1]: roles out of order: assistant after "
                                                                 "system (expected user)"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_files_kept_and_dropped(name: str) -> None:
    result = read_file(REAL / name, on_invalid="skip")
    fmt, kept, dropped, reason = EXPECTED[name]
    assert (result.format, len(result.records), len(result.rejected)) == (fmt, kept, dropped)
    if reason:
        assert result.rejected[0]["reason"].startswith(reason)


def test_real_tool_calls_are_read() -> None:
    glaive = read_file(REAL / "llamafactory_glaive_toolcall_en_demo.json").records
    with_calls = [r for r in glaive if any(m.get("tool_calls") for m in r.messages)]
    assert len(with_calls) > 50 and all(r.tools for r in with_calls)
    call = next(m for m in with_calls[0].messages if m.get("tool_calls"))["tool_calls"][0]["function"]
    assert isinstance(json.loads(call["arguments"]), dict)
    drone = read_file(REAL / "openai_cookbook_drone_training.jsonl", on_invalid="skip")
    assert len(drone.records[0].tools) == 16 and drone.extra_keys == {"parallel_tool_calls": 3}


@pytest.mark.slow
def test_scrubbing_leaves_real_public_text_alone_and_finds_planted_pii() -> None:
    """bench/pii_quality.py's measurement as a test: no name replaced in the real files (all 102 names the
    earlier scrubber replaced there are public figures, characters or placeholders, labelled by hand), and
    every planted email/phone/IBAN/card/IP/national id and >= 90% of planted private names replaced."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
    from pii_quality import planted

    from reprotune.pii import Scrubber

    real = [r.messages for p in sorted(REAL.glob("*.json*")) if p.name in EXPECTED
            for r in read_file(p, on_invalid="skip").records]
    plants = planted(0)
    trace: list[dict] = []
    out, _ = Scrubber(seed=0).scrub(real + [c for c, _ in plants], trace=trace)
    assert [t for t in trace if t["example"] < len(real) and t["entity"] == "PERSON"] == []
    # what is replaced in the real files: made-up contact details (boss@company.com, (555) 123-4567), with
    # consistent fakes of the same shape; example.com addresses are left alone
    changed = [i for i in range(len(real)) if out[i] != real[i]]
    assert len(changed) <= 8 and {t["entity"] for t in trace if t["example"] < len(real)} <= {"EMAIL_ADDRESS",
                                                                                             "PHONE_NUMBER"}
    hits, totals = {}, {}
    for (_, values), conv in zip(plants, out[len(real):], strict=True):
        text = "\n".join(m["content"] for m in conv)
        for entity, (value,) in values.items():
            totals[entity] = totals.get(entity, 0) + 1
            hits[entity] = hits.get(entity, 0) + (value.lower() not in text.lower())
    assert all(hits[e] == totals[e] for e in totals if e != "PERSON"), (hits, totals)
    assert hits["PERSON"] / totals["PERSON"] >= 0.9


@pytest.mark.slow
def test_real_tool_calling_data_prepares_with_the_tool_templates(tmp_path: Path) -> None:
    from reprotune.config import compose
    from reprotune.prepare import prepare

    cfg = compose([f"paths.root={tmp_path}", "model=tiny_random", "data.scrub=false", "data.max_length=2048",
                   f"data.path={REAL / 'llamafactory_glaive_toolcall_en_demo.json'}",
                   "model.chat_template=conf/chat_templates/qwen2_5_tools.jinja",
                   "model.training_chat_template=conf/chat_templates/qwen2_5_tools_training.jinja"])
    report = prepare(cfg)["report"]
    examples = report["examples"]
    assert examples["read"] == 100 and examples["duplicates_dropped"] == 5  # the sample repeats 5 records
    assert examples["train"] + examples["holdout"] == 95 and examples["overlong"]["count"] == 0
    assert examples["with_tools"] > 50 and report["roles"]["tool"] > 50
