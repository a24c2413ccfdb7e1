"""A chat token the base model never learnt (Gemma 3 270M pretrained: <end_of_turn>'s embedding row, tied to the
head, is a near-copy of thousands of unused tokens' rows) cannot be learnt through LoRA on the projections: the
head scores it like its copies whatever the hidden state. model.lora_trainable_tokens trains that row with the
adapter (PEFT's trainable tokens), so the model learns to end its turn. Shown on the tiny Gemma 3 model (tied
head) with the stop token's row copied onto 63 others, as in the pretrained Gemma 3 checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.models import load_base_model, load_tokenizer, resolve_model_dir
from reprotune.train import lora_config

STOP = "<|im_end|>"  # the tiny model's tokenizer is SmolLM2's; Gemma's preset names <end_of_turn>
COPIES = 63


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainable_tokens")  # one tiny model for the module


def _cfg(tmp: Path, tokens: list[str] | None):
    cfg = compose(["model=tiny_random_gemma3", "hardware=cpu", f"paths.root={tmp}"])
    if tokens is not None:
        OmegaConf.update(cfg, "model.lora_trainable_tokens", tokens, force_add=True)
    return cfg


def _stop_probability_after_training(tmp: Path, tokens: list[str] | None, steps: int = 15) -> float:
    """p(stop | prompt) after fitting the adapter to end the prompt with the stop token."""
    from peft import get_peft_model

    cfg = _cfg(tmp, tokens)
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    model = load_base_model(model_dir, cfg, "cpu", "float32", None)
    stop = tokenizer.convert_tokens_to_ids(STOP)
    embedding = model.get_input_embeddings().weight
    assert embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr(), "a tied head, as Gemma 3's"
    with torch.no_grad():  # an untrained row: the same as many others (ids far from the prompt's)
        embedding[1000:1000 + COPIES] = embedding[stop]
    model = get_peft_model(model, lora_config(cfg, tokenizer))
    torch.manual_seed(0)
    ids = torch.tensor([[5, 17, 300, 42, 77, 901, 12, 8]])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = -model(input_ids=ids).logits[0, -1].float().log_softmax(-1)[stop]
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(model(input_ids=ids).logits[0, -1].float().softmax(-1)[stop])


def test_gemma3_270m_trains_its_end_of_turn_row() -> None:
    assert list(compose(["model=gemma3_270m"]).model.lora_trainable_tokens) == ["<end_of_turn>"]


def test_lora_alone_cannot_learn_a_stop_token_its_base_never_learnt(root: Path) -> None:
    p = _stop_probability_after_training(root, None)
    assert p <= 1 / (COPIES + 1) + 1e-6, p  # its copies score the same whatever LoRA does


def test_gemma3_trainable_stop_token_is_learnt_with_the_adapter(root: Path) -> None:
    p = _stop_probability_after_training(root, [STOP])
    assert p > 0.5, p  # the most likely token (LoRA alone: at most 1/64)


def test_trls_fused_head_trains_the_tied_rows_through_the_merged_view(root: Path) -> None:
    """SFTTrainer scores with TRL's fused LM head, which reads lm_head.weight/bias: through the view it gets the
    merged rows (the same log-probs as the wrapper's own forward, a gradient for the trained row); without it the
    wrapped head has no bias and TRL stops (AttributeError)."""
    from peft import get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from reprotune.trainable_tokens import merged_head_view

    cfg = _cfg(root, [STOP])
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    model = load_base_model(model_dir, cfg, "cpu", "float32", None)
    add_fused_lm_head(model)  # as SFTTrainer does, before PEFT wraps the model
    model = get_peft_model(model, lora_config(cfg, tokenizer))
    stop = tokenizer.convert_tokens_to_ids(STOP)
    with torch.no_grad():  # trained values that differ from the base row
        for p in model.parameters():
            if p.requires_grad and p.shape[0] == 1:
                p.add_(0.5)
    ids = torch.tensor([[5, 17, 300, 42, stop, 901, 12, stop]])
    with pytest.raises(AttributeError, match="bias"):
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    with merged_head_view(model) as wrapped:
        assert wrapped
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        (-out.log_probs.sum()).backward()
    reference = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(out.log_probs[0], reference, atol=1e-4)
    delta = [p for n, p in model.named_parameters() if "trainable_tokens_delta" in n]
    assert len(delta) == 1 and delta[0].grad is not None and float(delta[0].grad.abs().sum()) > 0
    assert type(model.get_output_embeddings()).__name__ == "TrainableTokensWrapper"  # given back


def test_an_unknown_trainable_token_is_one_line(root: Path) -> None:
    cfg = _cfg(root, ["<end_of_turn>"])  # not a token of SmolLM2's tokenizer
    tokenizer = load_tokenizer(resolve_model_dir(cfg.model, cfg.paths.model_cache), cfg.model)
    with pytest.raises(ReprotuneError, match=r"^model 'tiny_random_gemma3': model.lora_trainable_tokens: "
                                             r"'<end_of_turn>' is not a token of the tokenizer"):
        lora_config(cfg, tokenizer)
