"""objective=grpo's trainer: TRL's GRPOTrainer (trl.GRPOTrainer, trl.GRPOConfig) with the objective's rewards.

Config: the train/ group's TrainingArguments keys (its SFT-only keys, the SFTConfig fields GRPOConfig lacks, are
left out), then the objective/ group's own keys (GRPOConfig's num_generations, temperature, beta, loss_type,
scale_rewards, reward_weights, max_completion_length, steps_per_generation, ...: they win), then
reprotune.trainer_args.guarantee_keys (they win over both; those GRPOConfig has no field for are left out).

The starting adapter (objective.init_adapter, default the SFT adapter) is loaded trainable by the train stage
(reprotune.preference.trainers.with_init_adapter); with beta != 0 TRL adds a frozen copy named "ref" as the KL
reference (trl/trainer/grpo_trainer.py), with beta 0 (GRPOConfig's default) there is none.

Reads the config and the prepared prompts (data/prompts/train.jsonl); writes paths.rollouts (through the
rewards' Rollouts) and nothing else (the train stage writes the manifest).
"""

from __future__ import annotations

import logging
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from reprotune.config import library_keys
from reprotune.errors import ReprotuneError
from reprotune.io import iter_jsonl
from reprotune.preference.trainers import init_adapter_dir, objective_wins, reference, sft_only_keys
from reprotune.rl.rewards import RewardFunc, Rollouts, check_rewards, file_records, load_rewards, parse_specs
from reprotune.run import Run
from reprotune.run_settings import RunSettings
from reprotune.trainer_args import guarantee_keys, passthrough_keys

log = logging.getLogger("reprotune.train")
# what the manifest records of the sampling (GRPOConfig's names, read from the trainer's args as TRL ran them)
SAMPLING_KEYS = ("num_generations", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "max_completion_length", "generation_batch_size", "steps_per_generation", "num_iterations",
                 "beta", "loss_type", "scale_rewards", "reward_weights", "multi_objective_aggregation", "epsilon")


def trl_classes() -> tuple[type, type]:
    from trl import GRPOConfig, GRPOTrainer

    return GRPOTrainer, GRPOConfig


def grpo_trainer_class() -> type:
    return trl_classes()[0]


def grpo_config(cfg: DictConfig, run: RunSettings, has_val: bool, resolved: Run | None = None):
    """trl.GRPOConfig: train/ keys, then objective/ keys, then reprotune's guarantees (see the module docstring)."""
    _, config_class = trl_classes()
    own_fields = {f.name for f in fields(config_class)}
    skip = sft_only_keys(config_class)
    keys = {k: v for k, v in passthrough_keys(cfg, "train").items() if k not in skip}
    objective = library_keys(cfg, "objective")
    if won := objective_wins(keys, objective):
        log.info("%s: the objective's keys win (docs/configuration.md)", ", ".join(won))
    keys.update(objective)
    keys.update({k: v for k, v in guarantee_keys(cfg, run, keys, has_val, resolved).items() if k in own_fields})
    if keys["activation_checkpointing"]:  # as the preference configs: torch's reentrant checkpoint unless told
        keys["activation_checkpointing_kwargs"] = {"use_reentrant": True, **keys["activation_checkpointing_kwargs"]}
    return config_class(**keys)


def load_prompt_rows(path: Path) -> list[dict[str, Any]]:
    """The prepared prompts train reads; one line when the file holds another chain's rows."""
    rows = []
    for line, row in iter_jsonl(path, "run 'make prepare ARGS=\"objective=grpo\"' first"):
        if not isinstance(row, dict) or "prompt" not in row or {"chosen", "completion"} & set(row):
            kind = "SFT conversations" if isinstance(row, dict) and "messages" in row else "no prompt-only row"
            raise ReprotuneError(f"{path}:{line}: prompt: holds {kind}; prepare prompts with "
                                 "'make prepare ARGS=\"objective=grpo\"'")
        rows.append(row)
    if not rows:
        raise ReprotuneError(f"{path}:1: file: holds no prompts")
    return rows


def rl_rows(cfg: DictConfig, train_file: Path) -> list[dict[str, Any]]:
    """The prepared prompts, after objective.rewards and reward_weights are checked (no user file imported yet)."""
    check_rewards(_plain(cfg.objective.get("rewards")), _plain(cfg.objective.get("reward_weights")))
    return load_prompt_rows(train_file)


def rewards_for(cfg: DictConfig, resolved: Run) -> tuple[dict[str, list[RewardFunc]], Rollouts]:
    """GRPOTrainer's reward_funcs argument: the checked reward functions (users' files imported now: train only),
    recording every batch to paths.rollouts (the main process's; the file starts empty)."""
    from reprotune import distributed

    out = resolved.path("rollouts") if distributed.world().is_main else None
    funcs, specs, rollouts = load_rewards(_plain(cfg.objective.get("rewards")),
                                          _plain(cfg.objective.get("reward_weights")), out)
    log.info("rewards: %s", ", ".join(s.name for s in specs))
    return {"reward_funcs": funcs}, rollouts


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def reward_metrics(log_history: list[dict[str, Any]]) -> dict[str, float]:
    """metrics.json's reward numbers: the weighted reward's first and last logged means and its mean over the run,
    and each reward function's mean over the run (TRL logs `reward` and `rewards/<name>/mean` every logging step)."""
    logged = [h for h in log_history if "reward" in h]
    if not logged:
        return {}
    names = sorted({k for h in logged for k in h if k.startswith("rewards/") and k.endswith("/mean")})
    return {"reward_first": float(logged[0]["reward"]), "reward_last": float(logged[-1]["reward"]),
            "reward_mean": sum(float(h["reward"]) for h in logged) / len(logged),
            **{f"{k.removesuffix('/mean')}_mean": sum(float(h[k]) for h in logged if k in h) /
               sum(1 for h in logged if k in h) for k in names}}


def rl_record(cfg: DictConfig, resolved: Run, trainer: Any) -> dict[str, Any]:
    """The manifest's objective: name, the starting adapter and the reward files by sha256, the sampling as TRL
    ran it, and the rollouts' hash."""
    from reprotune import manifest as mf

    root = resolved.path("root")
    init = init_adapter_dir(cfg, resolved)
    args = trainer.args
    return {"name": resolved.objective.name, "reference": reference(cfg, resolved.objective),
            "init_adapter": mf.path_record(init, root) if init else None,
            "rewards": file_records(parse_specs(_plain(cfg.objective.rewards)), root),
            "sampling": {k: _plain(getattr(args, k, None)) for k in SAMPLING_KEYS},
            "rollouts": mf.path_record(resolved.path("rollouts"), root)}
