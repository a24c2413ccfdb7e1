"""The throughput model: tokens/s of a run's settings on the H200 (constants in conf/plan/throughput.yaml, fitted
to measured runs by reprotune.sizing.calibration; docs/plan.md), other GPUs scaled by their bf16 peak, and the
steps and tokens of a run. No torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig

from reprotune.flops import (
    H200_BF16_FLOPS,
    attention_flops_per_token,
    checkpointed_layers,
    lora_step_flops_per_token,
)
from reprotune.objectives import Objective
from reprotune.run_settings import Settings
from reprotune.sizing.draws import run_keys
from reprotune.sizing.memory import offloaded_layers
from reprotune.sizing.shape import DataShape, Shape


def as_model_config(shape: Shape) -> SimpleNamespace:
    """The config.json attributes reprotune.flops' counts read (the same counts as the manifest's MFU)."""
    return SimpleNamespace(hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                           num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                           num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab)


@dataclass(frozen=True)
class MicroStep:
    counted: float    # tokens per micro-step that tokens/s counts (packed: all; unpacked: non-padding)
    computed: float   # tokens the GPU computes (unpacked: padded to the longest example of the micro-batch)
    context: float    # mean attention context per token (block-diagonal when packed)


def micro_step(s: Settings, data: DataShape | None) -> MicroStep:
    """Tokens of a typical micro-step. Unpacked rows are padded to the micro-batch's longest example: its
    expected length assumes lengths spread evenly between (2 mean - max) and max (only mean and max are known)."""
    rows = s.batch_size * s.sequences  # padded preference pairs: two rows a pair
    if data is None:
        return MicroStep(rows * s.max_length, rows * s.max_length, s.max_length / 2)
    mean, longest = min(data.mean_tokens, s.max_length), min(data.max_tokens, s.max_length)
    if s.packing:
        return MicroStep(s.batch_size * s.max_length, s.batch_size * s.max_length, mean)
    shortest = max(1.0, 2 * mean - longest)
    padded = shortest + (longest - shortest) * rows / (rows + 1)
    return MicroStep(rows * mean, rows * padded, padded)


def no_grad_passes(s: Settings) -> int:
    """Forwards without gradients per micro-step, each about as many tokens as the micro-batch (padded preference
    pairs: DPO's and KTO's reference; KTO's KL batch through the policy, and the reference)."""
    return int(s.reference) + (1 + int(s.reference) if s.kl_rows else 0)


def code_path(s: Settings) -> str:
    """The throughput classes of conf/plan/throughput.yaml: the fast path (Liger's fused kernels, no PEFT input
    casts) and the unfused SDPA path it replaced."""
    return "fast" if s.liger else "unfused"


@dataclass(frozen=True)
class StepWork:
    """What one micro-step does, for the throughput model (docs/plan.md)."""
    path: str            # "fast" or "unfused" (code_path)
    qlora: bool
    flops: float         # FLOPs per computed token (reprotune.flops' count, recompute included)
    attention_flops: float  # of which attention's (QK^T and PV: grows with the context, runs in its own kernels)
    step: MicroStep
    layer_passes: float  # decoder-layer passes: forward and backward of every layer, + one per recomputed layer
    recomputed: int      # checkpointed (recomputed) layers
    offloaded_bytes: float = 0.0  # layer inputs copied to host and back per micro-step (activation offloading)
    mlp_tiles: int = 0   # tiled MLP pieces run per micro-step (each tile forward in the recompute and the backward)
    host_embedding_bytes: float = 0.0  # embedding rows gathered on the host and copied to the GPU per micro-step


def step_work(shape: Shape, s: Settings, data: DataShape | None) -> StepWork:
    k = checkpointed_layers(shape.layers, s.ckpt_every) if s.checkpointing else 0
    step = micro_step(s, data)
    config, extra = as_model_config(shape), no_grad_passes(s)
    recompute = k / shape.layers + extra  # a forward without gradients costs what a recomputed forward does
    flops = lora_step_flops_per_token(config, step.context, recompute, tiled_mlp=bool(s.tiled_mlp))
    attention = (3 + recompute) * attention_flops_per_token(config, step.context)
    offloaded = offloaded_layers(shape, s) * shape.hidden * s.dtype_bytes * step.computed  # issue #48: some, or all
    sequence = step.computed if s.packing else step.computed / (s.batch_size * s.sequences)  # tiles split it
    tiles = 2 * shape.layers * math.ceil(sequence / s.tiled_mlp) if s.tiled_mlp and sequence > s.tiled_mlp else 0
    # the input embedding on the host: every forward (with gradients, and each without) gathers its rows there
    host_rows = (1 + extra) * shape.hidden * s.dtype_bytes * step.computed if s.host_embedding else 0.0
    return StepWork(path=code_path(s), qlora=s.load_in_4bit, flops=flops, attention_flops=attention, step=step,
                    layer_passes=(2 + extra) * shape.layers + k, recomputed=k, offloaded_bytes=offloaded,
                    mlp_tiles=tiles, host_embedding_bytes=host_rows)


def overhead_terms(w: StepWork) -> dict[str, float]:
    """What each constant of throughput.yaml multiplies per micro-step (milliseconds per unit): the GEMM time at
    the measured dense bf16 rate (gemm_time_factor: how much slower the real mix of products runs), and the
    decoder-layer passes, QLoRA's passes and its recomputed layers."""
    dense = w.flops - w.attention_flops
    return {f"{w.path}.gemm_time_factor": 1e3 * dense * w.step.computed / H200_BF16_FLOPS,
            # attention's kernels (FlashAttention's varlen, flex) run at their own rate: the long-context runs
            # of issue #27, where attention is most of the work, set it
            "attention_time_factor": 1e3 * w.attention_flops * w.step.computed / H200_BF16_FLOPS,
            f"{w.path}.layer_pass_ms": w.layer_passes,
            f"{w.path}.qlora_layer_pass_ms": w.layer_passes if w.qlora else 0.0,
            "qlora_recompute_layer_ms": float(w.recomputed) if w.qlora else 0.0,
            "mlp_tile_ms": float(w.mlp_tiles)}


def model_seconds_per_token(w: StepWork, tp: dict[str, Any]) -> dict[str, float]:
    """Seconds per counted token on the H200, by term: the GEMMs (their FLOPs at the measured dense bf16 rate,
    times a fitted factor), and a cost per decoder-layer pass and micro-step (kernel launches and Python, unfused
    element-wise work, LoRA's rank-16 products; for QLoRA the NF4 dequantisation of each pass, and an extra cost
    per recomputed layer)."""
    m = tp["model"]

    def const(key: str) -> float:
        node = m
        for part in key.split("."):
            node = node[part]
        return float(node)

    ms = {key: n * const(key) for key, n in overhead_terms(w).items() if n}
    gemm_ms = sum(v for k, v in ms.items() if k.endswith(("gemm_time_factor", "attention_time_factor")))
    # offloading copies on its own CUDA streams, overlapped with compute: it costs only what outlasts the step
    # (each byte crosses the host link twice: out in the forward, back in the backward)
    transfer_ms = 2e3 * w.offloaded_bytes / (float(m["offload_gb_per_s"]) * 1e9)
    stall_ms = max(0.0, transfer_ms - sum(ms.values()))
    # the host embedding's gather and copy hold up the forward that waits for them: never overlapped
    host_ms = 1e3 * w.host_embedding_bytes / (float(m["host_embedding_gb_per_s"]) * 1e9)
    return {"gemm": gemm_ms / 1e3 / w.step.counted,
            "overhead": (sum(ms.values()) - gemm_ms + stall_ms + host_ms) / 1e3 / w.step.counted}


def model_tokens_per_second(shape: Shape, s: Settings, data: DataShape | None, throughput: dict[str, Any]) -> float:
    """The throughput model's tokens/s on the H200."""
    return 1 / sum(model_seconds_per_token(step_work(shape, s, data), throughput).values())


def tokens_per_second(shape: Shape, s: Settings, data: DataShape | None, gpu: str,
                      tables: dict[str, Any]) -> tuple[float, str]:
    """The throughput model on the H200 (docs/plan.md); other GPUs: scaled by their bf16 peak (unmeasured)."""
    tp = tables["throughput"]
    t = model_seconds_per_token(step_work(shape, s, data), tp)
    tps = 1 / (t["gemm"] + t["overhead"])
    how = f"model ({code_path(s)} path): GEMMs {t['gemm'] / (t['gemm'] + t['overhead']):.0%} of the time"
    if gpu != "H200":
        tps *= tp["gpus"][gpu]["tflops"] / tp["gpus"]["H200"]["tflops"]
        how += f"; scaled from the H200 by {gpu}'s bf16 peak (unmeasured)"
    return tps, how


def steps_and_tokens(s: Settings, data: DataShape | None, cfg: DictConfig, obj: Objective) -> dict[str, Any]:
    if data is None:
        return {}
    if s.packing and not obj.preference:
        batches = math.ceil(math.ceil(data.total_tokens / s.max_length) / s.batch_size)
    else:
        batches = math.ceil(data.examples / s.batch_size)
    steps_per_epoch = max(1, math.ceil(batches / s.grad_accum))
    keys = run_keys(cfg)  # a preference run's objective.max_steps / num_train_epochs win over train's
    max_steps = keys["max_steps"]
    steps = max_steps if max_steps > 0 else math.ceil(steps_per_epoch * keys["num_train_epochs"])
    epochs = steps / steps_per_epoch
    return {"examples": data.examples, "tokens_per_epoch": data.total_tokens, "steps_per_epoch": steps_per_epoch,
            "steps": steps, "epochs": round(epochs, 3), "tokens_trained": int(epochs * data.total_tokens)}
