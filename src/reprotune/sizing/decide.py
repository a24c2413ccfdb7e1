"""One decision per run: the settings `make train` trains with and `make plan` reports, decided once from the
config and a description of the hardware, each choice with its reason.

    run = decide(cfg, card("H200"), resolved=plan)           # make plan: a described card (resolved: its Run)
    run = decide(cfg, detect(train.device), resolved=train)  # make train: this process's GPU (sizing.preflight)

A pure function of the config, the stage's Run (its repro mode; paths.prepared: the prepared data's token lengths),
a local config.json and a Hardware value, so a CPU test can drive the CUDA branch with a described card. It decides:
- precision, and on CUDA the fast path (reprotune.speed's docstring says why each): padding-free packing, flex
  attention over the packed block-diagonal mask, Liger's fused kernels (when installed), LoRA's fused scale-and-add;
- activation checkpointing, its spacing, rows per micro-batch and gradient accumulation: with
  hardware.gradient_checkpointing=auto on CUDA, the fastest setting the throughput model predicts among those the
  memory model says fit the budget (reprotune.sizing.fit); otherwise as configured;
- processes, the strategy among them and each one's share of the accumulation (reprotune.distributed).
No torch, except in detect()."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig

from reprotune import distributed, schema, varlen_attention
from reprotune.config import every_n_layers, plain, quantization
from reprotune.errors import ReprotuneError
from reprotune.families import LLAMA_STYLE
from reprotune.models import random_init_architecture
from reprotune.objectives import Objective
from reprotune.run import Run, dtype_for, resolve
from reprotune.run_settings import RunSettings, Settings
from reprotune.runtime import attention, deterministic_kernels
from reprotune.sizing import host as host_memory
from reprotune.sizing.fit import TILE_TOKENS, describe, fit_to_budget, fits_host, fitting_setting
from reprotune.sizing.memory import (
    GIB,
    drawn_tokens,
    input_embedding_bytes,
    memory_budget,
    needed_bytes,
)
from reprotune.sizing.preference_plan import packed_reasons, padded_batch, padded_reason, pair_row_tokens
from reprotune.sizing.shape import (
    DataShape,
    PlanError,
    Shape,
    load_data_shape,
    load_table,
    load_tables,
    model_shape,
)


@dataclass(frozen=True)
class Hardware:
    """What the decision needs to know of the machine."""
    device: str                      # cuda | cpu | mps
    free_bytes: float | None = None  # GPU memory free for this run (None: no GPU)
    name: str = ""
    liger_installed: bool = True     # the CUDA lock installs liger-kernel; detect() looks
    world_size: int = 1
    # torch's FlashAttention varlen kernel (torch >= 2.10 on sm80+: every card of conf/plan/throughput.yaml)
    varlen_attention: bool = True
    host_available_bytes: float | None = None  # this host's MemAvailable (None: not known, a described card)
    multiprocessors: int = 0  # the GPU's SM count (FlashAttention's deterministic backward sizes its dQ sums by it)


def card(gpu: str, world_size: int = 1) -> Hardware:
    """A GPU of conf/plan/throughput.yaml, all of its usable memory free, with the CUDA lock's packages."""
    spec = load_tables()["throughput"]["gpus"][gpu]
    return Hardware(device="cuda", free_bytes=spec["memory_gib"] * GIB, name=gpu, world_size=world_size,
                    multiprocessors=int(spec["multiprocessors"]))


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def detect(device: str) -> Hardware:
    """The hardware this process runs on (device: the stage's resolved one, reprotune.run.Run.device)."""
    world = distributed.world().size
    if device != "cuda":
        return Hardware(device=device, name=device.upper(), liger_installed=liger_available(), world_size=world)
    import torch

    return Hardware(device="cuda", free_bytes=float(torch.cuda.mem_get_info()[0]),
                    name=torch.cuda.get_device_name(), liger_installed=liger_available(), world_size=world,
                    varlen_attention=varlen_attention.available() and torch.cuda.get_device_capability() >= (8, 0),
                    host_available_bytes=host_memory.host_available_bytes(world),
                    multiprocessors=torch.cuda.get_device_properties(0).multi_processor_count)


def _auto(value: Any) -> bool:
    return value is None or value == "auto"


def long_context_switches(cfg: DictConfig, device: str, obj: Objective) -> tuple[bool | None, bool | None]:
    """hardware.activation_offloading and hardware.tiled_mlp: True/False when set, None when auto (the fit
    decides on CUDA; off elsewhere). TRL's train.activation_offloading, passed through by hand, counts as set."""
    h = cfg.hardware
    offload = h.activation_offloading
    if cfg.train.get("activation_offloading") is not None:
        offload = bool(cfg.train.activation_offloading)
    offload = None if _auto(offload) else bool(offload)
    tiled = None if _auto(h.tiled_mlp) else bool(h.tiled_mlp)
    if obj.packs and cfg.train.get("packing") is not False:
        # packed DPO pairs (KTO's rows and ORPO's pairs take the same packed call): the tiled MLP's recompute does
        # not match its forward there (torch.utils.checkpoint's CheckpointError on the H200, 8B LoRA, 8 pairs of 1,668
        # tokens); never picked, refused when forced
        if tiled:
            raise ReprotuneError(f"hardware.tiled_mlp=true: not with {obj.name.upper()}'s packed {obj.unit} (the tiled MLP's recompute fails "
                                 "there); leave it auto, or set train.packing=false")
        tiled = False
        # offloading measured at half the speed of fewer pairs kept on the GPU (docs/measurements/
        # 2026-12-03-dpo-step-time-h200.md): every micro-step's row has another length, so its pinned host buffers are new
        # allocations each time. Only when asked for.
        offload = False if offload is None else offload
    elif obj.preference:
        # padded pairs (unpacked DPO, ORPO and KTO): neither has run on a GPU with TRL's preference trainers (packed
        # DPO pairs broke the tiled MLP's recompute; ORPOConfig has no offloading switch); only when asked for
        tiled = False if tiled is None else tiled
        offload = False if offload is None else offload
    if offload and device != "cuda":
        raise ReprotuneError(f"hardware.activation_offloading=true: TRL's activation offloading moves GPU tensors "
                             f"to host memory and this run is on {device} (use hardware=gpu, or leave it auto)")
    if device != "cuda":
        offload, tiled = False, bool(tiled)
    return offload, tiled


@dataclass(frozen=True)
class _Paths:
    """The code paths chosen before any memory is counted."""
    obj: Objective   # the run's objective (reprotune.run.Run.objective)
    run: Run         # the stage's Run: its repro mode, its paths.prepared
    dtype: str
    packing: bool
    attn: str | None
    liger: bool
    norm: str
    fused: bool
    optim: str
    workers: int
    reasons: tuple[str, ...]
    dq_split_sms: int = 0  # Settings.dq_split_sms


# transformers' per-tensor AdamW takes the square root of its second moment from torch.sqrt, which on a CPU is MKL's
# vector math (VML): not correctly rounded, and its last bit moves with the CPU it runs on (measured: the same pinned
# run gave other adapter bytes on an Intel Xeon and an AMD EPYC, and on an emulated Intel CPU; docs/reproducibility.md). The fused AdamW kernel takes it from the CPU's own square-root instruction, which IEEE
# 754 fixes to the correctly rounded result on every x86-64 and aarch64 CPU.
CPU_OPTIMIZER = {"adamw_torch": "adamw_torch_fused"}


def optimizer(cfg: DictConfig, device: str) -> tuple[str, str | None]:
    """train.optim as the run uses it, and the reason when it is not the configured one: on a CPU, the fused
    AdamW in place of the per-tensor one (same update rule; its bytes the same on every CPU)."""
    configured = str(cfg.train.get("optim") or "adamw_torch")
    if device == "cpu" and configured in CPU_OPTIMIZER:
        fused = CPU_OPTIMIZER[configured]
        return fused, (f"optimizer {fused} (train.optim={configured} on a CPU: its square roots are MKL's vector "
                       "math, whose last bit moves with the CPU; the fused kernel's are IEEE's)")
    return configured, None


def _paths(cfg: DictConfig, hw: Hardware, resolved: Run) -> _Paths:
    h, cuda, obj = cfg.hardware, hw.device == "cuda", resolved.objective
    fast = cuda if _auto(h.fast_path) else bool(h.fast_path)
    reasons = [f"fast_path={'on' if fast else 'off'} ({'GPU' if cuda else hw.device})"]
    # DPO's packed pairs compute what TRL's padded pairs do (tests/test_preference_packed.py) with each prompt once:
    # auto packs them on the CPU too (the built-in demo's DPO step: ~36 s a step against ~53 s padded, 2 cores)
    # KTO's packed rows and ORPO's packed pairs only where the fast path is (the CPU keeps TRL's padded batch, bytes)
    packing = (fast or obj.packs_on_cpu) if _auto(cfg.train.get("packing")) else bool(cfg.train.packing)
    if obj.packs and packing:
        reasons.append(obj.packed_reason)
    attn = attention(cfg, str(resolved.repro), packing, hw.device, varlen=hw.varlen_attention, pairs=obj.preference)
    reasons.append(f"attention={attn or 'sdpa'}")
    liger = h.liger_kernel
    if _auto(liger):
        liger = fast and cuda and hw.liger_installed
        if fast and cuda and not liger:
            reasons.append("liger-kernel not installed (pip install liger-kernel): unfused norms/activations")
    norm = norm_kernel(cfg, bool(liger), obj.preference)
    if norm == "torch":
        reasons.append("RMSNorm: torch's fused rms_norm (one ATen call a norm; Liger's Triton launcher costs more "
                       "host time, and these steps wait on the host)")
    if attn == "flex_attention":
        reasons.append("compile: dynamic shapes from the first call")
    fused = fast and cuda if _auto(h.fused_lora) else bool(h.fused_lora)
    if fused:
        reasons.append("LoRA scale and add fused into B's matrix product")
    optim, why = optimizer(cfg, hw.device)
    if why:
        reasons.append(why)
    workers = dataloader_workers(cfg, hw.device, packing, obj.preference)
    if workers:
        reasons.append(f"DataLoader workers: {workers}; the collator packs the next micro-batches (and gathers the host "
                       "embedding's rows) while the GPU computes, not at each step's start")
    return _Paths(obj=obj, run=resolved, dtype=dtype_for(str(cfg.hardware.dtype), hw.device), packing=packing, attn=attn, liger=bool(liger), norm=norm,
                  fused=fused, optim=optim, workers=workers, reasons=tuple(reasons),
                  dq_split_sms=dq_split_sms(str(resolved.repro), hw, attn))


def dq_split_sms(repro: str, hw: Hardware, attn: str | None) -> int:
    """The SM count FlashAttention's deterministic varlen backward splits dQ by on `hw` (Settings.dq_split_sms), 0
    where atomic adds run (the Run's repro=fast) or another kernel does."""
    varlen = attn in ("varlen_attention", "pair_varlen")
    return hw.multiprocessors if varlen and deterministic_kernels(repro, hw.device) else 0


def dataloader_workers(cfg: DictConfig, device: str, packing: bool, preference: bool) -> int:
    """hardware.dataloader_workers: processes that build the batches (the DataLoader's num_workers). auto: one for
    a packed preference run on CUDA, whose collator packs each micro-batch on the host (and gathers the host
    embedding's rows): the Trainer draws a step's micro-batches at the step's start, after the logging's
    synchronisation, so in the main process the GPU waits for them; a worker builds them while it computes. Zero
    elsewhere (the batches are the same either way: collating draws no random numbers). A worker is a fork of the
    trainer (the collator holds the model); where processes do not start by fork, none."""
    import multiprocessing

    chosen = cfg.hardware.dataloader_workers
    if _auto(chosen):
        chosen = int(device == "cuda" and packing and preference)
    chosen = int(chosen)
    if chosen < 0:
        raise ReprotuneError(f"hardware.dataloader_workers: {chosen} is negative (auto, 0 or a number of processes)")
    return chosen if multiprocessing.get_context().get_start_method() == "fork" else 0


NORM_KERNELS = schema.NORM_KERNELS
LLAMA_STYLE_FAMILIES = tuple(LLAMA_STYLE)  # reprotune.families: why these


def model_family(cfg: DictConfig, shape: Shape | None = None) -> str:
    """The model's transformers model_type: the shape's when read, else the preset's (a random_init's from its
    spec); "" when not known before the model is downloaded."""
    if shape is not None:
        return shape.model_type
    if cfg.model.get("model_type"):
        return str(cfg.model.model_type)
    if cfg.model.get("source") == "random_init":
        return random_init_architecture(plain(cfg.model.random_init))[0]
    return ""


def norm_kernel(cfg: DictConfig, liger: bool, preference: bool) -> str:
    """hardware.norm_kernel: which kernel the RMSNorms run when Liger's kernels are on (off: the model's own).
    auto: torch's fused rms_norm for a preference run's Llama-style norms, Liger's otherwise. Why: a packed DPO
    step waits on the host, and torch's call costs about a third of the host time of Liger's launcher; an SFT step
    of 16 rows keeps the GPU busy and is no faster with it (docs/measurements/2026-12-03-dpo-fused-rmsnorm-h200.md).
    Gemma's (1 + weight) norm has no torch kernel as it is: always Liger's."""
    if not liger:
        return "eager"
    chosen = cfg.hardware.norm_kernel
    chosen = ("torch" if preference else "liger") if _auto(chosen) else str(chosen)
    if chosen not in NORM_KERNELS:
        raise ReprotuneError(f"hardware.norm_kernel: {chosen!r} is not one of auto, {', '.join(NORM_KERNELS)}")
    if chosen == "torch" and model_family(cfg) not in LLAMA_STYLE_FAMILIES:
        return "liger"
    return chosen


def embedding_switch(cfg: DictConfig, hw: Hardware, shape: Shape | None, obj: Objective) -> bool | None:
    """hardware.embedding_on_host: True/False when it is decided here, None when auto leaves it to the memory fit
    (on the host only where that lets a faster setting fit the budget: reprotune.sizing.fit.with_host_embedding).
    auto considers it for preference runs only, where it was measured (bench/dpo_recipe.py, docs/preference.md);
    an SFT run's picks stay as recorded (tests/golden/run_picks.json) unless it is set true. Only a GPU run's
    untied, frozen, plain input embedding can stay on the host; set true otherwise, one line."""
    value = cfg.hardware.embedding_on_host
    if (not _auto(value) and not bool(value)) or (_auto(value) and not obj.preference):
        return False
    why = _why_embedding_stays(cfg, hw, shape)
    if why is None:
        return None if _auto(value) else True
    if _auto(value):
        return False
    raise ReprotuneError(f"hardware.embedding_on_host=true: {why}; leave it auto or set it false")


def _why_embedding_stays(cfg: DictConfig, hw: Hardware, shape: Shape | None) -> str | None:
    """Why this run's input embedding cannot stay on the host (None: it can; the model itself is checked again
    when loaded: reprotune.host_embedding.why_not_on_host)."""
    if hw.device != "cuda":
        return "the run is not on a GPU"
    if shape is not None and shape.tied:
        return "the input embedding is tied to the LM head, which the GPU needs"
    family = model_family(cfg, shape)
    if shape is not None and family not in LLAMA_STYLE_FAMILIES:
        return f"{family or 'this model'}'s input embedding is not a plain torch.nn.Embedding"
    if cfg.model.get("lora_trainable_tokens"):
        return "model.lora_trainable_tokens trains rows of the input embedding"
    if distributed.strategy(cfg, hw.world_size) == "fsdp2":
        return "FSDP2 shards the model's parameters"
    return None


def packed_pairs(cfg: DictConfig, p: _Paths) -> bool:
    """DPO's and ORPO's packed pairs, KTO's packed rows (reprotune.preference.packed): modelled as packed rows, one
    pair (one KTO example) per row."""
    return p.obj.packs and p.packing


def padded_preference(cfg: DictConfig, p: _Paths) -> bool:
    """A preference run on TRL 1.16's padded batches: DPO, ORPO or KTO unpacked (train.packing=false; ORPO and KTO
    off a GPU)."""
    return p.obj.preference and not packed_pairs(cfg, p)


def preference_padded_on(cfg: DictConfig, hw: Hardware, resolved: Run | None = None) -> bool:
    """padded_preference on `hw` (make plan reads the prepared rows the way the run will batch them)."""
    resolved = resolved if resolved is not None else resolve(cfg, "plan")
    return padded_preference(cfg, _paths(cfg, hw, resolved))


def _memory_view(cfg: DictConfig, p: _Paths, data: DataShape | None | str = "prepared") -> Settings:
    """The memory model's view of the configured run (checkpointing=auto counted as on: the fit decides); packed
    DPO pairs as packed rows of the longest pair (rows = pairs per micro-batch); padded preference rows as
    padded_batch says, each sequence at most the objective's max_length."""
    method, train = cfg.method, cfg.train
    rows, accum = configured_batch(cfg)
    targets = method.target_modules or cfg.model.lora_target_modules
    targets = [targets] if isinstance(targets, str) else list(targets)
    quant = quantization(cfg) or {}
    ckpt = cfg.hardware.gradient_checkpointing
    attn = p.attn or "sdpa"
    offload, tiled = long_context_switches(cfg, "cuda", p.obj)  # forced on: in the view; auto: the fit adds them
    # a packed DPO pair is one row; KTO's rows are the same packed or padded (one sequence each, the reference and
    # the KL batch's forwards without gradients, at least two rows: TRL refuses one with the KL term)
    obj = p.obj
    unpaired_rows = obj.preference and not obj.paired  # KTO's
    padded = padded_batch(cfg, obj) if padded_preference(cfg, p) or unpaired_rows else {}
    if packed_pairs(cfg, p):
        max_length = pair_row_tokens(cfg, obj, data, p.run)
    elif padded:
        max_length = int(cfg.objective.get("max_length") or train.max_length)
    else:
        max_length = int(train.max_length)
    return Settings(method=str(method.name), load_in_4bit=bool(quant.get("load_in_4bit", False)),
                    double_quant=bool(quant.get("bnb_4bit_use_double_quant", False)),
                    dora=bool(method.use_dora), r=int(method.r), targets=tuple(targets),
                    checkpointing=True if _auto(ckpt) else bool(ckpt), packing=p.packing,
                    batch_size=rows, grad_accum=accum,
                    max_length=max_length,
                    # varlen_attention keeps what flex attention keeps for backward (q, k, v, out, lse): one rule
                    # pair_dense (strict DPO) keeps each document's score matrix for backward, as eager does
                    eager_attention=attn in ("eager", "pair_dense"),
                    mask_repeats_kv=attn not in ("eager", "pair_dense") and not attn.startswith("flash"),
                    dtype_bytes=4 if p.dtype == "float32" else 2, liger=p.liger, input_casts=False,
                    ckpt_every=every_n_layers(cfg), offload=bool(offload),
                    offload_layers=max(0, host_memory.configured_offload_layers(cfg) or 0) if offload else 0,
                    tiled_mlp=tile_tokens(cfg) if tiled else 0,
                    host_embedding=_forced_on(cfg.hardware.embedding_on_host), dq_split_sms=p.dq_split_sms, **padded)


def configured_batch(cfg: DictConfig) -> tuple[int, int]:
    """The configured micro-batch and accumulation: their one read (the trainer gets the fitted pair, RunSettings)."""
    return int(cfg.train.per_device_train_batch_size), int(cfg.train.gradient_accumulation_steps)


def _forced_on(value: Any) -> bool:
    """A switch set true (auto: the fit decides, so not in the configured view)."""
    return not _auto(value) and bool(value)


def tile_tokens(cfg: DictConfig) -> int:
    """hardware.tiled_mlp_tokens, else the fit's largest tile (reprotune.sizing.fit.TILE_TOKENS)."""
    return configured_tile(cfg) or TILE_TOKENS


def configured_tile(cfg: DictConfig) -> int | None:
    """hardware.tiled_mlp_tokens when set: the one tile size the fit may use (None: the fit picks)."""
    value = cfg.hardware.get("tiled_mlp_tokens")
    return int(value) if value else None


def configured_settings(cfg: DictConfig, hw: Hardware | None = None, resolved: Run | None = None) -> Settings:
    """The memory model's view of the run as configured on `hw` (default: a GPU with the CUDA lock), unfitted."""
    resolved = resolved if resolved is not None else resolve(cfg, "plan")
    return _memory_view(cfg, _paths(cfg, hw or Hardware(device="cuda"), resolved))


@dataclass(frozen=True)
class _Fitted:
    """The batch and memory switches as configured, then as the fit on a GPU chose them."""
    rows: int
    accum: int
    ckpt: Any            # hardware.gradient_checkpointing: auto until the fit decides
    every: int
    offload: bool | None
    tile: int
    host: bool | None
    planned: Settings | None
    budget: float | None = None
    host_budget: float | None = None  # what offloading may take of host memory (None: not checked)
    predicted: dict[str, Any] | None = None
    fits: bool = True
    fallback: Settings | None = None
    fallback_gib: float | None = None


def _fit_reasons(host_bytes: float | None, shape: Shape, data: DataShape | None, planned: Settings,
                 predicted: dict[str, Any]) -> list[str]:
    """The plan's lines for what the fit switched on: drawn micro-batches, the host embedding, offloading, tiles."""
    reasons = []
    if drawn := drawn_tokens(planned, data):
        reasons.append(f"plan: the largest micro-batch of {planned.batch_size} pairs this run draws holds {drawn} "
                       f"tokens (its seeded order, reprotune.sizing.draws), not {planned.batch_size} x the "
                       f"longest pair = {planned.batch_size * planned.max_length}")
    if planned.host_embedding:
        freed = input_embedding_bytes(shape.vocab * shape.hidden, planned)
        reasons.append(f"input embedding on the host: {freed / GIB:.2f} GiB of GPU memory for activations, its "
                       "rows gathered there and copied to the GPU each forward (the same values)")
    if planned.offload:
        reasons.append(f"activation offloading: the inputs of {predicted['offloaded_layers']} of "
                       f"{predicted['layers']} layers, {predicted['host_offload_gib']} GiB of pinned host memory"
                       + (f" of a {host_bytes / GIB:.1f} GiB host budget" if host_bytes is not None else
                          " (host budget not checked: hardware.host_memory_budget_gib)"))
    if planned.tiled_mlp:
        reasons.append(f"MLP in {planned.tiled_mlp}-token tiles: its intermediates live for one tile at a time")
    return reasons


def _fit_on_gpu(cfg: DictConfig, hw: Hardware, p: _Paths, shape: Shape, data: DataShape | None, f: _Fitted,
                tiled: bool | None, reasons: list[str]) -> _Fitted:
    """The fastest setting the memory model fits in the budget (reprotune.sizing.fit); when none fits, the
    smallest card it would fit on (fallback)."""
    consts = load_table("memory.yaml")
    budget = min(memory_budget(cfg, hw.free_bytes), hw.free_bytes)
    host = host_memory.host_budget(cfg, hw.host_available_bytes)
    planned, predicted = fit_to_budget(f.planned, not _auto(f.ckpt), shape, data, budget, consts, f.offload, tiled,
                                       host, configured_tile(cfg), f.host, host_memory.configured_offload_layers(cfg))
    fits = needed_bytes(predicted, consts) <= hw.free_bytes and fits_host(predicted, host)
    fallback = fallback_gib = None
    if not fits:
        found = fitting_setting(shape, replace(_memory_view(cfg, p), checkpointing=True), data,
                                hw.free_bytes / GIB, consts, f.offload, tiled, host,
                                configured_tile(cfg), f.host, host_memory.configured_offload_layers(cfg))
        fallback, fallback_gib = (found[0], found[1]["card_gib"]) if found else (None, None)
    if _auto(f.ckpt):
        f = replace(f, rows=planned.batch_size, accum=planned.grad_accum, ckpt=planned.checkpointing,
                    every=planned.ckpt_every)
        reasons.append(f"plan: {describe(planned)}: predicted {predicted['peak_gib']} GiB peak of a "
                       f"{budget / GIB:.1f} GiB budget")
    reasons += _fit_reasons(host, shape, data, planned, predicted)
    return replace(f, offload=planned.offload, tile=planned.tiled_mlp, host=planned.host_embedding, planned=planned,
                   budget=budget, host_budget=host, predicted=predicted, fits=fits, fallback=fallback,
                   fallback_gib=fallback_gib)


def _run_settings(cfg: DictConfig, hw: Hardware, p: _Paths, f: _Fitted, reasons: list[str]) -> RunSettings:
    ckpt = False if _auto(f.ckpt) else bool(f.ckpt)  # off CUDA nothing is fitted: auto is off
    strategy = distributed.strategy(cfg, hw.world_size)
    process_accum, batch_line = distributed.global_batch(cfg, f.rows, f.accum, hw.world_size)
    return RunSettings(method=str(cfg.method.name), device=hw.device, dtype=p.dtype, packing=p.packing,
                       attn_implementation=p.attn, liger=p.liger, norm_kernel=p.norm, fused_lora=p.fused, optim=p.optim,
                       dynamic_shapes=p.attn == "flex_attention", activation_checkpointing=ckpt,
                       checkpoint_every_n_layers=f.every if ckpt else 1, activation_offloading=bool(f.offload),
                       offload_layers=f.planned.offload_layers if f.offload and f.planned else 0,
                       tiled_mlp_tokens=f.tile, embedding_on_host=bool(f.host), dataloader_workers=p.workers,
                       per_device_train_batch_size=f.rows,
                       gradient_accumulation_steps=f.accum, world_size=hw.world_size, strategy=strategy,
                       process_accumulation=process_accum, global_batch=batch_line, budget_bytes=f.budget,
                       host_budget_bytes=f.host_budget,
                       planned=f.planned, predicted=f.predicted, fits=f.fits, fallback=f.fallback,
                       fallback_card_gib=f.fallback_gib, reasons=tuple(reasons))


def decide(cfg: DictConfig, hw: Hardware, shape: Shape | None = None,
           data: DataShape | None | str = "prepared", resolved: Run | None = None) -> RunSettings:
    """The run's settings on `hw`. shape: the model's (default: from its preset, reprotune.sizing.shape.model_shape;
    train passes the downloaded config.json's for a preset without one); data: the prepared data's token lengths
    (default: read from paths.prepared; None: full-length examples); resolved: the stage's Run (default: plan's)."""
    resolved = resolved if resolved is not None else resolve(cfg, "plan")
    p = _paths(cfg, hw, resolved)
    reasons = list(p.reasons)
    try:
        shape = shape or model_shape(cfg.model)
    except PlanError as err:  # an unknown architecture must not block training: say so and go on as configured
        reasons.append(f"plan: {err} (no memory fit)")
        shape = None
    padded, (rows, accum) = padded_preference(cfg, p), configured_batch(cfg)
    data = (load_data_shape(cfg, padded=padded, world_size=hw.world_size, resolved=resolved, global_batch=rows * accum)
            if data == "prepared" else data)
    if shape is not None and packed_pairs(cfg, p):
        lines, data = packed_reasons(cfg, p.obj, data)
        reasons += lines
    offload, tiled = long_context_switches(cfg, hw.device, p.obj)
    host_memory.check_offload_layers(cfg, offload, shape)
    f = _Fitted(rows=rows, accum=accum, ckpt=cfg.hardware.gradient_checkpointing, every=every_n_layers(cfg), offload=offload,
                tile=tile_tokens(cfg) if tiled else 0, host=embedding_switch(cfg, hw, shape, p.obj),
                planned=_memory_view(cfg, p, data) if shape else None)
    if hw.device == "cuda" and f.planned is not None:
        f = _fit_on_gpu(cfg, hw, p, shape, data, f, tiled, reasons)
    if padded and f.planned is not None:
        reasons.append(f"plan: {padded_reason(p.obj, f.planned, data)}")
    return _run_settings(cfg, hw, p, f, reasons)
