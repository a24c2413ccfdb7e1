"""Train stage: TRL SFTTrainer (or DPO/ORPO/KTO: objective=) + PEFT (LoRA, QLoRA, DoRA) on the prepared data.

    python -m reprotune.train [hydra overrides]      # == make train ARGS="..."

Reads  data/prepared/train.jsonl and the configured base model.
Writes outputs/adapter/ (adapter, tokenizer, chat template, model card), outputs/train/metrics.json (numbers
       only: DVC's metrics file), outputs/train/loss_curves.json (per-step train/eval loss),
       outputs/train/loss.png, outputs/train/plan.json (the preflight's decision) and outputs/train/manifest.json.
       Checkpoints go to outputs/checkpoints/ and
       an interrupted run resumes from the last one (train.run.resume=auto).

`train` is the recipe, read top to bottom: setup (device, data, tokenizer, the run's settings decided once by
reprotune.sizing.decide, model, the objective's trainer) -> train -> save -> report. Checkpoint sealing and
resume are reprotune.checkpoints; the objective's trainer is `recipe` (SFT here; DPO, ORPO and KTO from
reprotune.preference.trainers, on the preference pairs prepare wrote: docs/preference.md).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from reprotune import checkpoints, distributed, flops, speed, varlen_attention
from reprotune.config import CONF_DIR, library_keys
from reprotune.errors import ReprotuneError, user_errors
from reprotune.families import LLAMA_STYLE
from reprotune.io import content_key, key_fraction, read_examples
from reprotune.models import (
    base_identity,
    load_base_model,
    load_tokenizer,
    resolve_model_dir,
    training_chat_template,
)
from reprotune.objectives import Objective
from reprotune.preference.packed import packed_class, register_pair_attention
from reprotune.preference.trainers import (
    completion_tokens,
    init_adapter_dir,
    objective_record,
    preference_config,
    read_pairs,
    reference,
    reference_keeps_checkpointing,
    sequence_tokens,
    trl_classes,
    with_init_adapter,
)
from reprotune.rl.trainer import reward_metrics, rewards_for, rl_record, rl_rows
from reprotune.run import Run, resolve
from reprotune.run_settings import RunSettings
from reprotune.runtime import set_reproducibility
from reprotune.sizing.decide import detect
from reprotune.sizing.preflight import preflight, train_shape
from reprotune.train_outputs import loss_curves, mean_loss, save_adapter, write_curves
from reprotune.trainer_args import guarantee_keys, passthrough_keys

log = logging.getLogger("reprotune.train")


# ------------------------------------------------------------------------------------------------- data
def read_messages(path: Path) -> list[dict[str, Any]]:
    rows = []
    for example in read_examples(path, "run 'make prepare' first"):
        rows.append({"messages": example["messages"],
                     **({"tools": json.dumps(example["tools"])} if example.get("tools") else {})})
    if any("tools" in row for row in rows):
        # TRL passes a "tools" column (JSON text: Arrow would widen objects) to the chat template's tools=;
        # Dataset.from_list takes its columns from the first row, so every row gets one
        rows = [{**row, "tools": row.get("tools")} for row in rows]
    return rows


def split_validation(rows: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """A validation split drawn from train (never the holdout), chosen by content hash so it is stable.
    (ASCII-escaped keys, unlike prepare's: changing them would move existing validation splits.)"""
    def pick(row: dict) -> bool:  # a preference row by its prompt: no prompt on both sides
        return key_fraction(content_key(row["messages"] if "messages" in row else row["prompt"],
                                        ensure_ascii=True)) < fraction

    val = [r for r in rows if pick(r)]
    return [r for r in rows if not pick(r)], val


# ------------------------------------------------------------------------------------------------ model
# reprotune's own keys in the method and train groups; every other key is the library's and passes through whole


def trainable_token_ids(cfg: DictConfig, tokenizer) -> list[int]:
    """The ids of model.lora_trainable_tokens: tokens whose embedding rows train with the adapter (PEFT's
    trainable tokens; a tied head follows). A base model that never learnt its chat template's end-of-turn token
    (Gemma 3 270M pretrained: <end_of_turn>'s row is a near-copy of thousands of unused ones) cannot learn to stop
    through LoRA on the projections alone: its head scores that token like all the others."""
    names = list(cfg.model.get("lora_trainable_tokens") or [])
    ids = [tokenizer.convert_tokens_to_ids(name) for name in names]
    unknown = [n for n, i in zip(names, ids, strict=True) if i is None or i == tokenizer.unk_token_id]
    if unknown:
        raise ReprotuneError(f"model '{cfg.model.name}': model.lora_trainable_tokens: {unknown[0]!r} is not a "
                             "token of the tokenizer (name a token as the tokenizer spells it, e.g. <end_of_turn>)")
    return ids


def lora_config(cfg: DictConfig, tokenizer=None):
    """peft.LoraConfig from the method group as it is (target_modules null: the model preset's;
    trainable_token_indices absent: the ids of the model preset's lora_trainable_tokens, which need the tokenizer)."""
    from peft import LoraConfig

    keys = library_keys(cfg, "method")
    if keys.get("target_modules") is None:
        keys["target_modules"] = OmegaConf.to_container(cfg.model.lora_target_modules, resolve=True) \
            if OmegaConf.is_config(cfg.model.lora_target_modules) else cfg.model.lora_target_modules
    if "trainable_token_indices" not in keys and cfg.model.get("lora_trainable_tokens"):
        if tokenizer is None:
            raise ValueError("lora_config: model.lora_trainable_tokens needs the tokenizer")
        keys["trainable_token_indices"] = trainable_token_ids(cfg, tokenizer)
    return LoraConfig(task_type="CAUSAL_LM", **keys)


# ---------------------------------------------------------------------------------------------- trainer
def sft_config(cfg: DictConfig, run: RunSettings, has_val: bool, resolved: Run | None = None):
    """trl.SFTConfig from the train group as it is, plus the settings reprotune's guarantees rest on, which
    win over the group (reprotune.trainer_args.guarantee_keys), and the SFT-only speed settings fitted by
    reprotune.sizing.decide (packing). resolved: the stage's Run (guarantee_keys' default: plan's)."""
    from trl import SFTConfig

    keys = passthrough_keys(cfg, "train")
    keys.update(
        **guarantee_keys(cfg, run, keys, has_val, resolved),
        packing=run.packing,
        activation_offloading=run.activation_offloading,  # TRL's OffloadActivations (long context, issue #27)
        packing_strategy="bfd",  # best-fit decreasing, padding-free: position ids restart per example
        chat_template_path=cfg.model.training_chat_template,
        # packed batches hold no padding; unpacked ones are counted without it (pad is often eos)
        include_num_input_tokens_seen="all" if run.packing else "non_padding",
    )
    return SFTConfig(**keys)


def apply_liger(model, active: bool, norm: str = "liger") -> None:
    """Liger's layer kernels (RMSNorm, SwiGLU, RoPE) on the model, exactly what TRL 1.16's use_liger_kernel=True
    makes the Trainer do at the start of train(): transformers' apply_liger_kernel with the fused linear
    cross-entropy off (it would replace the forward that computes the loss). Called here because TRL deprecates
    that switch for Hub kernels (model_init_kwargs={"use_kernels": True}), which need the `kernels` package and
    a Hub download: neither is in the lock nor offline. norm="torch": the RMSNorms run torch's fused rms_norm
    instead of Liger's (run.norm_kernel, decided in reprotune.sizing.decide)."""
    if not active:
        return
    from transformers.integrations.liger import apply_liger_kernel

    apply_liger_kernel(model, {"fused_linear_cross_entropy": False, "rms_norm": norm == "liger"})
    if norm == "torch":
        use_torch_rms_norm(model)


def use_torch_rms_norm(model) -> int:
    """Every Llama-style RMSNorm (weight * x / rms(x); Llama, Mistral, Qwen2/3) of the model runs torch's fused
    rms_norm: one ATen call forward and one backward, where Liger's goes through a Python launcher (host time
    a call, and a Qwen3-8B forward has 145 norms). Returns how many norms it changed."""
    import types

    from torch.nn.functional import rms_norm

    def forward(self, hidden_states):
        return rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)

    n = 0
    for module in model.modules():
        if type(module).__name__ in LLAMA_STYLE_NORMS:
            module.forward = types.MethodType(forward, module)
            n += 1
    return n


LLAMA_STYLE_NORMS = frozenset(LLAMA_STYLE.values())  # the norms of reprotune.families' Llama-style table


def register_attention(attn_implementation: str | None) -> None:
    """reprotune's own attention kernels, registered by the stage that runs them before the model loads
    (transformers checks the name then): the varlen kernel, and DPO's packed pairs' kernels."""
    varlen_attention.register_if_chosen(attn_implementation)
    register_pair_attention(attn_implementation)


def mean_example_tokens(dataset, n_examples: int) -> float:
    """Mean tokens per training example (packed rows hold several; a preference pair is two sequences)."""
    total = sum(len(ids) for ids in dataset["input_ids"]) if "input_ids" in dataset.column_names \
        else sequence_tokens(dataset)
    return total / max(n_examples, 1)


# ------------------------------------------------------------------------------------------------- steps
@dataclass(frozen=True)
class Recipe:
    """What a training objective brings to the run: its trainer class and its config (SFT, DPO, ORPO, KTO)."""
    trainer_class: type
    trainer_config: Callable[..., Any]  # (cfg, run, has_validation, resolved=) -> TrainingArguments


def recipe(obj: Objective, run: RunSettings) -> Recipe:
    """objective=sft: TRL's SFTTrainer; dpo, orpo, kto: TRL's preference trainers (reprotune.preference.trainers;
    DPO on packed pairs when the run packs: reprotune.preference.packed); grpo: TRL's GRPOTrainer (reprotune.rl)."""
    if obj.rl:
        from reprotune.rl.trainer import grpo_config, grpo_trainer_class

        return Recipe(trainer_class=checkpoints.sealing_trainer_class(grpo_trainer_class()), trainer_config=grpo_config)
    if obj.preference:
        trainer_class, _ = trl_classes(obj.name)
        trainer_class = reference_keeps_checkpointing(trainer_class)
        if run.packing:  # decide packs DPO's and ORPO's pairs and KTO's rows
            trainer_class = packed_class(trainer_class, obj.name)
        return Recipe(trainer_class=checkpoints.sealing_trainer_class(trainer_class), trainer_config=partial(preference_config, obj=obj))
    from trl import SFTTrainer

    return Recipe(trainer_class=checkpoints.sealing_trainer_class(SFTTrainer), trainer_config=sft_config)


def load_rows(cfg: DictConfig, resolved: Run) -> tuple[list[dict], list[dict]]:
    """The training rows, and the validation split drawn from them when train.eval_steps asks for one."""
    obj, train_file = resolved.objective, resolved.path("prepared") / "train.jsonl"
    if obj.rl:  # prompts and their reference columns; the rewards checked before any weights load
        return rl_rows(cfg, train_file), []
    rows = read_pairs(train_file, obj.name) if obj.preference else read_messages(train_file)
    return split_validation(rows, float(cfg.train.run.val_fraction)) if cfg.train.eval_steps else (rows, [])


def load_tokenizer_for_training(cfg: DictConfig, resolved: Run) -> tuple[str, Any, str | None]:
    """(model directory, tokenizer with the training chat template, the model's own template to ship)."""
    with distributed.main_process_first():
        model_dir = resolve_model_dir(cfg.model, resolved.paths["model_cache"])
    tokenizer = load_tokenizer(model_dir, cfg.model)
    training_chat_template(cfg.model, tokenizer, bool(cfg.train.assistant_only_loss))  # one line if TRL can't patch
    return model_dir, tokenizer, tokenizer.chat_template


def timing_callbacks(cfg: DictConfig, resolved: Run) -> list:
    """The step timer (first: tokens/s without the warm-up), and torch.profiler when hardware.profile_steps asks."""
    profile = [int(x) for x in cfg.hardware.profile_steps] if cfg.hardware.get("profile_steps") else None
    callbacks = [speed.step_timer_callback(stop_before=profile[0] if profile else None)]
    if profile:
        callbacks.append(speed.profiler_callback((profile[0], profile[1]),
                                                 str(resolved.path("train_dir") / "profile.txt")))
    return callbacks


def build_trainer(cfg: DictConfig, resolved: Run, run: RunSettings, model, tokenizer, rows: list[dict],
                  val_rows: list[dict], callbacks: list):
    """The objective's trainer on the rows, with the LoRA config of the method group; stops when the loss mask
    leaves nothing to learn from."""
    from datasets import Dataset

    obj, chosen = resolved.objective, recipe(resolved.objective, run)
    # a model that already holds the starting adapter (objective.init_adapter) trains it; else a fresh one
    from peft import PeftModel

    peft_config = None if isinstance(model, PeftModel) else lora_config(cfg, tokenizer)
    # the reward functions (a user's file imported here, at train's start only), writing paths.rollouts
    extra, rollouts = rewards_for(cfg, resolved) if obj.rl else ({}, None)
    trainer = chosen.trainer_class(model=model, args=chosen.trainer_config(cfg, run, bool(val_rows), resolved=resolved), callbacks=callbacks,
                                train_dataset=Dataset.from_list(rows),
                                eval_dataset=Dataset.from_list(val_rows) if val_rows else None,
                                processing_class=tokenizer, peft_config=peft_config, **extra)
    trainer.rollouts = rollouts
    if obj.rl:
        pass  # the completions are sampled: there is no loss mask to check before the run
    elif obj.preference:
        if not len(trainer.train_dataset):  # TRL drops pairs whose prompt alone fills max_length
            raise ReprotuneError(f"{resolved.path('prepared') / 'train.jsonl'}:1: prompt: every prompt fills "
                                 "objective.max_length: nothing to train on")
    elif assistant_tokens(trainer) == 0:  # TRL drops examples whose labels are all masked
        raise ReprotuneError(f"{cfg.model.training_chat_template}: generation: the loss mask is empty, no assistant "
                             "tokens to learn from (check the {% generation %} block of the training template)")
    trainer.keep_checkpoints = int(cfg.train.save_total_limit) if cfg.train.save_total_limit else None
    trainable, total = trainer.model.get_nb_trainable_parameters()
    log.info("trainable parameters: %d of %d (%.3f%%)", trainable, total, 100 * trainable / total)
    return trainer


def assistant_tokens(trainer) -> int:
    """Tokens the loss is computed on (a preference run: the chosen and rejected answers)."""
    if "labels" not in trainer.train_dataset.column_names:
        return completion_tokens(trainer.train_dataset)
    return sum(sum(1 for t in ex["labels"] if t != -100) for ex in trainer.train_dataset)


def fit(trainer, run: RunSettings, resume_from: str | None) -> float:
    """trainer.train with the fast path's layer changes in place for the run only; the seconds it took."""
    import torch
    from peft.helpers import disable_input_dtype_casting

    from reprotune.fused_lora import fused_lora
    from reprotune.host_embedding import embedding_on_host
    from reprotune.offload_layers import keep_layer_inputs
    from reprotune.tiled_mlp import tiled_mlp
    from reprotune.trainable_tokens import merged_head_view

    if run.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    # Under bf16 autocast PEFT's cast of every adapter input to the fp32 adapter dtype is undone by autocast at
    # once (bf16 -> fp32 -> bf16 is exact): skipping it computes the same numbers without two copies of each
    # activation per adapter (such copies were a large share of an 8B LoRA step's GPU time).
    with (disable_input_dtype_casting(trainer.model, active=run.device == "cuda" and run.dtype != "float32"),
          fused_lora(trainer.model, active=run.fused_lora) as fused_layers,
          merged_head_view(trainer.model),
          embedding_on_host(trainer.model, active=run.embedding_on_host) as host_bytes):
        if host_bytes:
            log.info("input embedding on the host: %.2f GiB of GPU memory freed", host_bytes / 2**30)
        if fused_layers:
            log.info("fused LoRA sum in %d layers", fused_layers)
        apply_liger(trainer.model, active=run.liger, norm=run.norm_kernel)
        with (tiled_mlp(trainer.model, run.tiled_mlp_tokens) as tiled_layers,  # after Liger: it wraps Liger's MLP
              keep_layer_inputs(trainer.model, run.offload_layers if run.activation_offloading else 0) as kept):
            if tiled_layers:
                log.info("MLP over %d-token tiles in %d layers", run.tiled_mlp_tokens, tiled_layers)
            if kept:
                log.info("activation offloading: the first %d layers' inputs to the host, %d layers keep theirs on "
                         "the GPU", run.offload_layers, kept)
            trainer.train(resume_from_checkpoint=resume_from)
    return time.time() - started


def train_metrics(trainer, rows: list[dict], val_rows: list[dict]) -> dict[str, Any]:
    """outputs/train/metrics.json: numbers only (DVC's metrics file), and no timings: deterministic."""
    curve = loss_curves(trainer.state.log_history)["train"]
    trainable, total = trainer.model.get_nb_trainable_parameters()
    return {"global_step": int(trainer.state.global_step), "final_train_loss": curve[-1][1] if curve else math.nan,
            "mean_train_loss": mean_loss(curve), "train_examples": len(rows), "validation_examples": len(val_rows),
            "assistant_tokens": assistant_tokens(trainer), "tokens_seen": int(trainer.state.num_input_tokens_seen),
            "trainable_parameters": trainable, "total_parameters": total,
            **(reward_metrics(trainer.state.log_history) if trainer.rollouts is not None else {})}


def timing_record(trainer, run: RunSettings, timer, n_rows: int, wall: float, train_seconds: float,
                  tokens_before: int) -> dict[str, Any]:
    import torch

    cuda = run.device == "cuda"
    steady = timer.steady_tokens_per_second()
    step_flops = flops.lora_step_flops_per_token(trainer.model.config, mean_example_tokens(trainer.train_dataset, n_rows),
                                                 flops.recomputed_share(trainer.model.config, run),
                                                 tiled_mlp=run.tiled_mlp_tokens > 0)
    trained = int(trainer.state.num_input_tokens_seen) - tokens_before
    return {"wall_seconds": round(wall, 2), "train_seconds": round(train_seconds, 2),
            "tokens_per_second": round(trained / train_seconds, 1) if train_seconds else None,
            "steady_tokens_per_second": round(steady, 1) if steady else None,
            "mfu": round(flops.mfu(steady, step_flops), 4) if steady and cuda else None,
            "flops_per_token": round(step_flops), "step_seconds": timer.step_seconds(),
            "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
            "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
            "pinned_host_gib": pinned_host_gib() if cuda and run.activation_offloading else None}


def pinned_host_gib() -> dict[str, float] | None:
    """torch's caching host allocator (pinned memory, where offloaded activations wait), GiB by key, and this
    process's peak resident memory (pinned pages are resident: what the host must really have)."""
    import resource

    import torch

    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return None
    out = {k: round(v / 2**30, 2) for k, v in stats.items() if "bytes" in k}
    out["process_peak_rss"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30, 2)
    return out


def train_record(cfg: DictConfig, resolved: Run, run: RunSettings, trainer, model_dir: str, resume_from: str | None,
                 adapter_dir: Path, timing: dict[str, Any]) -> dict[str, Any]:
    """outputs/train/manifest.json: provenance, the run's settings, inputs and outputs by sha256, timings."""
    import torch

    from reprotune import manifest as mf

    obj, root, out_dir = resolved.objective, resolved.path("root"), resolved.path("train_dir")
    return mf.stage_record(
        "train", cfg, out_dir / "manifest.json", root,
        seeds=mf.seeds_record(cfg, resolved, data_seed=True),
        determinism={"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                     "fill_uninitialized_memory": bool(torch.utils.deterministic.fill_uninitialized_memory),
                     "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                     "attn_implementation": getattr(trainer.model.config, "_attn_implementation", None)},
        device=run.device, dtype=run.dtype, resumed_from=resume_from,
        inputs={"train_data": mf.path_record(resolved.path("prepared") / "train.jsonl", root),
                "base_model": mf.base_model_record(model_dir)},
        outputs={"adapter": mf.path_record(adapter_dir, root),
                 **{name: mf.path_record(out_dir / f, root) for name, f in
                    (("metrics", "metrics.json"), ("loss_curves", "loss_curves.json"), ("loss_plot", "loss.png"))}},
        timing=timing, run_settings=run.as_record(),
        **({"objective": objective_record(cfg, resolved)} if obj.preference else {}),
        **({"objective": rl_record(cfg, resolved, trainer)} if obj.rl else {}),
        distributed={"world_size": run.world_size, "nnodes": int(os.environ.get("NNODES") or 1),
                     "strategy": run.strategy, "global_batch": run.global_batch})


# ----------------------------------------------------------------------------------------------- recipe
def train(cfg: DictConfig, resolved: Run | None = None) -> dict[str, Any]:
    """setup -> train -> save -> report, on the stage's Run (main's; a caller without one: resolve(cfg, "train"))."""
    from reprotune.manifest import write_json

    started = time.time()
    resolved = resolved if resolved is not None else resolve(cfg, "train")
    obj, device = resolved.objective, resolved.device
    # varying packed lengths fragment the caching allocator (reserved was 2.3x allocated on the H200); expandable
    # segments keep reserved memory close to what is used. Allocation only: the numbers computed are unchanged.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

    # setup: where the math runs, the data, the tokenizer, the one decision of the run's settings, the model
    set_reproducibility(cfg, resolved)
    world = distributed.world()
    distributed.init_process_group(device)
    log.info("device=%s method=%s model=%s processes=%d", device, cfg.method.name, cfg.model.name, world.size)
    # what the adapter records of its base, resolved before any weights load: a mistake here is known at the start
    log.info("base model: %s", base_identity(cfg.model)[0])
    rows, val_rows = load_rows(cfg, resolved)
    model_dir, tokenizer, original_template = load_tokenizer_for_training(cfg, resolved)
    run = preflight(cfg, detect(device), train_shape(cfg, model_dir), resolved)  # reprotune.sizing.decide
    log.info("settings: %s", "; ".join(run.reasons))
    speed.apply_compile_settings(run)
    register_attention(run.attn_implementation)
    model = load_base_model(model_dir, cfg, device, run.dtype, run.attn_implementation)
    if obj.from_adapter:  # objective.init_adapter: the adapter to train further (and, copied, the reference)
        model = with_init_adapter(model, init_adapter_dir(cfg, resolved))
        log.info("objective %s, reference: %s", obj.name, reference(cfg, obj))
    resume_from = checkpoints.prepare_resume(cfg, resolved, world)
    tokens_before = checkpoints.tokens_seen_before(resume_from)  # read now: rotation may remove that checkpoint
    log.info("%s; strategy %s", run.global_batch, run.strategy)
    callbacks = timing_callbacks(cfg, resolved)
    trainer = build_trainer(cfg, resolved, run, model, tokenizer, rows, val_rows, callbacks)

    # train
    train_seconds = fit(trainer, run, resume_from)
    # FSDP2 shards the adapter: every process takes part in gathering it; only rank 0 writes anything
    state_dict = trainer.accelerator.get_state_dict(trainer.model) if run.strategy == "fsdp2" else None
    if not world.is_main:
        distributed.barrier()
        return {}

    # save
    out_dir = resolved.path("train_dir")
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = train_metrics(trainer, rows, val_rows)
    adapter_dir = save_adapter(trainer, tokenizer, cfg, resolved, metrics, original_template, state_dict)
    write_json(out_dir / "metrics.json", metrics)
    write_curves(trainer, out_dir)

    # report
    timing = timing_record(trainer, run, callbacks[0], len(rows), time.time() - started, train_seconds, tokens_before)
    record = train_record(cfg, resolved, run, trainer, model_dir, resume_from, adapter_dir, timing)
    write_json(out_dir / "manifest.json", record)
    if not cfg.train.run.keep_checkpoints:
        shutil.rmtree(resolved.path("checkpoints"), ignore_errors=True)
    log.info("adapter %s (sha256 %s), final loss %.4f, %.1f tokens/s", adapter_dir,
             record["outputs"]["adapter"]["sha256"][:16], metrics["final_train_loss"], timing["tokens_per_second"] or 0)
    distributed.barrier()  # the other ranks wait for the outputs
    return record


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run = resolve(cfg, "train")
        train(cfg, run)


if __name__ == "__main__":
    main()
