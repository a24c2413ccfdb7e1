"""The varlen attention kernel (reprotune.varlen_attention) against transformers' SDPA on the same batches.

CUDA only (torch's FlashAttention kernels have no CPU implementation): run on the GPU machine
(docs/gpu.md). A tiny Qwen3 (its real class: q/k norms, grouped-query heads) in bf16:
- a padding-free packed batch from TRL's own collator (the boundaries it hands the model): loss and gradients
  equal to SDPA's, which builds the block-diagonal mask from the position ids; a control that treats the row as
  one sequence (attention across examples) is far off, so the tolerance can tell;
- a right-padded unpacked batch (an evaluation batch during training): logits on the real tokens equal.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the varlen kernel is "
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


def _loss_and_grads(attn: str, batch: dict) -> tuple[float, torch.Tensor]:
    model = _model(attn)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


def test_packed_batch_loss_and_gradients_equal_sdpa() -> None:
    batch = _packed_batch()
    assert batch["cu_seq_lens_q"].tolist() == [0, 120, 300, 550]  # TRL hands the boundaries to the model
    ref_loss, ref_grad = _loss_and_grads("sdpa", {k: v for k, v in batch.items() if not k.startswith(("cu_", "max_"))})
    loss, grad = _loss_and_grads("varlen_attention", batch)
    cos = torch.nn.functional.cosine_similarity(grad, ref_grad, dim=0).item()
    assert abs(loss - ref_loss) < 1e-2 * ref_loss and cos > 0.999, (loss, ref_loss, cos)
    # control: the same row as one sequence (boundaries dropped, position ids kept) attends across examples
    whole = dict(batch, cu_seq_lens_q=torch.tensor([0, 550], dtype=torch.int32, device="cuda"),
                 cu_seq_lens_k=torch.tensor([0, 550], dtype=torch.int32, device="cuda"), max_length_q=550,
                 max_length_k=550)
    bad_loss, bad_grad = _loss_and_grads("varlen_attention", whole)
    bad_cos = torch.nn.functional.cosine_similarity(bad_grad, ref_grad, dim=0).item()
    assert abs(bad_loss - ref_loss) > 1e-2 * ref_loss or bad_cos < 0.999, (bad_loss, ref_loss, bad_cos)


def test_padded_batch_logits_equal_sdpa() -> None:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, 512, (2, 64), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0  # right padding
    with torch.no_grad():
        ref = _model("sdpa")(input_ids=ids, attention_mask=mask).logits
        out = _model("varlen_attention")(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (out[real] - ref[real]).abs().max().item() < 0.1 * ref[real].abs().max().item()
