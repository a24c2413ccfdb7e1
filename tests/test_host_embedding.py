"""hardware.embedding_on_host (reprotune.host_embedding): the frozen input embedding stays in host memory for a
training run; lookups there give the same values, so the same loss and LoRA gradients, with the hooks training
needs still on the module; model.to() leaves the table where it is; after the run the module is as it was. The
fit takes it only where it lets a faster setting fit (reprotune.sizing.fit.with_host_embedding); off a GPU, on a
tied or Gemma embedding, or with trainable tokens, a forced one is refused in one line."""

from __future__ import annotations

import pytest
import torch

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.host_embedding import embedding_on_host, why_not_on_host
from reprotune.run_settings import RunSettings
from reprotune.sizing import decide as d
from reprotune.sizing.shape import DataShape, model_shape


def _lora_model(tied: bool = False):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    # what TRL and transformers do for reentrant checkpointing: a hook on the embedding makes its output need grads
    model.gradient_checkpointing_enable({"use_reentrant": True})
    model.enable_input_require_grads()
    return model


def _loss_and_grads(model) -> tuple[float, dict[str, torch.Tensor]]:
    model.train()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_the_host_table_gives_the_same_loss_and_gradients_and_comes_back() -> None:
    model = _lora_model()
    emb = model.get_input_embeddings()
    table = emb.weight.detach().clone()
    loss, grads = _loss_and_grads(model)
    assert all(g.abs().sum() > 0 for g in grads.values())  # reentrant checkpointing reached every adapter
    with embedding_on_host(model, active=True) as freed:
        assert freed == table.numel() * table.element_size()
        assert all(p is not emb.weight for p in model.parameters())  # not a parameter: model.to() leaves it
        model.to(torch.float64)
        assert emb.weight.dtype == torch.float32 and torch.equal(emb.weight, table)
        model.to(torch.float32)
        loss_host, grads_host = _loss_and_grads(model)
    assert loss_host == loss
    assert grads_host.keys() == grads.keys() and all(torch.equal(grads_host[k], grads[k]) for k in grads)
    assert isinstance(emb.weight, torch.nn.Parameter) and not emb.weight.requires_grad
    assert torch.equal(emb.weight, table) and "forward" not in vars(emb)  # the class's forward again
    assert _loss_and_grads(model)[0] == loss


def test_an_embedding_the_host_cannot_hold_is_refused_in_one_line() -> None:
    tied = _lora_model(tied=True)
    assert why_not_on_host(tied) == "the input embedding is tied to the LM head, which the GPU needs"
    with (pytest.raises(ReprotuneError, match=r"^hardware.embedding_on_host: the input embedding is tied"),
          embedding_on_host(tied, active=True)):
        pass
    with embedding_on_host(tied, active=False) as freed:  # inactive: nothing happens
        assert freed == 0


# the bench's pairs (bench/dpo_recipe.py, SmolLM2's tokenizer): 400 packed pairs, the longest 1,668 tokens
BENCH_PAIRS = DataShape(examples=400, max_tokens=1668, mean_tokens=937.6, total_tokens=375_039, assistant_share=0.45,
                        prepared_max_length=2048, tokenizer_model="qwen3_8b_random", overlong=0, source="bench")


def _dpo(*extra: str) -> RunSettings:
    cfg = compose(["model=qwen3_8b_random", "objective=dpo", "hardware=gpu", "train.per_device_train_batch_size=4",
                   "train.gradient_accumulation_steps=4", *extra])
    return d.decide(cfg, d.card("H200"), model_shape(cfg.model), BENCH_PAIRS)


def test_the_fit_keeps_the_embedding_on_the_host_only_where_that_fits_a_faster_setting() -> None:
    at_22 = _dpo("hardware.memory_budget_gib=22")  # 4 pairs fit with the table on the GPU
    assert not at_22.embedding_on_host and at_22.per_device_train_batch_size == 4
    at_23 = _dpo("hardware.memory_budget_gib=23.5")  # 8 pairs fit only with it on the host
    assert at_23.embedding_on_host and at_23.planned.host_embedding
    assert (at_23.per_device_train_batch_size, at_23.gradient_accumulation_steps) == (8, 2)
    assert any(r.startswith("input embedding on the host: 1.16 GiB") for r in at_23.reasons)
    without = _dpo("hardware.memory_budget_gib=23.5", "hardware.embedding_on_host=false")
    assert not without.embedding_on_host and without.per_device_train_batch_size == 4
    sft = compose(["model=qwen3_8b_random", "hardware=gpu", "hardware.memory_budget_gib=23.5",
                   "train.max_length=4096", "train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=4"])
    assert not d.decide(sft, d.card("H200"), model_shape(sft.model), None).embedding_on_host  # auto: preference only
    sft.hardware.embedding_on_host = True
    assert d.decide(sft, d.card("H200"), model_shape(sft.model), None).embedding_on_host
    roomy = _dpo()  # 90% of the card: everything fits on the GPU, where the lookups cost nothing
    assert not roomy.embedding_on_host
    # the plan's weights: the same run with the table on the GPU counts 151,936 x 4,096 bf16 more
    forced = _dpo("hardware.memory_budget_gib=22", "hardware.embedding_on_host=true")
    assert forced.embedding_on_host
    delta = at_22.predicted["parts_gib"]["weights"] - forced.predicted["parts_gib"]["weights"]
    assert delta == pytest.approx(151_936 * 4096 * 2 / 2**30, abs=0.002)


@pytest.mark.parametrize(("model", "hardware", "why"), [
    ("qwen3_8b_random", "cpu", "the run is not on a GPU"),
    ("tiny_random", "gpu", "the input embedding is tied to the LM head"),
    ("tiny_random_gemma3 model.random_init.architecture.tie_word_embeddings=false", "gpu",
     "gemma3_text's input embedding is not a plain torch.nn.Embedding"),
    ("qwen3_8b_random ++model.lora_trainable_tokens=['<|im_end|>']", "gpu",
     "model.lora_trainable_tokens trains rows of the input embedding"),
])
def test_a_forced_host_embedding_that_cannot_be_is_one_line(model: str, hardware: str, why: str) -> None:
    preset, *extra = model.split()
    cfg = compose([f"model={preset}", f"hardware={hardware}", "hardware.embedding_on_host=true", *extra])
    hw = d.card("H200") if hardware == "gpu" else d.Hardware("cpu")
    with pytest.raises(ReprotuneError, match=rf"^hardware.embedding_on_host=true: {why}"):
        d.decide(cfg, hw, None, None)
    # auto: the table stays on the GPU, whatever the budget
    auto = compose([f"model={preset}", f"hardware={hardware}", "hardware.memory_budget_gib=1", *extra])
    assert not d.decide(auto, hw, None, None).embedding_on_host
