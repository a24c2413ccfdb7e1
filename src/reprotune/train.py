"""Train stage: TRL SFTTrainer + PEFT (LoRA, QLoRA, DoRA) on the prepared chat data.

    python -m reprotune.train [hydra overrides]      # == make train ARGS="..."

Reads  data/prepared/train.jsonl and the configured base model.
Writes outputs/adapter/ (adapter, tokenizer, chat template, model card), outputs/train/metrics.json (numbers
       only: DVC's metrics file), outputs/train/loss_curves.json (per-step train/eval loss),
       outputs/train/loss.png and outputs/train/manifest.json. Checkpoints go to outputs/checkpoints/ and
       an interrupted run resumes from the last one (train.run.resume=auto).

Read top to bottom: settings -> data -> model -> trainer -> train -> save -> report.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from reprotune import distributed, speed
from reprotune.config import CONF_DIR, library_keys, quantization
from reprotune.errors import ReprotuneError, needs_bytes, tensor_bytes, user_errors
from reprotune.io import content_key, key_fraction, read_examples, save_figure, swap_dir, tmp_path
from reprotune.models import load_base_model, load_tokenizer, resolve_model_dir, training_chat_template
from reprotune.runtime import resolve_device, set_reproducibility
from reprotune.sizing.decide import RunSettings, detect
from reprotune.sizing.preflight import preflight, train_shape

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
    def pick(row: dict) -> bool:
        return key_fraction(content_key(row["messages"], ensure_ascii=True)) < fraction

    val = [r for r in rows if pick(r)]
    return [r for r in rows if not pick(r)], val


# ------------------------------------------------------------------------------------------------ model
# reprotune's own keys in the method and train groups; every other key is the library's and passes through whole
METHOD_OWN = ("name", "quantization")
TRAIN_OWN = ("run",)


def lora_config(cfg: DictConfig):
    """peft.LoraConfig from the method group as it is (target_modules null: the model preset's)."""
    from peft import LoraConfig

    keys = library_keys(cfg.method, METHOD_OWN)
    if keys.get("target_modules") is None:
        keys["target_modules"] = OmegaConf.to_container(cfg.model.lora_target_modules, resolve=True) \
            if OmegaConf.is_config(cfg.model.lora_target_modules) else cfg.model.lora_target_modules
    return LoraConfig(task_type="CAUSAL_LM", **keys)


# ---------------------------------------------------------------------------------------------- trainer
def sft_config(cfg: DictConfig, run: RunSettings, has_val: bool):
    """trl.SFTConfig from the train group as it is, plus the settings reprotune's guarantees rest on, which
    win over the group: where checkpoints go and how they rotate, seeds, precision from hardware, the
    validation split, nothing sent anywhere unless train.report_to asks, and the speed settings fitted by
    reprotune.sizing.decide (micro-batch, accumulation, packing, checkpointing, precision, strategy)."""
    from trl import SFTConfig

    keys = library_keys(cfg.train, TRAIN_OWN)
    eval_steps = keys.get("eval_steps") if keys.get("eval_steps") and has_val else None
    report_to = keys.get("report_to")
    keys.update(
        output_dir=cfg.paths.checkpoints,
        per_device_train_batch_size=run.per_device_train_batch_size,
        per_device_eval_batch_size=run.per_device_train_batch_size,
        gradient_accumulation_steps=run.process_accumulation,
        packing=run.packing,
        packing_strategy="bfd",  # best-fit decreasing, padding-free: position ids restart per example
        use_liger_kernel=False,  # Liger is applied by apply_liger (TRL deprecates this switch)
        chat_template_path=cfg.model.training_chat_template,
        logging_first_step=True,
        save_strategy="steps",
        save_total_limit=None,  # train.save_total_limit is applied after sealing (SealedCheckpointTrainer)
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        seed=int(cfg.seed),
        data_seed=int(cfg.seed),
        use_cpu=run.device == "cpu",
        bf16=run.dtype == "bfloat16",
        fp16=run.dtype == "float16",
        activation_checkpointing=run.activation_checkpointing,
        activation_checkpointing_kwargs=checkpointing_kwargs(keys, run),
        report_to=[] if report_to in (None, "none") else report_to,
        push_to_hub=False,
        dataloader_num_workers=0,
        dataset_num_proc=None,
        # packed batches hold no padding; unpacked ones are counted without it (pad is often eos)
        include_num_input_tokens_seen="all" if run.packing else "non_padding",
        disable_tqdm=False,
        **distributed.trainer_arguments(cfg, run.strategy),
    )
    return SFTConfig(**keys)


def apply_liger(model, active: bool) -> None:
    """Liger's layer kernels (RMSNorm, SwiGLU, RoPE) on the model, exactly what TRL 1.16's use_liger_kernel=True
    makes the Trainer do at the start of train(): transformers' apply_liger_kernel with the fused linear
    cross-entropy off (it would replace the forward that computes the loss). Called here because TRL deprecates
    that switch for Hub kernels (model_init_kwargs={"use_kernels": True}), which need the `kernels` package and
    a Hub download: neither is in the lock nor offline."""
    if not active:
        return
    from transformers.integrations.liger import apply_liger_kernel

    apply_liger_kernel(model, {"fused_linear_cross_entropy": False})


def checkpointing_kwargs(keys: dict[str, Any], run: RunSettings) -> dict[str, Any]:
    """train.activation_checkpointing_kwargs with the fitted every_n_layers (some layers checkpointed, not all)."""
    kwargs = dict(keys.get("activation_checkpointing_kwargs") or {})
    if run.activation_checkpointing and run.checkpoint_every_n_layers > 1:
        kwargs["every_n_layers"] = run.checkpoint_every_n_layers
    return kwargs


def config_fingerprint(cfg: DictConfig) -> str:
    """What a checkpoint must match to be resumed: everything that shapes training (not paths)."""
    keep = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "method", "data", "train")}
    keep["seed"] = cfg.seed
    keep["repro"] = cfg.repro
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------ checkpoints
# HF Trainer writes checkpoint-N/ file by file; a kill -9 (or a pod eviction) mid-write leaves a torn
# folder that get_last_checkpoint would happily resume from. We seal each checkpoint once the Trainer has
# written it: fsync every file, then atomically write a marker listing every file's sha256. Only sealed
# checkpoints whose files still match their marker are resumed; anything else is removed. Rotation
# (save_total_limit) is ours too, and runs only after the new checkpoint is sealed, so a crash at any
# moment leaves at least the previous good checkpoint on disk.
CHECKPOINT_SEAL = "reprotune-sealed.json"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_checkpoint(folder: Path, step: int) -> None:
    """Make a fully written checkpoint folder resumable (atomic: the seal appears last, all at once)."""
    from reprotune.manifest import sha256_tree

    files = sha256_tree(folder, exclude=[CHECKPOINT_SEAL])
    for rel in files:
        _fsync(folder / rel)
    tmp = folder / (CHECKPOINT_SEAL + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1, sort_keys=True))
    _fsync(tmp)
    os.replace(tmp, folder / CHECKPOINT_SEAL)
    _fsync(folder)


def is_sealed(folder: Path) -> bool:
    """True when the folder holds a seal and every file it lists is present with the same sha256."""
    from reprotune.manifest import sha256_file

    seal = folder / CHECKPOINT_SEAL
    try:
        files = json.loads(seal.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return bool(files) and all((folder / rel).is_file() and sha256_file(folder / rel) == digest
                               for rel, digest in files.items())


def _checkpoint_step(folder: Path) -> int:
    return int(folder.name.rsplit("-", 1)[1]) if folder.name.rsplit("-", 1)[-1].isdigit() else -1


def good_checkpoints(ckpt_root: Path, remove_torn: bool = True) -> list[Path]:
    """Sealed checkpoints, oldest first; torn ones (no seal, or files that changed) are removed."""
    good = []
    for folder in sorted(ckpt_root.glob("checkpoint-*"), key=_checkpoint_step):
        if folder.is_dir() and _checkpoint_step(folder) >= 0 and is_sealed(folder):
            good.append(folder)
        elif remove_torn:
            log.warning("removing torn checkpoint %s (interrupted while being written)", folder)
            shutil.rmtree(folder, ignore_errors=True)
    return good


def sealing_trainer_class():
    """SFTTrainer whose checkpoints are sealed (see above) and rotated only after sealing."""
    from trl import SFTTrainer

    class SealedCheckpointTrainer(SFTTrainer):
        keep_checkpoints: int | None = None

        def _save_checkpoint(self, model, trial) -> None:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every rank has written its RNG state before rank 0 seals
            if not self.args.should_save:
                return
            ckpt_root = Path(self.args.output_dir)
            seal_checkpoint(ckpt_root / f"checkpoint-{self.state.global_step}", self.state.global_step)
            if self.keep_checkpoints:
                for old in good_checkpoints(ckpt_root)[:-self.keep_checkpoints]:
                    shutil.rmtree(old, ignore_errors=True)

    return SealedCheckpointTrainer


def checkpoint_to_resume(cfg: DictConfig, fingerprint: str, modify: bool = True) -> str | None:
    """The last sealed checkpoint of this same configuration, or None (stale or torn ones are removed, by the
    process that may modify the folder: rank 0 when several train together)."""
    ckpt_root = Path(cfg.paths.checkpoints)
    stamp = ckpt_root / "reprotune-run.json"
    if cfg.train.run.resume == "never" or not ckpt_root.is_dir():
        if modify:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        return None
    recorded = json.loads(stamp.read_text()).get("fingerprint") if stamp.is_file() else None
    if recorded != fingerprint:
        log.info("discarding checkpoints of a different configuration in %s", ckpt_root)
        if modify:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        return None
    good = good_checkpoints(ckpt_root, remove_torn=modify)
    if good:
        log.info("resuming from %s", good[-1])
        return str(good[-1])
    return None


def mean_example_tokens(dataset, n_examples: int) -> float:
    """Mean tokens per training example (packed rows hold several)."""
    total = sum(len(ids) for ids in dataset["input_ids"])
    return total / max(n_examples, 1)


# ----------------------------------------------------------------------------------------------- report
def loss_curves(log_history: list[dict]) -> dict[str, list]:
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h]
    return {"train": train, "eval": evals}


def mean_loss(curve: list[tuple[int, float]]) -> float:
    """Mean per-step loss from the logged curve (each point averages the steps since the previous one).

    Computed from the log history, which a resumed run restores from its checkpoint, so a resumed run
    reports exactly what an uninterrupted one does (the Trainer's own training_loss only covers the
    steps since the resume).
    """
    total, previous = 0.0, 0
    for step, loss in curve:
        total += loss * (step - previous)
        previous = step
    return total / previous if previous else math.nan


def plot_loss(curves: dict[str, list], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    if curves["train"]:
        ax.plot(*zip(*curves["train"], strict=True), label="train loss", marker=".")
    if curves["eval"]:
        ax.plot(*zip(*curves["eval"], strict=True), label="eval loss (validation split of train)", marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (assistant tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out)
    plt.close(fig)


def write_model_card(adapter_dir: Path, cfg: DictConfig, metrics: dict) -> None:
    from reprotune.models import base_identity

    base, revision = base_identity(cfg.model)  # never model.path: a host's directory would change the bytes
    text = f"""# reprotune adapter: {cfg.model.name} + {cfg.method.name} on {cfg.data.name}

- Base model: `{cfg.model.name}` ({cfg.model.source}: `{base}`{f' at revision `{revision}`' if revision else ''})
- Method: {cfg.method.name} (r={cfg.method.r}, alpha={cfg.method.lora_alpha}, dora={cfg.method.use_dora}, 4-bit base={bool((quantization(cfg) or {}).get('load_in_4bit'))})
- Data: `{cfg.data.name}` ({metrics['train_examples']} training examples; private={cfg.data.private})
- Steps: {metrics['global_step']}, final train loss {metrics['final_train_loss']:.4f}, seed {cfg.seed}
- Produced by `make train`; the full provenance is in `outputs/train/manifest.json`.

Load with PEFT on the base: `reprotune.models.load_peft_model("outputs/adapter", "<cache>/models")` (adapter_config.json
names the base by a stable identity, not a path: a hub id, `builtin:`, `random_init:` or `local:`).
{"This adapter was trained on private data: do not publish it." if cfg.data.private else ""}
"""
    (adapter_dir / "README.md").write_text(text)


def canonicalise_adapter_config(adapter_dir: Path, base: tuple[str, str | None]) -> None:
    """Same run, same bytes on any host: PEFT stores target_modules from a Python set (its order follows the
    per-process string hash seed), so sort it; and it records the base by the path it was loaded from (a
    host's cache location), so name the base by its stable identity instead (reprotune.models.base_identity;
    reprotune.models.resolve_base_identity maps it back to the local directory)."""
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    for key in ("target_modules", "modules_to_save", "exclude_modules"):
        if isinstance(config.get(key), list):
            config[key] = sorted(config[key])
    config["base_model_name_or_path"], config["revision"] = base
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_adapter_weights(model, folder: Path, state_dict: dict | None = None) -> None:
    """PEFT's save of the adapter; its size is known before the write, so a full disk says how much it needed."""
    from peft import get_peft_model_state_dict

    with needs_bytes(tensor_bytes(get_peft_model_state_dict(model, state_dict=state_dict).values())):
        model.save_pretrained(folder, **({"state_dict": state_dict} if state_dict is not None else {}))


def save_adapter(trainer, tokenizer, cfg: DictConfig, metrics: dict, original_template: str | None,
                 state_dict: dict | None = None) -> Path:
    """Save to a temp dir, then swap it in: a crash never leaves a half-written outputs/adapter."""
    final = Path(cfg.paths.adapter)
    tmp = tmp_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    from reprotune.models import base_identity

    save_adapter_weights(trainer.model, tmp, state_dict)
    canonicalise_adapter_config(tmp, base_identity(cfg.model))
    # Ship the model's own chat template (same rendering as the training one, without the loss markers,
    # which inference engines such as llama.cpp do not understand).
    tokenizer.chat_template = original_template
    tokenizer.save_pretrained(tmp)
    write_model_card(tmp, cfg, metrics)
    swap_dir(tmp, final)
    return final


# ------------------------------------------------------------------------------------------------- main
def train(cfg: DictConfig) -> dict[str, Any]:
    import torch
    from datasets import Dataset

    from reprotune import manifest as mf

    started = time.time()
    # varying packed lengths fragment the caching allocator (reserved was 2.3x allocated on the H200); expandable
    # segments keep reserved memory close to what is used. Allocation only: the numbers computed are unchanged.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    device = resolve_device(cfg)
    set_reproducibility(cfg, device)
    world = distributed.world()
    distributed.init_process_group(device)
    log.info("device=%s method=%s model=%s processes=%d", device, cfg.method.name, cfg.model.name, world.size)

    train_file = Path(cfg.paths.prepared) / "train.jsonl"
    rows = read_messages(train_file)
    val_rows: list[dict] = []
    if cfg.train.eval_steps:
        rows, val_rows = split_validation(rows, float(cfg.train.run.val_fraction))

    with distributed.main_process_first():
        model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    training_chat_template(cfg.model, tokenizer, bool(cfg.train.assistant_only_loss))  # one line if TRL can't patch
    original_template = tokenizer.chat_template
    run = preflight(cfg, detect(device), train_shape(cfg, model_dir))  # one decision: reprotune.sizing.decide
    log.info("settings: %s", "; ".join(run.reasons))
    speed.apply_compile_settings(run)
    model = load_base_model(model_dir, cfg, device, run.dtype, run.attn_implementation)

    fingerprint = config_fingerprint(cfg)
    with distributed.main_process_first():
        resume_from = checkpoint_to_resume(cfg, fingerprint, modify=world.is_main)
        if world.is_main:
            Path(cfg.paths.checkpoints).mkdir(parents=True, exist_ok=True)
            mf.write_json(Path(cfg.paths.checkpoints) / "reprotune-run.json", {"fingerprint": fingerprint})
    log.info("%s; strategy %s", run.global_batch, run.strategy)

    profile = [int(x) for x in cfg.hardware.profile_steps] if cfg.hardware.get("profile_steps") else None
    timer = speed.step_timer_callback(stop_before=profile[0] if profile else None)
    callbacks = [timer]
    if profile:
        first, last = profile
        callbacks.append(speed.profiler_callback((first, last), str(Path(cfg.paths.train_dir) / "profile.txt")))
    trainer = sealing_trainer_class()(
        model=model,
        args=sft_config(cfg, run, bool(val_rows)),
        callbacks=callbacks,
        train_dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(val_rows) if val_rows else None,
        processing_class=tokenizer,
        peft_config=lora_config(cfg),
    )
    # TRL drops examples whose labels are all masked; count what is left to learn from.
    masked = sum(sum(1 for t in ex["labels"] if t != -100) for ex in trainer.train_dataset)
    if masked == 0:
        raise ReprotuneError(f"{cfg.model.training_chat_template}: generation: the loss mask is empty, no assistant "
                             "tokens to learn from (check the {% generation %} block of the training template)")
    trainer.keep_checkpoints = int(cfg.train.save_total_limit) if cfg.train.save_total_limit else None
    trainable, total = trainer.model.get_nb_trainable_parameters()
    log.info("trainable parameters: %d of %d (%.3f%%)", trainable, total, 100 * trainable / total)

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    tokens_before = 0  # tokens/s covers what this process trained, also after a resume
    if resume_from and (Path(resume_from) / "trainer_state.json").is_file():
        tokens_before = int(json.loads((Path(resume_from) / "trainer_state.json").read_text())
                            .get("num_input_tokens_seen", 0))
    train_started = time.time()
    # Under bf16 autocast PEFT's cast of every adapter input to the fp32 adapter dtype is undone by autocast at
    # once (bf16 -> fp32 -> bf16 is exact): skipping it computes the same numbers without two copies of each
    # activation per adapter (16% of the GPU time of an 8B LoRA step on the H200 went to such copies).
    from peft.helpers import disable_input_dtype_casting

    from reprotune.fused_lora import fused_lora

    with (disable_input_dtype_casting(trainer.model, active=device == "cuda" and run.dtype != "float32"),
          fused_lora(trainer.model, active=run.fused_lora) as fused_layers):
        if fused_layers:
            log.info("fused LoRA sum in %d layers", fused_layers)
        apply_liger(trainer.model, active=run.liger)
        trainer.train(resume_from_checkpoint=resume_from)
    train_seconds = time.time() - train_started
    # FSDP2 shards the adapter: every process takes part in gathering it; only rank 0 writes anything
    state_dict = (trainer.accelerator.get_state_dict(trainer.model)
                  if run.strategy == "fsdp2" else None)
    if not world.is_main:
        distributed.barrier()
        return {}

    curves = loss_curves(trainer.state.log_history)
    tokens_seen = int(trainer.state.num_input_tokens_seen)
    steady = timer.steady_tokens_per_second()
    step_flops = speed.lora_step_flops_per_token(trainer.model.config, mean_example_tokens(trainer.train_dataset, len(rows)),
                                                 speed.recomputed_share(trainer.model.config, run))
    metrics = {
        "global_step": int(trainer.state.global_step),
        "final_train_loss": curves["train"][-1][1] if curves["train"] else math.nan,
        "mean_train_loss": mean_loss(curves["train"]),
        "train_examples": len(rows),
        "validation_examples": len(val_rows),
        "assistant_tokens": masked,
        "tokens_seen": tokens_seen,
        "trainable_parameters": trainable,
        "total_parameters": total,
    }
    out_dir = Path(cfg.paths.train_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    adapter_dir = save_adapter(trainer, tokenizer, cfg, metrics, original_template, state_dict)
    mf.write_json(out_dir / "metrics.json", metrics)  # numbers only (DVC's metrics file); no timings: deterministic
    # [[step, loss], ...] per split: an output, not a metric (dvc metrics diff compares the final and mean loss)
    mf.write_json(out_dir / "loss_curves.json", {"train": curves["train"], "eval": curves["eval"]})
    plot_loss(curves, out_dir / "loss.png")

    root = Path(cfg.paths.root)
    record = mf.base_manifest("train", OmegaConf.to_container(cfg, resolve=True))
    model_files = mf.sha256_tree(Path(model_dir)) if Path(model_dir).is_dir() else {}
    record.update({
        "manifest_path": os.path.relpath(out_dir / "manifest.json", root),
        "seeds": {"seed": int(cfg.seed), "data_seed": int(cfg.seed), "repro": cfg.repro},
        "determinism": {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                        "attn_implementation": getattr(trainer.model.config, "_attn_implementation", None)},
        "device": device,
        "dtype": run.dtype,
        "resumed_from": resume_from,
        "inputs": {"train_data": mf.path_record(train_file, root),
                   # outside the run (a shared cache): an absolute path, used in place by 'make verify'
                   "base_model": {"path": str(Path(model_dir).resolve()), "sha256": mf.tree_digest(model_files),
                                  "files": model_files}},
        "outputs": {"adapter": mf.path_record(adapter_dir, root),
                    "metrics": mf.path_record(out_dir / "metrics.json", root),
                    "loss_curves": mf.path_record(out_dir / "loss_curves.json", root),
                    "loss_plot": mf.path_record(out_dir / "loss.png", root)},
        "timing": {"wall_seconds": round(time.time() - started, 2), "train_seconds": round(train_seconds, 2),
                   "tokens_per_second": round((tokens_seen - tokens_before) / train_seconds, 1)
                   if train_seconds else None,
                   "steady_tokens_per_second": round(steady, 1) if steady else None,
                   "mfu": round(speed.mfu(steady, step_flops), 4) if steady and device == "cuda" else None,
                   "flops_per_token": round(step_flops),
                   "step_seconds": timer.step_seconds(),
                   "peak_gpu_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)
                   if device == "cuda" else None,
                   "peak_gpu_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)
                   if device == "cuda" else None},
        "run_settings": run.as_record(),
        "distributed": {"world_size": world.size, "nnodes": int(os.environ.get("NNODES") or 1),
                        "strategy": run.strategy, "global_batch": run.global_batch},
    })
    mf.write_json(out_dir / "manifest.json", record)
    if not cfg.train.run.keep_checkpoints:
        shutil.rmtree(cfg.paths.checkpoints, ignore_errors=True)
    log.info("adapter %s (sha256 %s), final loss %.4f, %.1f tokens/s", adapter_dir,
             record["outputs"]["adapter"]["sha256"][:16], metrics["final_train_loss"],
             record["timing"]["tokens_per_second"] or 0)
    distributed.barrier()  # the other ranks wait for the outputs
    return record


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        train(cfg)


if __name__ == "__main__":
    main()
