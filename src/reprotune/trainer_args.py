"""The TrainingArguments keys reprotune's guarantees rest on, shared by every objective's TRL config (SFTConfig,
DPOConfig, ORPOConfig, KTOConfig): they win over the train/ and objective/ groups. Where checkpoints go and how
they rotate, seeds, precision from hardware, the validation split, nothing sent anywhere unless train.report_to
asks, and the settings fitted by reprotune.sizing.decide (micro-batch, accumulation, checkpointing, strategy).

Reads the config and the run's settings; writes nothing.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from reprotune import distributed
from reprotune.config import library_keys
from reprotune.run import Run, resolve
from reprotune.run_settings import RunSettings

# what reprotune.sizing.decide fits (RunSettings): the trainer gets these from guarantee_keys alone, never as the
# train group wrote them (the fit may re-batch: rows x accumulation kept, the rows changed)
FITTED_KEYS = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")


def passthrough_keys(cfg: DictConfig, group: str) -> dict[str, Any]:
    """A group's keys as the library takes them (reprotune.config.library_keys), less FITTED_KEYS."""
    return {k: v for k, v in library_keys(cfg, group).items() if k not in FITTED_KEYS}


def checkpointing_kwargs(keys: dict[str, Any], run: RunSettings) -> dict[str, Any]:
    """train.activation_checkpointing_kwargs with the fitted every_n_layers (some layers checkpointed, not all)."""
    kwargs = dict(keys.get("activation_checkpointing_kwargs") or {})
    if run.activation_checkpointing and run.checkpoint_every_n_layers > 1:
        kwargs["every_n_layers"] = run.checkpoint_every_n_layers
    return kwargs


def guarantee_keys(cfg: DictConfig, run: RunSettings, keys: dict[str, Any], has_val: bool,
                   resolved: Run | None = None) -> dict[str, Any]:
    """The keys that override `keys` (the groups' own, as they are) in any TRL trainer config; checkpoints go to
    the stage Run's paths.checkpoints (resolved: train's; default: resolve(cfg, "plan")'s, which places nothing:
    the paths are every stage's)."""
    resolved = resolved if resolved is not None else resolve(cfg, "plan")
    eval_steps = keys.get("eval_steps") if keys.get("eval_steps") and has_val else None
    report_to = keys.get("report_to")
    return dict(
        output_dir=resolved.paths["checkpoints"],
        per_device_train_batch_size=run.per_device_train_batch_size,
        per_device_eval_batch_size=run.per_device_train_batch_size,
        gradient_accumulation_steps=run.process_accumulation,
        use_liger_kernel=False,  # Liger is applied by train.apply_liger (TRL deprecates this switch)
        logging_first_step=True,
        save_strategy="steps",
        save_total_limit=None,  # train.save_total_limit is applied after sealing (SealedCheckpointTrainer)
        eval_strategy="steps" if eval_steps else "no",
        eval_steps=eval_steps,
        seed=int(cfg.seed),
        data_seed=int(cfg.seed),
        use_cpu=run.device == "cpu",
        optim=run.optim,
        # TRL's preference configs default bf16 to True: precision is the hardware group's, always said here
        bf16=run.dtype == "bfloat16",
        fp16=run.dtype == "float16",
        activation_checkpointing=run.activation_checkpointing,
        activation_checkpointing_kwargs=checkpointing_kwargs(keys, run),
        report_to=[] if report_to in (None, "none") else report_to,
        push_to_hub=False,
        dataloader_num_workers=run.dataloader_workers,
        dataset_num_proc=None,
        disable_tqdm=False,
        **distributed.trainer_arguments(cfg, run.strategy),
    )
