"""The GPU fast path's packing, checked on CPU with the tiny model: a packed batch computes, for every example in
it, the same loss and gradients as that example run alone; labels are masked exactly as unpacked; and no token
attends across an example boundary (with a control that shows the check would catch a leak).

fp32 on CPU, SDPA with the block-diagonal mask transformers builds from the restarting position ids (the GPU uses
the same mask function through flex attention). Tolerances: logits 1e-5 absolute; gradients from fp32's precision
and the tensor's magnitude (grad_tolerance: a length-K sum in fp32 is off by at most K unit roundoffs of its
terms' scale; measured 17 of K=509 under AVX2 kernels, 4 under AVX-512, a leak ~10^6), the same on every CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from reprotune import flops
from reprotune.config import compose
from reprotune.invoices import generate
from reprotune.models import load_base_model, load_tokenizer, resolve_model_dir
from reprotune.sizing.decide import Hardware, card, decide
from reprotune.sizing.memory import GIB, memory_budget
from reprotune.train import lora_config, sft_config

from .families import family_params

N_EXAMPLES = 6


def _trainer(tmp: Path, packing: bool, preset: str = "tiny_random"):
    from datasets import Dataset
    from trl import SFTTrainer

    cfg = compose([f"model={preset}", "hardware=cpu", f"paths.root={tmp}", f"train.packing={packing}",
                   "train.per_device_train_batch_size=1"])
    fast = decide(cfg, Hardware("cpu"), None, None)
    assert fast.packing is packing
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    model = load_base_model(model_dir, cfg, "cpu", "float32", fast.attn_implementation)
    rows = [{"messages": r["messages"]} for r in generate(N_EXAMPLES, seed=3)]
    trainer = SFTTrainer(model=model, args=sft_config(cfg, fast, False),
                         train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                         peft_config=lora_config(cfg))
    torch.manual_seed(0)  # LoRA B starts at zero, which would make every A gradient zero: perturb it
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    return trainer


@pytest.fixture(scope="module", params=family_params(fast=("qwen3",)))
def trainers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """One packed and one unpacked trainer per architecture family (test ids: [llama], [qwen3], ...)."""
    tmp = tmp_path_factory.mktemp("packing")
    packed, unpacked = _trainer(tmp, True, request.param), _trainer(tmp, False, request.param)
    # the same LoRA weights in both (same seed above, same init), so the two models are one function
    for (n1, p1), (n2, p2) in zip(packed.model.named_parameters(), unpacked.model.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    return packed, unpacked


def _segments(packed, unpacked) -> tuple[dict, list[tuple[int, int, int]]]:
    """The first packed row, collated, and (start, end, index of the unpacked example) for each segment."""
    row = packed.train_dataset[0]
    batch = packed.data_collator([row])
    ids = batch["input_ids"][0].tolist()
    singles = [ex["input_ids"] for ex in unpacked.train_dataset]
    segments, start = [], 0
    for length in row["seq_lengths"]:
        match = [k for k, single in enumerate(singles) if single == ids[start:start + length]]
        assert match, "a packed segment is not one whole example"
        segments.append((start, start + length, match[0]))
        start += length
    assert len(segments) >= 2, "the test needs a row holding several examples"
    return batch, segments


def _alone(unpacked, k: int) -> dict:
    return unpacked.data_collator([unpacked.train_dataset[k]])


def _forward(model, batch: dict) -> torch.Tensor:
    kwargs = {"input_ids": batch["input_ids"]}
    if "position_ids" in batch:
        kwargs["position_ids"] = batch["position_ids"]
    if "attention_mask" in batch:
        kwargs["attention_mask"] = batch["attention_mask"]
    return model(**kwargs).logits


def _token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="sum")


def test_packed_rows_hold_whole_examples_with_restarting_positions(trainers) -> None:
    packed, unpacked = trainers
    batch, segments = _segments(packed, unpacked)
    assert "attention_mask" not in batch  # padding-free: the mask comes from the position ids
    for start, end, _ in segments:
        assert batch["position_ids"][0, start:end].tolist() == list(range(end - start))


def test_labels_masked_exactly_as_unpacked(trainers) -> None:
    packed, unpacked = trainers
    batch, segments = _segments(packed, unpacked)
    for start, end, k in segments:
        alone = _alone(unpacked, k)["labels"][0].tolist()
        assert batch["labels"][0, start:end].tolist() == alone
        assert any(t != -100 for t in alone)  # assistant tokens are learned


def test_packed_logits_equal_each_example_alone(trainers) -> None:
    packed, unpacked = trainers
    batch, segments = _segments(packed, unpacked)
    model = packed.model.eval()
    with torch.no_grad():
        logits = _forward(model, batch)
        for start, end, k in segments:
            alone = _forward(model, _alone(unpacked, k))
            torch.testing.assert_close(logits[:, start:end], alone, atol=1e-5, rtol=0)


def test_leak_would_be_caught(trainers) -> None:
    """Control: the same packed tokens with positions that do not restart attend across examples, and the
    comparison above then fails for every example after the first."""
    packed, unpacked = trainers
    batch, segments = _segments(packed, unpacked)
    leaky = {"input_ids": batch["input_ids"],
             "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}
    model = packed.model.eval()
    with torch.no_grad():
        logits = _forward(model, leaky)
        start, end, k = segments[1]
        alone = _forward(model, _alone(unpacked, k))
        assert (logits[:, start:end] - alone).abs().max() > 1e-3


FP32_UNIT_ROUNDOFF = torch.finfo(torch.float32).eps / 2  # 2**-24: the relative error of one fp32 operation


def grad_tolerance(grad: torch.Tensor, reduction_length: int) -> float:
    """How far two fp32 computations of one gradient may be apart when they only sum in another order: a sum
    of K terms is off by at most K unit roundoffs of the terms' scale (here the tensor's largest entry). Per
    tensor, not per entry: an entry near zero is a difference of large terms and carries their absolute error
    (a relative 1e-4 per entry failed on some CPUs for exactly those)."""
    return reduction_length * FP32_UNIT_ROUNDOFF * float(grad.abs().max())


def gradient_mismatches(model, batch: dict, unpacked, segments) -> list[tuple[str, float, float]]:
    """(parameter, max |packed - sum over examples|, tolerance) for every parameter outside its tolerance."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    model.zero_grad()
    _token_loss_sum(_forward(model, batch), batch["labels"]).backward()
    packed_grads = [p.grad.clone() for _, p in params]
    model.zero_grad()
    for _, _, k in segments:
        alone = _alone(unpacked, k)
        _token_loss_sum(_forward(model, alone), alone["labels"]).backward()
    length = batch["input_ids"].shape[1]  # the longest reduction: over the row's tokens (X^T dY, attention)
    bad = []
    for g_packed, (name, p) in zip(packed_grads, params, strict=True):
        assert p.grad.abs().max() > 0, name
        diff, tol = float((g_packed - p.grad).abs().max()), grad_tolerance(p.grad, length)
        if diff > tol:
            bad.append((name, diff, tol))
    return bad


def test_packed_gradients_equal_the_sum_over_examples(trainers) -> None:
    packed, unpacked = trainers
    batch, segments = _segments(packed, unpacked)
    bad = gradient_mismatches(packed.model.train(), batch, unpacked, segments)
    assert not bad, f"packed gradients differ beyond fp32 precision (parameter, |diff|, tolerance): {bad[:3]}"


def test_gradient_tolerance_catches_a_leak(trainers) -> None:
    """Control: with positions that do not restart (attention across examples) the same check fails, by far."""
    packed, unpacked = trainers
    batch, segments = _segments(packed, unpacked)
    leaky = {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1])[None]}
    bad = gradient_mismatches(packed.model.train(), leaky, unpacked, segments)
    assert bad and max(diff / tol for _, diff, tol in bad) > 100


@pytest.mark.slow
@pytest.mark.parametrize("level", ["avx2", "avx512"])
def test_packed_gradients_under_each_kernel_level(level: str) -> None:
    """The gradient check above under torch's AVX2 and AVX-512 kernels (native mode, the level forced), each in
    its own process: the tolerance is fp32's, not one CPU's."""
    import os
    import subprocess
    import sys

    from reprotune.manifest import cpu_state

    if level == "avx512" and not {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(cpu_state()["isa"]):
        pytest.skip("this CPU has no AVX-512")
    code = ("import sys; sys.argv = ['x', 'hardware.cpu_kernels=native']; import reprotune, torch, pytest; "
            "print('capability', torch.backends.cpu.get_cpu_capability()); "
            "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'not slow', '-k', 'gradients_equal or catches_a_leak', __import__('os').path.join("
            "'tests', 'test_packing.py')]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("REPROTUNE_C")}
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "ATEN_CPU_CAPABILITY": level},
                          capture_output=True, text=True, timeout=900)
    assert f"capability {level.upper()}" in proc.stdout, proc.stdout[-2000:]
    assert proc.returncode == 0 and " passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout[-3000:]


def test_cpu_default_keeps_the_unpacked_path() -> None:
    cfg = compose(["model=tiny_random"])
    fast = decide(cfg, Hardware("cpu"), None, None)
    assert not fast.packing and not fast.liger and not fast.activation_checkpointing
    gpu = decide(compose(["model=tiny_random", "hardware=gpu"]), card("H200"), None, None)
    assert gpu.packing and gpu.attn_implementation == "varlen_attention" and not gpu.dynamic_shapes


@pytest.mark.parametrize(("extra", "hardware", "want"), [
    ([], {}, "varlen_attention"),                                    # packed CUDA: the varlen kernel
    (["repro=strict"], {}, "varlen_attention"),                      # deterministic backward (runtime.deterministic_kernels)
    (["repro=fast"], {}, "varlen_attention"),                        # the same kernel, its backward with atomics
    ([], {"varlen_attention": False}, "flex_attention"),             # torch or the GPU without it
    (["hardware.attn_implementation=sdpa"], {}, "sdpa"),            # asked for by name
    (["train.packing=false"], {}, None),                             # unpacked: the library's default
])
def test_packed_gpu_runs_pick_the_varlen_kernel_in_every_mode(extra: list[str], hardware: dict, want: str) -> None:
    from dataclasses import replace

    run = decide(compose(["model=tiny_random", "hardware=gpu", *extra]), replace(card("H200"), **hardware),
                 None, None)
    assert run.attn_implementation == want
    assert any(r == f"attention={want or 'sdpa'}" for r in run.reasons), run.reasons


def test_the_varlen_kernel_is_known_to_transformers_once_registered() -> None:
    """What load_base_model does before from_pretrained: the name passes transformers' check and the model
    dispatches to reprotune's function (the kernel itself runs only on CUDA: tests/test_varlen_gpu.py)."""
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from reprotune import varlen_attention

    assert varlen_attention.available()
    varlen_attention.register()
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "varlen_attention"
    model = LlamaForCausalLM(config)
    assert model.config._attn_implementation == "varlen_attention"
    assert AttentionInterface().get_interface("varlen_attention", None) is varlen_attention.varlen_attention_forward


def _shape(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, **kw)


@pytest.mark.parametrize(("method", "budget_gib", "ckpt"), [("qlora", 20, True), ("qlora", 40, True),
                                                           ("lora", 126, False), ("lora", 20, True)])
def test_memory_fit_keeps_the_global_batch(method: str, budget_gib: float, ckpt: bool) -> None:
    """The fit on a GPU (an H200 described, budget hardware.memory_budget_gib) trades rows for accumulation and
    checkpointing, never the global batch (the 8B Llama-block shape, 4 x 1,100-token rows x 4)."""
    cfg = compose(["model=llama_shape_8b_random", f"method={method}", "data.max_length=1100",
                   "train.max_length=1100", "train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=4",
                   f"hardware.memory_budget_gib={budget_gib}", "paths.prepared=/nonexistent"])
    run = decide(cfg, card("H200"), None, None)
    assert run.per_device_train_batch_size * run.gradient_accumulation_steps == 16, run.reasons
    assert run.activation_checkpointing is ckpt and run.predicted["card_gib"] <= budget_gib, run.reasons


def test_qlora_default_budget_is_a_24gb_card() -> None:
    cfg = compose(["method=qlora"])
    assert memory_budget(cfg, 140 * GIB) == 22 * GIB  # of card: ~20 GiB peak allocated
    assert memory_budget(cfg, 140 * GIB) < 23.5 * GIB  # an RTX 4090 as torch sees it
    assert memory_budget(compose(["method=lora"]), 100 * GIB) == 90 * GIB


def test_step_flops_of_an_8b_shape() -> None:
    # ~7.2e9 dense weights per token: 2 x forward (forward + input gradient) ~ 29 GFLOP, +1 forward recomputed
    plain = flops.lora_step_flops_per_token(_shape(), 655, recompute=False)
    assert 28e9 < plain < 30.5e9
    assert flops.lora_step_flops_per_token(_shape(), 655, recompute=True) > 1.45 * plain
