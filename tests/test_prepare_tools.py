"""Tool calls and per-message weights through the prepare stage and the chat templates, with the tiny
model's real tokenizer: a template that cannot render tools stops prepare with one line; the committed
Qwen2.5 tool templates render them, train on the tool-call turns and leave weight-0 replies out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.prepare import prepare
from reprotune.prepare_lengths import load_tokenizer
from tests.conftest import TINY_TRAIN, write_jsonl

QWEN = ["model.chat_template=conf/chat_templates/qwen2_5_tools.jinja",
        "model.training_chat_template=conf/chat_templates/qwen2_5_tools_training.jinja"]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def tool_rows(n: int) -> list[dict]:
    return [{"tools": TOOLS, "messages": [
        {"role": "user", "content": f"Weather in city {i}?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "C{i}"}}'}}]},
        {"role": "tool", "tool_call_id": f"c{i}", "content": f'{{"temp_c": {i}}}'},
        {"role": "assistant", "content": f"It is {i} degrees."}]} for i in range(n)]


def cfg(root: Path, *overrides: str):
    return compose([f"paths.root={root}", "model=tiny_random", "data.scrub=false",
                    "data.path=${paths.raw}/tools.jsonl", *overrides])


def test_a_template_without_tools_stops_prepare_with_one_line(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data/raw/tools.jsonl", tool_rows(6))
    with pytest.raises(ReprotuneError) as err:
        prepare(cfg(tmp_path))
    (line,) = err.value.problems
    assert line.startswith(f"{tmp_path}/data/raw/tools.jsonl:0: tools: 6 example(s) use tools, but "
                           f"model.chat_template (the tokenizer of tiny_random) and model.training_chat_template "
                           f"(conf/chat_templates/chatml_training.jinja) cannot render tools; set "
                           f"model.chat_template=conf/chat_templates/qwen2_5_tools.jinja")
    assert not (tmp_path / "data/prepared/train.jsonl").exists()


def test_tool_templates_render_and_train_on_the_calls(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data/raw/tools.jsonl", tool_rows(6))
    c = cfg(tmp_path, *QWEN, "data.holdout_fraction=0")
    result = prepare(c)
    rows = [json.loads(line) for line in (tmp_path / "data/prepared/train.jsonl").read_text().splitlines()]
    assert result["report"]["examples"]["with_tools"] == 6 and all(r["tools"] == TOOLS for r in rows)
    tokenizer = load_tokenizer(c)
    training = Path(c.model.training_chat_template).read_text()
    messages = rows[2]["messages"]
    text = tokenizer.apply_chat_template(messages, tools=rows[2]["tools"], tokenize=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "C2"}}\n</tool_call>' in text
    assert '"name": "get_weather", "description": "Current weather in a city"' in text  # the schema is in
    assert "<tool_response>\n{\"temp_c\": 2}\n</tool_response>" in text
    # the training variant renders the same text, and its assistant mask covers the call and the answer
    assert tokenizer.apply_chat_template(messages, tools=rows[2]["tools"], chat_template=training, tokenize=False) == text
    out = tokenizer.apply_chat_template(messages, tools=rows[2]["tools"], chat_template=training, tokenize=True,
                                        return_dict=True, return_assistant_tokens_mask=True)
    learned = tokenizer.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m])
    assert learned == ('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "C2"}}\n</tool_call><|im_end|>\n'
                       '\nIt is 2 degrees.<|im_end|>\n')


def test_weight_zero_reply_is_left_out_of_the_loss(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "An old bad answer.", "weight": 0},
                          {"role": "user", "content": "Again"}, {"role": "assistant", "content": f"Good answer {i}."}]}
            for i in range(4)]
    write_jsonl(tmp_path / "data/raw/tools.jsonl", rows)
    c = cfg(tmp_path, "data.holdout_fraction=0")
    prepare(c)  # the built-in ChatML training template honours weights
    prepared = [json.loads(line) for line in (tmp_path / "data/prepared/train.jsonl").read_text().splitlines()]
    assert prepared[0]["messages"][1] == {"role": "assistant", "content": "An old bad answer.", "weight": 0}
    tokenizer = load_tokenizer(c)
    for template in ("conf/chat_templates/chatml_training.jinja", "conf/chat_templates/qwen2_5_tools_training.jinja"):
        out = tokenizer.apply_chat_template(prepared[0]["messages"], chat_template=Path(template).read_text(),
                                            tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        learned = tokenizer.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m])
        assert "Good answer 0." in learned and "old bad" not in learned, template
    # TRL's own training templates (model.training_chat_template=null) know nothing of weights: said, not ignored
    with pytest.raises(ReprotuneError) as err:
        prepare(cfg(tmp_path, "data.holdout_fraction=0", "model.training_chat_template=null"))
    assert "4 example(s) have assistant messages with weight 0, which need a training template" in err.value.problems[0]


@pytest.mark.slow
def test_train_stage_trains_on_tool_calls(tmp_path: Path) -> None:
    """The real train stage (TRL SFTTrainer, assistant-only loss) on prepared tool-calling data."""
    from reprotune.train import train

    write_jsonl(tmp_path / "data/raw/tools.jsonl", tool_rows(8))
    prepare(cfg(tmp_path, *QWEN, "data.holdout_fraction=0"))
    train(compose([*TINY_TRAIN, f"paths.root={tmp_path}", "model=tiny_random", *QWEN, "train.max_steps=2"]))
    metrics = json.loads((tmp_path / "outputs/train/metrics.json").read_text())
    assert metrics["global_step"] == 2 and metrics["final_train_loss"] == metrics["final_train_loss"]  # not NaN
    # assistant tokens per example: the call and the answer (~30 tokens), not just the answer (~8)
    assert metrics["assistant_tokens"] / metrics["train_examples"] > 25
