"""The presets' real chat templates (the exact copies TRL's wheel ships in trl/chat_templates/) attached to a
tokenizer: TRL's training-template patch path is the one taken for `training_chat_template: null`, the assistant
mask holds the assistant replies and nothing else, tool calls are rendered, and a template TRL cannot patch
(Llama 3.2's, Mistral's) stops with one line naming the fix (issue #25)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trl

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.models import load_tokenizer, resolve_model_dir, training_chat_template

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
CHAT = [{"role": "system", "content": "You extract invoice fields."},
        {"role": "user", "content": "Invoice 4411 from ACME, total 99.50 EUR."},
        {"role": "assistant", "content": "number 4411; supplier ACME; total 99.50"},
        {"role": "user", "content": "And the currency?"},
        {"role": "assistant", "content": "EUR"}]
TOOL_CALL = [{"role": "user", "content": "What is 2 * 3?"},
             {"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": {"a": 2, "b": 3}}}]},
             {"role": "tool", "name": "multiply", "content": "6"},
             {"role": "assistant", "content": "It is 6."}]
TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "a * b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    cfg = compose(["model=tiny_random", "hardware=cpu", f"paths.root={tmp_path_factory.mktemp('templates')}",
                   "model.training_chat_template=null"])
    return cfg, resolve_model_dir(cfg.model, cfg.paths.model_cache)


def _with_template(tiny, name: str):
    cfg, model_dir = tiny
    tokenizer = load_tokenizer(model_dir, cfg.model)
    tokenizer.chat_template = (TRL_TEMPLATES / f"{name}.jinja").read_text()
    return cfg, tokenizer


def _assistant_text(tokenizer, messages: list[dict], template: str) -> str:
    out = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    assert any(out["assistant_masks"]), "the mask is empty"
    return tokenizer.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m])


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "llama3"])
def test_trl_patches_the_real_template_and_masks_only_assistant_replies(tiny, name: str) -> None:
    cfg, tokenizer = _with_template(tiny, name)
    patched = training_chat_template(cfg.model, tokenizer, assistant_only_loss=True)
    assert patched == (TRL_TEMPLATES / f"{name}_training.jinja").read_text(), "TRL's own training copy"
    masked = _assistant_text(tokenizer, CHAT, patched)
    assert "number 4411; supplier ACME; total 99.50" in masked and "EUR" in masked
    for other in ("You extract invoice fields.", "Invoice 4411 from ACME", "And the currency?"):
        assert other not in masked, (name, masked)
    # one exchange renders as the real template renders it (what inference sees); over several turns Qwen3's
    # training copy keeps every turn's empty think block (prefix-preserving), which the real one drops
    plain = tokenizer.apply_chat_template(CHAT[:3], tokenize=False)
    assert tokenizer.apply_chat_template(CHAT[:3], chat_template=patched, tokenize=False) == plain


@pytest.mark.parametrize("name", ["qwen3", "qwen2_5"])  # Llama 3.0's and Gemma 3's templates have no tool role
def test_the_real_template_renders_tool_calls(tiny, name: str) -> None:
    cfg, tokenizer = _with_template(tiny, name)
    patched = training_chat_template(cfg.model, tokenizer, assistant_only_loss=True)
    text = tokenizer.apply_chat_template(TOOL_CALL, tools=TOOLS, chat_template=patched, tokenize=False)
    assert "multiply" in text and '"a": 2' in text and "6" in text
    masked = _assistant_text(tokenizer, TOOL_CALL, patched)
    assert "It is 6." in masked and "What is 2 * 3?" not in masked


@pytest.mark.parametrize("name", ["llama3_2"])
def test_a_template_trl_cannot_patch_is_one_line_naming_the_fix(tiny, name: str) -> None:
    """Llama 3.2's template (llama32_1b) has no training copy in TRL 1.16: one line, not SFTTrainer's ValueError."""
    cfg, tokenizer = _with_template(tiny, name)
    with pytest.raises(ReprotuneError, match=r"model 'tiny_random': model.training_chat_template: null, but TRL has "
                                             r"no training copy .* set model.training_chat_template=") as err:
        training_chat_template(cfg.model, tokenizer, assistant_only_loss=True)
    assert "\n" not in str(err.value)
    assert training_chat_template(cfg.model, tokenizer, assistant_only_loss=False) is None  # full-sequence loss


def test_a_configured_training_template_wins(tiny) -> None:
    cfg, model_dir = tiny
    chatml = compose(["model=tiny_random"]).model
    tokenizer = load_tokenizer(model_dir, chatml)
    assert training_chat_template(chatml, tokenizer, True) == Path(chatml.training_chat_template).read_text()


def test_sft_trainer_takes_trls_patch_path_for_the_qwen3_template(tiny) -> None:
    """Through reprotune's SFTConfig (model.training_chat_template null): SFTTrainer swaps in TRL's Qwen3 training
    copy and its labels hold the assistant replies only."""
    from datasets import Dataset
    from trl import SFTTrainer

    from reprotune.models import load_base_model
    from reprotune.sizing.decide import Hardware, decide
    from reprotune.train import lora_config, sft_config

    cfg, model_dir = tiny
    cfg_q = compose(["model=tiny_random_qwen3", "hardware=cpu", f"paths.root={cfg.paths.root}",
                     "model.training_chat_template=null", "train.packing=false"])
    qwen_dir = resolve_model_dir(cfg_q.model, cfg_q.paths.model_cache)
    tokenizer = load_tokenizer(qwen_dir, cfg_q.model)
    tokenizer.chat_template = (TRL_TEMPLATES / "qwen3.jinja").read_text()
    fast = decide(cfg_q, Hardware("cpu"), None, None)
    trainer = SFTTrainer(model=load_base_model(qwen_dir, cfg_q, "cpu", "float32", fast.attn_implementation),
                         args=sft_config(cfg_q, fast, False),
                         train_dataset=Dataset.from_list([{"messages": CHAT}]), processing_class=tokenizer,
                         peft_config=lora_config(cfg_q))
    assert trainer.chat_template == (TRL_TEMPLATES / "qwen3_training.jinja").read_text()
    row = trainer.train_dataset[0]
    learned = tokenizer.decode([lab for lab in row["labels"] if lab != -100])  # TRL masks non-assistant with -100
    assert "total 99.50" in learned and "EUR" in learned and "Invoice 4411 from ACME" not in learned


# ------------------------------------------------------------------------------- agent traces (plain-text tools)
def agent_rows(n: int) -> list[dict]:
    """Agent SFT traces: the assistant invokes a tool in its text; a tool turn without tool_calls answers."""
    return [{"messages": [
        {"role": "user", "content": f"List the files of project {i}."},
        {"role": "assistant", "content": f"Action: ls /srv/project{i}"},
        {"role": "tool", "content": f"README.md main{i}.py"},
        {"role": "assistant", "content": f"Project {i} holds README.md and main{i}.py."}]} for i in range(n)]


def _prepare_cfg(root: Path, *overrides: str):
    return compose([f"paths.root={root}", "model=tiny_random", "data.scrub=false",
                    "data.path=${paths.raw}/agent.jsonl", "data.holdout_fraction=0", *overrides])


def test_agent_traces_are_accepted_and_rendered_with_the_tool_role(tmp_path: Path) -> None:
    """ChatML (SmolLM2's template and the training copy) has a tool role: <|im_start|>tool; the tool output is
    context, the replies around it are learned."""
    import json

    from reprotune.prepare import prepare

    from .conftest import write_jsonl

    write_jsonl(tmp_path / "data/raw/agent.jsonl", agent_rows(6))
    c = _prepare_cfg(tmp_path)
    prepare(c)
    rows = [json.loads(line) for line in (tmp_path / "data/prepared/train.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and [m["role"] for m in rows[0]["messages"]] == ["user", "assistant", "tool", "assistant"]
    tokenizer = load_tokenizer(resolve_model_dir(c.model, c.paths.model_cache), c.model)
    training = Path(c.model.training_chat_template).read_text()
    messages = rows[0]["messages"]
    text = tokenizer.apply_chat_template(messages, chat_template=training, tokenize=False)
    assert f"<|im_start|>tool\n{messages[2]['content']}<|im_end|>" in text
    masked = _assistant_text(tokenizer, messages, training)
    assert messages[1]["content"] in masked and messages[3]["content"] in masked
    assert messages[2]["content"] not in masked and messages[0]["content"] not in masked


def test_agent_traces_with_a_template_without_tool_role_are_one_line(tmp_path: Path) -> None:
    """Gemma 3's real template knows user and model only: refused with one line naming the template."""
    from reprotune.prepare import prepare

    from .conftest import write_jsonl

    write_jsonl(tmp_path / "data/raw/agent.jsonl", agent_rows(3))
    gemma = str(TRL_TEMPLATES / "gemma3.jinja")
    with pytest.raises(ReprotuneError) as err:
        prepare(_prepare_cfg(tmp_path, f"model.chat_template={gemma}", "model.training_chat_template=null"))
    (line,) = err.value.problems
    assert line == (f"{tmp_path}/data/raw/agent.jsonl:0: tool: 3 example(s) answer a plain-text tool invocation "
                    f"with a tool turn, but model.chat_template ({gemma}) has no tool role to render it; use a "
                    "template that renders role 'tool' (model.chat_template=conf/chat_templates/qwen2_5_tools.jinja "
                    "model.training_chat_template=conf/chat_templates/qwen2_5_tools_training.jinja)")
    assert not (tmp_path / "data/prepared/train.jsonl").exists()
