"""The varlen attention kernel (reprotune.varlen_attention) against transformers' SDPA on the same batches.

CUDA only (torch's FlashAttention kernels have no CPU implementation): run on the GPU machine
(docs/gpu.md). A tiny Qwen3 (its real class: q/k norms, grouped-query heads) in bf16:
- a padding-free packed batch from TRL's own collator (the boundaries it hands the model): loss and gradients
  equal to each example run alone; a control that treats the row as one sequence (attention across
  examples) is far off, so the tolerance can tell;
- a right-padded unpacked batch (an evaluation batch during training): logits on the real tokens equal to each
  row run alone.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the varlen kernel is "
                                 "FlashAttention's (run on the GPU machine, docs/gpu.md)")]


def _model(attn: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from reprotune import varlen_attention

    varlen_attention.register()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
    config._attn_implementation = attn
    return Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)


def _packed_batch() -> dict:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(5, 512, (n,), generator=g).tolist(), "seq_lengths": lens}
            for n, lens in ((300, [120, 180]), (250, [250]))]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def _alone(batch: dict) -> tuple[float, torch.Tensor]:
    """The ground truth: each example of the packed row run alone (SDPA, causal), the loss over the same
    (shifted) labels of the flat row."""
    model = _model("sdpa")
    ids, labels, cu = batch["input_ids"][0], batch["labels"][0], batch["cu_seq_lens_q"].tolist()
    logits = torch.cat([model(input_ids=ids[a:b][None]).logits[0] for a, b in zip(cu, cu[1:], strict=False)])
    loss = torch.nn.functional.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=-100)
    loss.backward()
    return loss.item(), _grads(model)


def _packed(batch: dict) -> tuple[float, torch.Tensor]:
    model = _model("varlen_attention")
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), _grads(model)


def _close(a: tuple[float, torch.Tensor], b: tuple[float, torch.Tensor]) -> tuple[bool, float, float]:
    cos = torch.nn.functional.cosine_similarity(a[1], b[1], dim=0).item()
    return abs(a[0] - b[0]) < 1e-3 * abs(b[0]) and cos > 0.999, a[0] - b[0], cos


def test_packed_batch_loss_and_gradients_equal_each_example_alone() -> None:
    batch = _packed_batch()
    assert batch["cu_seq_lens_q"].tolist() == [0, 120, 300, 550]  # TRL hands the boundaries to the model
    truth = _alone(batch)
    ok, dloss, cos = _close(_packed(batch), truth)
    assert ok, (dloss, cos)
    # control: the same row as one sequence (boundaries dropped) attends across examples
    one = torch.tensor([0, 550], dtype=torch.int32, device="cuda")
    whole = dict(batch, cu_seq_lens_q=one, cu_seq_lens_k=one, max_length_q=550, max_length_k=550)
    bad, dloss, cos = _close(_packed(whole), truth)
    assert not bad, (dloss, cos)


def test_padded_batch_logits_equal_each_row_alone() -> None:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 512, (2, 64), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0  # right padding
    with torch.no_grad():
        ref = _model("sdpa")
        alone = [ref(input_ids=ids[:1]).logits[0], ref(input_ids=ids[1:, :40]).logits[0]]
        out = _model("varlen_attention")(input_ids=ids, attention_mask=mask).logits
    for row, want in enumerate(alone):
        got = out[row, : want.shape[0]]
        assert (got - want).abs().max().item() < 0.05 * want.abs().max().item(), row
