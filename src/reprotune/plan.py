"""Plan stage: memory, time and cost of a training run before renting the GPU; the preflight of `make train`.

    python -m reprotune.plan [hydra overrides]        # == make plan ARGS="<the same overrides as make train>"

Reads  the composed config, conf/plan/{memory,throughput,prices}.yaml, data/prepared/{report.json,train.jsonl}.
Writes outputs/plan.json and prints the same: parameters, predicted peak GPU memory by part, a fit table for
24/40/48/80/141 GB cards, steps, time per epoch and cost per provider, and warnings.

No weights are loaded and neither torch nor transformers is imported: shapes come from the model preset
(`architecture`, or `random_init`) or from a local model directory's config.json. The memory model counts what
autograd keeps per token and layer (constants in conf/plan/memory.yaml, checked against GPU measurements in
conf/plan/calibration.json by tests/test_plan.py; docs/plan.md explains it).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf

from reprotune import speed
from reprotune.config import CONF_DIR, every_n_layers, quantization

log = logging.getLogger("reprotune.plan")

GIB = 2**30
PLAN_DIR = CONF_DIR / "plan"
# The SmolLM2 tokenizer that random_init presets take from the built-in model (len(tokenizer))
BUILTIN_TOKENIZER_VOCAB = 49152
# model_type (config.json / a preset's model_type) -> what its decoder layers add to a Llama layer: per-head q/k
# RMSNorm (qk_norm) and norms per layer (Gemma 3's sandwich norms: 4)
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2")
NORMS_PER_LAYER = {"gemma3": 4, "gemma3_text": 4, "gemma2": 4}
LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PlanError(ValueError):
    """The configuration cannot be planned (e.g. a hub model without a known architecture)."""


def load_table(name: str) -> dict[str, Any]:
    return yaml.safe_load((PLAN_DIR / name).read_text())


# ------------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    source: str
    model_type: str = "llama"
    qk_norm: bool = False       # Qwen3, Gemma 3: q_norm/k_norm over each head (weights and saved activations)
    norms_per_layer: int = 2

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear module of a decoder layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def shape_from_config(conf: dict[str, Any], source: str, model_type: str | None = None) -> Shape:
    """From a config.json-like mapping (Llama/Qwen/Mistral/Gemma keys); model_type from the mapping or given."""
    conf = conf.get("text_config", conf)
    model_type = str(conf.get("model_type") or model_type or "llama")
    try:
        hidden, heads = int(conf["hidden_size"]), int(conf["num_attention_heads"])
        return Shape(hidden=hidden, intermediate=int(conf["intermediate_size"]),
                     layers=int(conf["num_hidden_layers"]), heads=heads,
                     kv_heads=int(conf.get("num_key_value_heads") or heads),
                     head_dim=int(conf.get("head_dim") or hidden // heads),
                     vocab=int(conf.get("vocab_size") or BUILTIN_TOKENIZER_VOCAB),
                     tied=bool(conf.get("tie_word_embeddings", False)), source=source, model_type=model_type,
                     qk_norm=model_type in QK_NORM_TYPES, norms_per_layer=NORMS_PER_LAYER.get(model_type, 2))
    except KeyError as err:
        raise PlanError(f"{source}: architecture: missing {err.args[0]}") from None


def model_shape(model_cfg: Any) -> Shape:
    """The shape of the configured model, without loading it."""
    model = _plain(model_cfg)
    path = model.get("path")
    if path and (Path(path) / "config.json").is_file():
        return shape_from_config(json.loads((Path(path) / "config.json").read_text()), f"{path}/config.json")
    if model.get("source") == "random_init":
        spec = dict(model["random_init"])
        if spec.get("architecture") is not None:  # what reprotune.models.random_init_config builds
            arch = dict(spec["architecture"])
            arch["vocab_size"] = arch.get("vocab_size") or BUILTIN_TOKENIZER_VOCAB  # null: the tokenizer's ids
            return shape_from_config(arch, f"conf/model/{model['name']}.yaml: random_init.architecture",
                                     spec.get("model_type"))
        spec.setdefault("tie_word_embeddings", True)  # the flat form: a tied Llama with the tokenizer's vocabulary
        spec["vocab_size"] = BUILTIN_TOKENIZER_VOCAB
        return shape_from_config(spec, f"conf/model/{model['name']}.yaml: random_init", "llama")
    if model.get("architecture"):
        return shape_from_config(dict(model["architecture"]), f"conf/model/{model['name']}.yaml: architecture",
                                 model.get("model_type"))
    raise PlanError(f"conf/model/{model.get('name')}.yaml: architecture: missing; add the model's config.json numbers "
                    "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
                    "vocab_size, tie_word_embeddings) or set model.path to a local directory with a config.json")


@dataclass(frozen=True)
class Params:
    total: int          # base model
    layer_linear: int   # the decoder layers' linear weights (what NF4 quantises)
    embeddings: int     # input embedding + untied LM head
    largest_linear: int
    trainable: int      # LoRA A/B (+ DoRA magnitudes)


def count_params(shape: Shape, targets: list[str], r: int, dora: bool) -> Params:
    dims = shape.module_dims()
    per_layer_linear = sum(i * o for i, o in dims.values())
    norms = shape.norms_per_layer * shape.hidden + (2 * shape.head_dim if shape.qk_norm else 0)
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    total = shape.layers * (per_layer_linear + norms) + embeddings + shape.hidden
    chosen = [m for m in LINEAR_MODULES if m in targets] if targets != ["all-linear"] else list(LINEAR_MODULES)
    trainable = shape.layers * sum(r * (dims[m][0] + dims[m][1]) + (dims[m][1] if dora else 0) for m in chosen)
    return Params(total=total, layer_linear=shape.layers * per_layer_linear, embeddings=embeddings,
                  largest_linear=max(i * o for i, o in dims.values()), trainable=trainable)


# ------------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class DataShape:
    examples: int
    max_tokens: int
    mean_tokens: float
    total_tokens: int
    assistant_share: float    # assistant characters / all message characters (the loss positions)
    prepared_max_length: int | None
    tokenizer_model: str | None
    overlong: int
    source: str


def data_shape_from_prepared(prepared: Path | str) -> dict[str, Any]:
    """Token lengths (prepare's report, counted with the model's tokenizer and chat template) and the assistant
    share of the training examples; a dict so bench/plan_calibrate.py can store it next to a measurement."""
    prepared = Path(prepared)
    report = json.loads((prepared / "report.json").read_text())
    train = report["tokens"]["train"]
    chars = assistant = 0
    with open(prepared / "train.jsonl", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                for msg in json.loads(line)["messages"]:
                    n = len(msg.get("content") or "")
                    chars += n
                    assistant += n if msg.get("role") == "assistant" else 0
    return {"examples": int(train["n"]), "max_tokens": int(train["max"]), "mean_tokens": float(train["mean"]),
            "total_tokens": int(train["total"]), "assistant_share": round(assistant / chars, 4) if chars else 1.0,
            "prepared_max_length": report.get("max_length"), "tokenizer_model": report["tokens"].get("model"),
            "overlong": int(report["examples"]["overlong"]["count"]), "source": str(prepared)}


def load_data_shape(cfg: DictConfig) -> DataShape | None:
    prepared = Path(cfg.paths.prepared)
    if not (prepared / "report.json").is_file() or not (prepared / "train.jsonl").is_file():
        return None
    return DataShape(**data_shape_from_prepared(prepared))


# --------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class Settings:
    method: str
    load_in_4bit: bool
    double_quant: bool
    dora: bool
    r: int
    targets: tuple[str, ...]
    checkpointing: bool
    packing: bool
    batch_size: int
    grad_accum: int
    max_length: int
    eager_attention: bool
    mask_repeats_kv: bool     # SDPA with a mask (and flex attention) repeat K/V to every head
    dtype_bytes: int
    liger: bool = False       # Liger's fused RMSNorm/SwiGLU/RoPE
    input_casts: bool = False  # PEFT's per-adapter input casts (train.py disables them under bf16 autocast)
    ckpt_every: int = 1       # with checkpointing: every n-th decoder layer (transformers' every_n_layers)


def _auto(value: Any) -> bool:
    return value is None or value == "auto"


def settings_from_cfg(cfg: DictConfig, checkpointing: bool | None = None) -> Settings:
    """The settings `make train` would use on a GPU (or on the CPU with hardware.device=cpu), resolved as
    reprotune.speed.choose resolves them: the fast path packs, uses flex attention and Liger's kernels."""
    method, train, hw = cfg.method, cfg.train, cfg.hardware
    targets = method.target_modules or cfg.model.lora_target_modules
    targets = [targets] if isinstance(targets, str) else list(targets)
    cuda = hw.device != "cpu"
    fast = cuda if _auto(hw.get("fast_path", "auto")) else bool(hw.fast_path)
    packing = fast if _auto(train.get("packing")) else bool(train.packing)
    attn = hw.get("attn_implementation", "auto")
    if _auto(attn):
        attn = "eager" if cfg.repro == "strict" and not packing else ("flex_attention" if packing and cuda else "sdpa")
    liger = hw.get("liger_kernel", "auto")
    liger = fast and cuda if _auto(liger) else bool(liger)  # the CUDA lock installs liger-kernel
    ckpt = hw.gradient_checkpointing if checkpointing is None else checkpointing
    cpu_fp32 = hw.dtype == "float32" or (hw.dtype == "auto" and not cuda)
    quant = quantization(cfg) or {}
    return Settings(method=str(method.name), load_in_4bit=bool(quant.get("load_in_4bit", False)),
                    double_quant=bool(quant.get("bnb_4bit_use_double_quant", False)),
                    dora=bool(method.use_dora), r=int(method.r), targets=tuple(targets),
                    checkpointing=True if _auto(ckpt) else bool(ckpt),  # auto: decided by fit_setting
                    packing=packing, batch_size=int(train.per_device_train_batch_size),
                    grad_accum=int(train.gradient_accumulation_steps), max_length=int(train.max_length),
                    eager_attention=attn == "eager", mask_repeats_kv=attn != "eager" and not attn.startswith("flash"),
                    dtype_bytes=4 if cpu_fp32 else 2, liger=liger, input_casts=False, ckpt_every=every_n_layers(cfg))


# ------------------------------------------------------------------------------------------------ memory
def micro_batch_tokens(s: Settings, data: DataShape | None) -> int:
    """Tokens in the largest micro-batch: packed rows are filled up to max_length; unpacked batches are padded
    to their longest example, and the data's longest example is in some batch of an epoch."""
    longest = s.max_length if data is None else min(data.max_tokens, s.max_length)
    return s.batch_size * (s.max_length if s.packing else longest)


def weight_bytes(p: Params, s: Settings, consts: dict[str, Any]) -> float:
    if not s.load_in_4bit:
        return p.total * s.dtype_bytes
    w = consts["weights"]
    per_param = w["nf4_bytes_per_param"]
    if s.double_quant:
        per_param += 1 / w["nf4_block"] + 4 / (w["nf4_block"] * w["nf4_double_quant_block"])
    else:
        per_param += 4 / w["nf4_block"]
    return p.layer_linear * per_param + (p.total - p.layer_linear) * 2


def adapter_bytes(p: Params, s: Settings, consts: dict[str, Any]) -> float:
    """Trainable parameters + gradients + AdamW states: fp32 for LoRA on a 16-bit base (PEFT's autocast of
    adapter dtypes), bf16 for QLoRA (TRL casts the adapters of a quantised model to bf16)."""
    per = 2 if (s.load_in_4bit and s.dtype_bytes == 2) else 4
    autocast_copy = 2 if per == 4 and s.dtype_bytes == 2 else 0  # bf16 copies of fp32 adapters, kept for backward
    return p.trainable * (per * (2 + consts["optimizer"]["states_per_param"]) + autocast_copy)


def layer_activation_bytes(shape: Shape, s: Settings, consts: dict[str, Any]) -> float:
    """Bytes per token that one decoder layer keeps for backward (no checkpointing)."""
    a = consts["activations"]
    c = a["input_casts" if s.input_casts and not s.load_in_4bit else "no_input_casts"]
    per_token = c["h_coef"] * shape.hidden + c["i_coef"] * shape.intermediate + c["kv_coef"] * shape.kv_dim
    if s.liger:
        per_token += a["liger"]["h_delta"] * shape.hidden + a["liger"]["i_delta"] * shape.intermediate
    if s.mask_repeats_kv:
        per_token += a["gqa_mask_coef"] * (shape.q_dim - shape.kv_dim)
    if shape.qk_norm:  # q_norm/k_norm keep their input (+ an fp32 copy without Liger's RMSNorm)
        qk = a["qk_norm"]
        per_token += (qk["coef"] + (qk["liger_delta"] if s.liger else 0.0)) * (shape.q_dim + shape.kv_dim)
    return per_token * s.dtype_bytes / 2


def activation_bytes(shape: Shape, s: Settings, tokens: int, consts: dict[str, Any]) -> dict[str, float]:
    """Activations of the largest micro-batch, with and without checkpointing, and the backward transients."""
    a = consts["activations"]
    layer = layer_activation_bytes(shape, s, consts) * tokens
    base = a["base_h_coef"] * shape.hidden * tokens * s.dtype_bytes / 2
    rows = s.batch_size
    seq = tokens // max(rows, 1)
    eager_layer = rows * shape.heads * seq * seq * a["eager_score_bytes"] if s.eager_attention else 0.0
    backward = (a["backward_h_coef"] * shape.hidden + a["backward_i_coef"] * shape.intermediate) * tokens
    return {
        "no_checkpointing": shape.layers * (layer + eager_layer) + base,
        "checkpointing": shape.layers * a["checkpointed_h_coef"] * shape.hidden * tokens * s.dtype_bytes / 2
        + base,
        "recompute_layer": layer + eager_layer,
        "backward_transient": backward * s.dtype_bytes / 2,
    }


def lm_head_bytes(shape: Shape, tokens: int, assistant_share: float, consts: dict[str, Any]) -> float:
    """TRL's fused LM head: logits exist only as (4096 tokens x 32768 vocabulary) tiles of the loss positions."""
    lm = consts["lm_head"]
    valid = max(1, int(tokens * assistant_share))
    tile = min(valid, lm["token_tile"]) * min(shape.vocab, lm["vocab_tile"]) * 2
    return lm["tiles_live"] * tile + lm["per_valid_token_h_coef"] * shape.hidden * valid


def memory(shape: Shape, p: Params, s: Settings, data: DataShape | None,
           consts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Predicted peak of torch.cuda.max_memory_allocated for these settings, by part (bytes and GiB)."""
    consts = consts or load_table("memory.yaml")
    tokens = micro_batch_tokens(s, data)
    share = data.assistant_share if data else 1.0
    act = activation_bytes(shape, s, tokens, consts)
    lm = lm_head_bytes(shape, tokens, share, consts)
    dequant = p.largest_linear * 2 * consts["weights"]["dequant_temp_layers"] if s.load_in_4bit else 0.0
    static = weight_bytes(p, s, consts) + adapter_bytes(p, s, consts)
    k = speed.checkpointed_layers(shape.layers, s.ckpt_every) if s.checkpointing else 0
    if k == shape.layers:
        # backward: the loss head first, then one layer at a time is recomputed next to the saved layer inputs
        dynamic = act["checkpointing"] + max(lm, act["recompute_layer"] + act["backward_transient"]) + dequant
    elif k == 0:
        dynamic = act["no_checkpointing"] + lm + act["backward_transient"] + dequant
    else:  # every n-th layer keeps its input only; a recomputed layer may meet the loss head's buffers
        kept = (k * act["checkpointing"] + (shape.layers - k) * act["no_checkpointing"]) / shape.layers
        dynamic = kept + max(lm, act["recompute_layer"]) + act["backward_transient"] + dequant
    allocated = static + dynamic
    o = consts["overhead"]
    reserved = allocated * o["reserved_over_allocated"]
    parts = {"weights": weight_bytes(p, s, consts), "adapter_optimizer_grads": adapter_bytes(p, s, consts),
             "activations_checkpointing": act["checkpointing"] + act["recompute_layer"],
             "activations_no_checkpointing": act["no_checkpointing"],
             "backward_transient": act["backward_transient"] + dequant,
             "logits_loss": lm, "cuda_context": o["cuda_context_gib"] * GIB,
             "allocator_reserve": reserved - allocated}
    return {"tokens_per_micro_batch": tokens, "checkpointing": s.checkpointing, "checkpointed_layers": k,
            "peak_allocated_bytes": allocated, "peak_gib": round(allocated / GIB, 2),
            "reserved_gib": round(reserved / GIB, 2),
            "card_gib": round((reserved + o["cuda_context_gib"] * GIB) / GIB, 2),
            "parts_gib": {k: round(v / GIB, 3) for k, v in parts.items()}}


def needed_bytes(mem: dict[str, Any], consts: dict[str, Any]) -> float:
    """What a card must have free: reserved peak + CUDA context + margin."""
    return (mem["card_gib"] + consts["overhead"]["margin_gib"]) * GIB


# -------------------------------------------------------------------------------------------------- fit
PARTIAL_EVERY = (8, 6, 4, 3, 2)  # every_n_layers tried between no checkpointing and all layers


# More tokens per micro-step amortise its fixed per-layer costs (kernel launches, PEFT's Python, NF4 dequantisation:
# throughput.yaml's layer_pass_ms), so the preflight may trade gradient accumulation for rows. Up to the largest
# packed micro-step measured on the H200 (16 rows of 1,100 tokens: 8B QLoRA, checkpointing every layer).
MAX_MICRO_STEP_TOKENS = 17_600


def rebatched(s: Settings) -> list[Settings]:
    """The same global batch (rows x accumulation) in fewer, larger packed micro-steps; largest first."""
    if not s.packing:
        return []
    total = s.batch_size * s.grad_accum
    return [replace(s, batch_size=r, grad_accum=total // r) for r in range(total, s.batch_size, -1)
            if total % r == 0 and r * s.max_length <= MAX_MICRO_STEP_TOKENS]


def checkpointing_options(s: Settings) -> list[Settings]:
    """No checkpointing, every n-th layer, every layer: fastest to smallest at these rows."""
    return ([replace(s, checkpointing=False)] + [replace(s, checkpointing=True, ckpt_every=n) for n in PARTIAL_EVERY]
            + [replace(s, checkpointing=True, ckpt_every=1)])


def same_method_candidates(s: Settings) -> list[Settings]:
    """Everything the preflight weighs for the configured method: larger packed micro-steps (each with every
    checkpointing option), then candidate_settings' ladder of the same method."""
    return ([o for r in rebatched(s) for o in checkpointing_options(r)]
            + [c for c in candidate_settings(s) if c.load_in_4bit == s.load_in_4bit])


def candidate_settings(s: Settings) -> list[Settings]:
    """From fastest to smallest: no checkpointing, every n-th layer checkpointed, every layer, smaller
    micro-batches (same effective batch), then QLoRA for a 16-bit LoRA."""
    ladder = [replace(s, checkpointing=False)]
    # some layers before all of them (8B QLoRA, 4 rows, H200: none 10,282 tok/s, every 4th layer 7,753,
    # every layer 6,376)
    ladder += [replace(s, checkpointing=True, ckpt_every=n) for n in PARTIAL_EVERY]
    ladder.append(replace(s, checkpointing=True, ckpt_every=1))
    for bs in [r for r in range(s.batch_size - 1, 0, -1) if s.batch_size % r == 0]:  # as reprotune.speed
        ladder.append(replace(s, checkpointing=True, ckpt_every=1, batch_size=bs,
                              grad_accum=max(1, s.grad_accum * s.batch_size // bs)))
    if not s.load_in_4bit:
        q = replace(s, method="qlora", load_in_4bit=True, double_quant=True)
        ladder += [replace(c, method="qlora", load_in_4bit=True, double_quant=True) for c in ladder if
                   c.checkpointing] or [q]
    return ladder


def fastest_fitting(shape: Shape, cands: list[Settings], data: DataShape | None, capacity_bytes: float,
                    consts: dict[str, Any], throughput: dict[str, Any]) -> tuple[Settings, dict[str, Any]] | None:
    """Of the candidates whose card need fits, the one the throughput model predicts fastest (the earlier one on
    a tie); None when none fits."""
    best = None
    for cand in cands:
        mem = memory(shape, count_params(shape, list(cand.targets), cand.r, cand.dora), cand, data, consts)
        if needed_bytes(mem, consts) > capacity_bytes:
            continue
        tps = model_tokens_per_second(shape, cand, data, throughput)
        if best is None or tps > best[0]:
            best = (tps, cand, mem)
    return (best[1], best[2]) if best else None


def fitting_setting(shape: Shape, s: Settings, data: DataShape | None, capacity_gib: float,
                    consts: dict[str, Any]) -> tuple[Settings, dict[str, Any]] | None:
    """What fits a card: the fastest fitting setting of the configured method (larger micro-steps, then
    candidate_settings' ladder), else of the ladder's QLoRA fallback."""
    throughput = load_table("throughput.yaml")
    for cands in (same_method_candidates(s), [c for c in candidate_settings(s) if c.load_in_4bit != s.load_in_4bit]):
        found = fastest_fitting(shape, cands, data, capacity_gib * GIB, consts, throughput)
        if found:
            return found
    return None


def checkpointing_words(checkpointing: bool, every: int) -> str:
    return "off" if not checkpointing else ("on" if every == 1 else f"every {every} layers")


def describe(s: Settings) -> str:
    tokens = f"{s.batch_size}x{s.max_length} packed" if s.packing else f"bs {s.batch_size}"
    return (f"{s.method}{' (NF4)' if s.load_in_4bit else ''}, checkpointing {checkpointing_words(s.checkpointing, s.ckpt_every)}, "
            f"{tokens}, grad-accum {s.grad_accum}")


def overrides_for(s: Settings, base: Settings) -> list[str]:
    out = []
    if s.load_in_4bit and not base.load_in_4bit:
        out.append("method=qlora")
    out.append(f"hardware.gradient_checkpointing={str(s.checkpointing).lower()}")
    if s.checkpointing and s.ckpt_every > 1:
        out.append(f"++train.activation_checkpointing_kwargs.every_n_layers={s.ckpt_every}")
    if s.batch_size != base.batch_size:
        out += [f"train.per_device_train_batch_size={s.batch_size}", f"train.gradient_accumulation_steps={s.grad_accum}"]
    return out


# --------------------------------------------------------------------------------------------- time/cost
def as_model_config(shape: Shape) -> SimpleNamespace:
    """The config.json attributes reprotune.speed's FLOP counts read (the same counts as the manifest's MFU)."""
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
    if data is None:
        return MicroStep(s.batch_size * s.max_length, s.batch_size * s.max_length, s.max_length / 2)
    mean, longest = min(data.mean_tokens, s.max_length), min(data.max_tokens, s.max_length)
    if s.packing:
        return MicroStep(s.batch_size * s.max_length, s.batch_size * s.max_length, mean)
    shortest = max(1.0, 2 * mean - longest)
    padded = shortest + (longest - shortest) * s.batch_size / (s.batch_size + 1)
    return MicroStep(s.batch_size * mean, s.batch_size * padded, padded)


def code_path(s: Settings) -> str:
    """The throughput classes of conf/plan/throughput.yaml: the fast path (Liger's fused kernels, no PEFT input
    casts) and the unfused SDPA path it replaced."""
    return "fast" if s.liger else "unfused"


@dataclass(frozen=True)
class StepWork:
    """What one micro-step does, for the throughput model (docs/plan.md)."""
    path: str            # "fast" or "unfused" (code_path)
    qlora: bool
    flops: float         # FLOPs per computed token (reprotune.speed's count, recompute included)
    step: MicroStep
    layer_passes: float  # decoder-layer passes: forward and backward of every layer, + one per recomputed layer
    recomputed: int      # checkpointed (recomputed) layers


def step_work(shape: Shape, s: Settings, data: DataShape | None) -> StepWork:
    k = speed.checkpointed_layers(shape.layers, s.ckpt_every) if s.checkpointing else 0
    step = micro_step(s, data)
    flops = speed.lora_step_flops_per_token(as_model_config(shape), step.context, k / shape.layers)
    return StepWork(path=code_path(s), qlora=s.load_in_4bit, flops=flops, step=step,
                    layer_passes=2 * shape.layers + k, recomputed=k)


def overhead_terms(w: StepWork) -> dict[str, float]:
    """What each constant of throughput.yaml multiplies per micro-step (milliseconds per unit): the GEMM time at
    the measured dense bf16 rate (gemm_time_factor: how much slower the real mix of products runs), and the
    decoder-layer passes, QLoRA's passes and its recomputed layers."""
    return {f"{w.path}.gemm_time_factor": 1e3 * w.flops * w.step.computed / speed.H200_BF16_FLOPS,
            f"{w.path}.layer_pass_ms": w.layer_passes,
            f"{w.path}.qlora_layer_pass_ms": w.layer_passes if w.qlora else 0.0,
            "qlora_recompute_layer_ms": float(w.recomputed) if w.qlora else 0.0}


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
    gemm_ms = sum(v for k, v in ms.items() if k.endswith("gemm_time_factor"))
    return {"gemm": gemm_ms / 1e3 / w.step.counted,
            "overhead": (sum(ms.values()) - gemm_ms) / 1e3 / w.step.counted}


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


def steps_and_tokens(s: Settings, data: DataShape | None, cfg: DictConfig) -> dict[str, Any]:
    if data is None:
        return {}
    if s.packing:
        batches = math.ceil(math.ceil(data.total_tokens / s.max_length) / s.batch_size)
    else:
        batches = math.ceil(data.examples / s.batch_size)
    steps_per_epoch = max(1, math.ceil(batches / s.grad_accum))
    max_steps = int(cfg.train.max_steps)
    steps = max_steps if max_steps > 0 else math.ceil(steps_per_epoch * float(cfg.train.num_train_epochs))
    epochs = steps / steps_per_epoch
    return {"examples": data.examples, "tokens_per_epoch": data.total_tokens, "steps_per_epoch": steps_per_epoch,
            "steps": steps, "epochs": round(epochs, 3), "tokens_trained": int(epochs * data.total_tokens)}


def time_and_cost(shape: Shape, s: Settings, data: DataShape | None, cfg: DictConfig, tables: dict[str, Any],
                  consts: dict[str, Any]) -> list[dict[str, Any]]:
    """Per GPU class in the price table: the setting that fits it, tokens/s, time per epoch and run, cost."""
    prices, tp = tables["prices"], tables["throughput"]
    run = steps_and_tokens(s, data, cfg)
    rows = []
    forced = not _auto(cfg.hardware.gradient_checkpointing)
    for gpu in prices["gpus"]:
        capacity = card_budget_gib(cfg, tp["gpus"][gpu]["memory_gib"])
        fit = fitting_setting(shape, s, data, capacity, consts)
        if forced:  # the configured setting where it fits (make train does not change it)
            mem = memory(shape, count_params(shape, list(s.targets), s.r, s.dora), s, data, consts)
            fit = (s, mem) if needed_bytes(mem, consts) <= capacity * GIB else fit
        row: dict[str, Any] = {"gpu": gpu, "fits": fit is not None}
        if fit and run:
            cand = fit[0]
            tps, how = tokens_per_second(shape, cand, data, gpu, tables)
            seen = measured_run(str(cfg.model.name), cand, data) if gpu == "H200" else None
            if seen:
                tps, how = seen["measured"]["tokens_per_second"], f"measured: {seen['name']} (conf/plan/calibration.json)"
            hours = run["tokens_trained"] / tps / 3600
            row.update({"setting": describe(cand), "tokens_per_second": round(tps), "throughput_source": how,
                        "epoch_hours": round(run["tokens_per_epoch"] / tps / 3600, 3), "run_hours": round(hours, 3),
                        "cost_usd": {prov: (round(hours * table[gpu], 2) if table.get(gpu) is not None else None)
                                     for prov, table in prices["providers"].items()}})
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------- warnings
SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def warnings_for(cfg: DictConfig, s: Settings, data: DataShape | None, run: dict[str, Any]) -> list[str]:
    out = []
    model = cfg.model
    local = bool(model.path) and Path(str(model.path)).is_dir()
    if model.source == "hub" and not local and not SHA_RE.match(str(model.revision or "")):
        out.append(f"model.revision={model.revision}: the hub model {model.path} is not pinned to a commit; a new "
                   "upload changes your run (set model.revision=<40-hex sha>)")
    if model.get("gated") and not local and not (os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")):
        out.append(f"{model.path} is gated and HF_TOKEN is not set in the environment: the download will fail")
    builtin_tokenizer = model.source == "random_init" and not model.random_init.get("tokenizer_dir")
    vocab = model_shape(model).vocab
    if builtin_tokenizer and vocab < BUILTIN_TOKENIZER_VOCAB:  # what make train's vocabulary check will stop on
        out.append(f"model '{model.name}': the built-in tokenizer has {BUILTIN_TOKENIZER_VOCAB:,} ids but the model's "
                   f"vocab_size is {vocab:,}: make train stops (give it a tokenizer of at most {vocab:,} ids)")
    if data is None:
        out.append(f"{cfg.paths.prepared}: no prepared data (run make prepare); memory assumes full-length "
                   "examples, and no time or cost without token counts")
        return out
    if data.overlong:
        out.append(f"{data.overlong} example(s) were over data.max_length {data.prepared_max_length} when prepared "
                   f"({cfg.data.overlong}: see {data.source}/report.json)")
    if data.prepared_max_length is not None and int(data.prepared_max_length) != int(cfg.data.max_length):
        out.append(f"data was prepared with max_length {data.prepared_max_length}, the config says "
                   f"{cfg.data.max_length}: re-run make prepare")
    if data.max_tokens > s.max_length:
        out.append(f"the longest example ({data.max_tokens} tokens) is over train.max_length {s.max_length}: "
                   "TRL truncates it")
    if data.tokenizer_model and tokenizer_id(data.tokenizer_model) != tokenizer_id(str(model.name)):
        out.append(f"token counts come from {data.tokenizer_model}'s tokenizer (prepared for it), not {model.name}'s: "
                   "re-run make prepare with this model for exact counts")
    if run and run["epochs"] > 1.0 and int(cfg.train.max_steps) > 0:
        out.append(f"train.max_steps={cfg.train.max_steps} passes over the {data.examples} examples "
                   f"{run['epochs']:.1f} times: the dataset is small for this step count (overfitting risk)")
    if data.examples < s.batch_size * s.grad_accum:
        out.append(f"{data.examples} examples are fewer than one optimizer step's batch "
                   f"({s.batch_size} x {s.grad_accum})")
    return out


def tokenizer_id(preset: str) -> str:
    """Presets that share a tokenizer (the random shapes use the built-in SmolLM2 one) share token counts."""
    path = CONF_DIR / "model" / f"{preset}.yaml"
    if not path.is_file():
        return preset
    model = yaml.safe_load(path.read_text())
    builtin = model.get("builtin") or (model.get("random_init") or {}).get("tokenizer_from_builtin")
    return f"builtin:{builtin['sha256']}" if builtin else str(model.get("path") or preset)


# -------------------------------------------------------------------------------------------------- plan
def load_tables() -> dict[str, Any]:
    return {"memory": load_table("memory.yaml"), "throughput": load_table("throughput.yaml"),
            "prices": load_table("prices.yaml")}


def card_budget_gib(cfg: DictConfig, card_gib: float) -> float:
    """What `make train` lets itself use on a card: reprotune.speed.memory_budget with the card's memory free
    (hardware.memory_budget_gib, or auto: 22 GiB of card for QLoRA, else 90% of the card)."""
    return min(card_gib, speed.memory_budget(cfg, int(card_gib * GIB)) / GIB)


def decide_checkpointing(cfg: DictConfig, free_bytes: float) -> bool:
    """hardware.gradient_checkpointing: true/false as set; auto: on only if the run without it would not fit."""
    setting = cfg.hardware.gradient_checkpointing
    if setting != "auto":
        return bool(setting)
    consts = load_table("memory.yaml")
    shape = model_shape(cfg.model)
    s = settings_from_cfg(cfg, checkpointing=False)
    mem = memory(shape, count_params(shape, list(s.targets), s.r, s.dora), s, load_data_shape(cfg), consts)
    return needed_bytes(mem, consts) > free_bytes


def make_plan(cfg: DictConfig, device: str | None = None, free_bytes: float | None = None) -> dict[str, Any]:
    """The whole plan as a JSON-able dict. free_bytes: the GPU's free memory (preflight), else the largest card."""
    tables = load_tables()
    consts = tables["memory"]
    shape = model_shape(cfg.model)
    data = load_data_shape(cfg)
    card = free_bytes / GIB if free_bytes is not None else tables["throughput"]["gpus"]["H200"]["memory_gib"]
    budget = card_budget_gib(cfg, card) * GIB
    base = settings_from_cfg(cfg)
    s, mem = fit_to_budget(cfg, shape, data, budget, consts)  # the setting make train's preflight would pick
    p = count_params(shape, list(s.targets), s.r, s.dora)
    mem_other = memory(shape, p, replace(s, checkpointing=not s.checkpointing), data, consts)
    fit = {}
    for size, gpu in tables["throughput"]["cards"].items():
        found = fitting_setting(shape, base, data,
                                card_budget_gib(cfg, tables["throughput"]["gpus"][gpu]["memory_gib"]), consts)
        fit[f"{size} GB"] = ({"gpu": gpu, "setting": describe(found[0]), "overrides": overrides_for(found[0], base),
                              "peak_gib": found[1]["peak_gib"], "card_gib": found[1]["card_gib"]}
                             if found else {"gpu": gpu, "setting": None})
    run = steps_and_tokens(s, data, cfg)
    return {
        "model": {"name": str(cfg.model.name), "shape": asdict(shape), "parameters": p.total,
                  "trainable_parameters": p.trainable,
                  "frozen_weight_bytes": {"bf16": p.total * 2,
                                          "nf4_double_quant": int(weight_bytes(p, replace(s, load_in_4bit=True,
                                                                                          double_quant=True),
                                                                               consts))}},
        "settings": asdict(s) | {"gradient_checkpointing_setting": str(cfg.hardware.gradient_checkpointing),
                                 "budget_gib": round(budget / GIB, 1), "device": device},
        "memory": mem,
        "memory_other_checkpointing": mem_other,
        "fit": fit,
        "data": asdict(data) if data else None,
        "run": run,
        "time_and_cost": time_and_cost(shape, base, data, cfg, tables, consts),
        "prices_as_of": tables["prices"]["as_of"],
        "prices_verified": tables["prices"].get("verified", False),
        "warnings": warnings_for(cfg, s, data, run),
    }


# ---------------------------------------------------------------------------------------------- calibration
def load_calibration(path: Path | None = None) -> list[dict[str, Any]]:
    return json.loads((path or PLAN_DIR / "calibration.json").read_text())


def entry_settings(entry: dict[str, Any]) -> tuple[DictConfig, Settings]:
    """The composed config and the plan's settings of one measured configuration (its code_flags applied)."""
    from reprotune.config import compose

    cfg = compose([o for o in entry["overrides"] if not o.startswith(("paths.", "data.path="))])
    return cfg, replace(settings_from_cfg(cfg), **entry.get("code_flags", {}))


def predict_entry(entry: dict[str, Any], consts: dict[str, Any] | None = None,
                  throughput: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plan's prediction for one measured configuration (its overrides and its recorded data shape); tokens/s
    from the throughput model alone, never from the measurement itself."""
    cfg, s = entry_settings(entry)
    shape = model_shape(cfg.model)
    p = count_params(shape, list(s.targets), s.r, s.dora)
    data = DataShape(**entry["data_shape"])
    mem = memory(shape, p, s, data, consts or load_table("memory.yaml"))
    tps, _ = tokens_per_second(shape, s, data, "H200", {"throughput": throughput or load_table("throughput.yaml")})
    return {"peak_gib": mem["peak_gib"], "reserved_gib": mem["reserved_gib"], "tokens_per_second": round(tps),
            "parts_gib": mem["parts_gib"], "model": str(cfg.model.name), "settings": asdict(s),
            "work": step_work(shape, s, data)}


def calibration_errors(entries: list[dict[str, Any]], consts: dict[str, Any] | None = None,
                       throughput: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """(predicted - measured) / measured of the peak and of tokens/s, for every entry with a measured peak."""
    rows = []
    for e in entries:
        measured = (e.get("measured") or {}).get("peak_allocated_gib")
        if not measured:
            continue
        pred = predict_entry(e, consts, throughput)
        tps = e["measured"].get("tokens_per_second")
        rows.append({"name": e["name"], "predicted_gib": pred["peak_gib"], "measured_gib": measured,
                     "error": round((pred["peak_gib"] - measured) / measured, 4),
                     "measured_reserved_gib": e["measured"].get("peak_reserved_gib"),
                     "predicted_reserved_gib": pred["reserved_gib"],
                     "measured_tokens_per_second": tps,
                     "predicted_tokens_per_second": pred["tokens_per_second"],
                     "tokens_per_second_error": round((pred["tokens_per_second"] - tps) / tps, 4) if tps else None,
                     "tokens_per_second_outlier": e.get("tokens_per_second_outlier"),
                     "left_out_of_fit": e.get("left_out_of_throughput_fit"),
                     "model": pred["model"], "settings": pred["settings"], "work": pred["work"]})
    return rows


def measured_run(model_name: str, s: Settings, data: DataShape | None) -> dict[str, Any] | None:
    """A committed H200 measurement of exactly this configuration: the same model preset, the same settings
    (recorded as plan_settings by bench/plan_calibrate.py --table --write) and data of the same mean length."""
    if data is None:
        return None
    wanted = json.loads(json.dumps(asdict(s)))  # as stored: tuples become lists
    for e in load_calibration():
        mean = e.get("data_shape", {}).get("mean_tokens") or 0
        if (e.get("plan_model") == model_name and e.get("plan_settings") == wanted
                and abs(mean - data.mean_tokens) <= 0.02 * mean and (e.get("measured") or {}).get("tokens_per_second")
                and not e.get("tokens_per_second_outlier")):
            return e
    return None


def fit_throughput(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The overhead constants of conf/plan/throughput.yaml that best match measured runs (calibration_errors
    rows): least squares on relative error, each row  gemm/t + sum_k const_k * n_k / (1000 * tokens * t) = 1."""
    import numpy as np  # only here: make plan itself never fits

    keys = sorted({k for r in rows for k, n in overhead_terms(r["work"]).items() if n})
    a, b = [], []
    for r in rows:
        w, t = r["work"], 1 / r["measured_tokens_per_second"]
        terms = overhead_terms(w)
        a.append([terms.get(k, 0.0) / 1e3 / w.step.counted / t for k in keys])
        b.append(1.0)
    a_, b_ = np.array(a), np.array(b)
    free = list(range(len(keys)))
    solution = np.zeros(len(keys))
    while free:  # a cost cannot be negative: drop a negative constant (it stays 0) and refit the rest
        fitted, *_ = np.linalg.lstsq(a_[:, free], b_, rcond=None)
        if (fitted >= 0).all():
            solution[free] = fitted
            break
        free.pop(int(np.argmin(fitted)))
    return {k: round(float(v), 3) for k, v in zip(keys, solution, strict=True)}


def throughput_fit_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calibration rows the constants are fitted to: measured tokens/s, not marked outlier or left out."""
    return [r for r in rows if r["measured_tokens_per_second"] and not r["tokens_per_second_outlier"]
            and not r["left_out_of_fit"]]


def with_constants(throughput: dict[str, Any], constants: dict[str, float]) -> dict[str, Any]:
    """A copy of the throughput table with fitted constants ("fast.layer_pass_ms": 3.4, ...) put in."""
    out = copy.deepcopy(throughput)
    for key, value in constants.items():
        node = out["model"]
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return out


# ------------------------------------------------------------------------------------------------ report
def format_plan(plan: dict[str, Any]) -> str:
    m, mem, s = plan["model"], plan["memory"], plan["settings"]
    gib = 1 / GIB
    lines = [f"plan: {m['name']} ({m['shape']['source']})",
             f"  parameters {m['parameters'] / 1e9:.3f} B, trainable (LoRA r{s['r']}) {m['trainable_parameters'] / 1e6:.2f} M; "
             f"frozen weights bf16 {m['frozen_weight_bytes']['bf16'] * gib:.2f} GiB, "
             f"NF4+double quant {m['frozen_weight_bytes']['nf4_double_quant'] * gib:.2f} GiB",
             f"  settings: {s['method']}, checkpointing {checkpointing_words(s['checkpointing'], s['ckpt_every'])} "
             f"(hardware.gradient_checkpointing={s['gradient_checkpointing_setting']}, budget {s['budget_gib']} GiB), "
             f"{'packed ' if s['packing'] else ''}micro-batch {mem['tokens_per_micro_batch']} tokens "
             f"(bs {s['batch_size']}, max_length {s['max_length']})",
             f"  predicted peak GPU memory: {mem['peak_gib']} GiB allocated, {mem['reserved_gib']} GiB reserved, "
             f"{mem['card_gib']} GiB on the card",
             *[f"    {k.replace('_', ' '):32s} {v:8.2f} GiB" for k, v in mem["parts_gib"].items()],
             f"    (checkpointing {'off' if s['checkpointing'] else 'on'} instead: "
             f"{plan['memory_other_checkpointing']['peak_gib']} GiB)",
             "  fits:"]
    for size, row in plan["fit"].items():
        lines.append(f"    {size:7s} ({row['gpu']:8s}) " + (f"{row['setting']}: {row['peak_gib']} GiB peak"
                                                           if row["setting"] else "does not fit"))
    run = plan["run"]
    if run:
        lines.append(f"  data: {run['examples']} examples, {run['tokens_per_epoch']:,} tokens per epoch; "
                     f"{run['steps']} steps ({run['steps_per_epoch']} per epoch, {run['epochs']} epochs)")
        lines.append(f"  time and cost (prices as of {plan['prices_as_of']}"
                     f"{', unverified: edit conf/plan/prices.yaml' if not plan['prices_verified'] else ''}):")
        for row in plan["time_and_cost"]:
            if not row.get("tokens_per_second"):
                lines.append(f"    {row['gpu']:9s} does not fit")
                continue
            costs = ", ".join(f"{k} ${v:.2f}" for k, v in row["cost_usd"].items() if v is not None)
            scaled = "*" if "unmeasured" in row["throughput_source"] else " "
            lines.append(f"    {row['gpu']:9s} {row['tokens_per_second']:>6,} tok/s{scaled} epoch {row['epoch_hours'] * 60:7.1f} min"
                         f"  run {row['run_hours'] * 60:7.1f} min  {costs}")
        lines.append("    (H200: the throughput model of docs/plan.md, or a measured run of the same configuration; * scaled "
                     "from it by bf16 peak FLOPs, unmeasured; run 50 steps and read the manifest's tokens/s before a "
                     "long run)")
    for w in plan["warnings"]:
        lines.append(f"  warning: {w}")
    return "\n".join(lines)


def write_plan(plan: dict[str, Any], cfg: DictConfig) -> Path:
    from reprotune.manifest import write_json

    out = Path(cfg.paths.outputs) / "plan.json"
    write_json(out, plan)
    return out


# ---------------------------------------------------------------------------------------------- preflight
def preflight(cfg: DictConfig, device: str,
              budget_bytes: float | None = None) -> tuple[int, int, bool, int, str] | None:
    """Before `make train` loads the model, on a GPU: plan, write outputs/plan.json, and return (rows per
    micro-batch, gradient accumulation, checkpointing, every_n_layers, why) fitted to budget_bytes
    (reprotune.speed's memory budget; the GPU's free memory when None): the fastest fitting setting (fit_to_budget).
    Stops with one line (exit 2) when even that cannot fit the free memory. None on a CPU."""
    if device != "cuda":
        return None
    import torch

    free = float(torch.cuda.mem_get_info()[0])
    budget = free if budget_bytes is None else min(float(budget_bytes), free)
    try:
        consts, shape, data = load_table("memory.yaml"), model_shape(cfg.model), load_data_shape(cfg)
    except PlanError as err:  # an unknown architecture must not block training: say so and go on
        log.warning("plan: %s (no preflight)", err)
        return None
    chosen, mem = fit_to_budget(cfg, shape, data, budget, consts)
    plan = make_plan(cfg, device=device, free_bytes=free)
    plan["memory"] = mem
    plan["settings"].update(asdict(chosen))
    write_plan(plan, cfg)
    check_fits(cfg, plan, free, torch.cuda.get_device_name())
    why = f"plan: {describe(chosen)}: predicted {mem['peak_gib']} GiB peak of a {budget / GIB:.1f} GiB budget"
    log.info("preflight: %s (%.1f GiB free)", why, free / GIB)
    return chosen.batch_size, chosen.grad_accum, chosen.checkpointing, chosen.ckpt_every, why


def fit_to_budget(cfg: DictConfig, shape: Shape, data: DataShape | None, budget_bytes: float,
                  consts: dict[str, Any]) -> tuple[Settings, dict[str, Any]]:
    """The setting the throughput model predicts fastest among those whose card need fits the budget (the same
    global batch in larger packed micro-steps, then candidate_settings' ladder; the method is never changed),
    else the ladder's smallest; as configured when checkpointing is forced."""
    s = settings_from_cfg(cfg)
    forced = not _auto(cfg.hardware.gradient_checkpointing)
    cands = [s] if forced else same_method_candidates(s)
    if not forced:
        found = fastest_fitting(shape, cands, data, budget_bytes, consts, load_table("throughput.yaml"))
        if found:
            return found
    last = cands[-1]
    return last, memory(shape, count_params(shape, list(last.targets), last.r, last.dora), last, data, consts)


def check_fits(cfg: DictConfig, plan: dict[str, Any], free_bytes: float, gpu_name: str) -> None:
    """Stop (one line, exit status 2) when the planned run needs more than the GPU has free."""
    consts = load_table("memory.yaml")
    mem = plan["memory"]
    if needed_bytes(mem, consts) <= free_bytes:
        return
    shape, data = model_shape(cfg.model), load_data_shape(cfg)
    s = settings_from_cfg(cfg, checkpointing=True)
    found = fitting_setting(shape, s, data, free_bytes / GIB, consts)
    hint = (f"settings that fit: {' '.join(overrides_for(found[0], s))} ({found[1]['card_gib']} GiB)"
            if found else "nothing fits this GPU; use a larger card (make plan shows which)")
    print(f"train: preflight: predicted {mem['card_gib']} GiB (peak {mem['peak_gib']} GiB allocated) > "
          f"{free_bytes / GIB:.1f} GiB free on {gpu_name}; {hint}", file=sys.stderr)
    raise SystemExit(2)


def _plain(node: Any) -> dict[str, Any]:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        plan = make_plan(cfg)
    except PlanError as err:
        print(f"plan: {err}", file=sys.stderr)
        sys.exit(2)
    print(format_plan(plan))
    print(f"wrote {write_plan(plan, cfg)}")


if __name__ == "__main__":
    main()
