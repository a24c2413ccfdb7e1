"""The micro-batches a preference run will draw, known before it starts: the Trainer's order is accelerate's
SeedableRandomSampler (a permutation of the rows seeded by data_seed + epoch), cut into batches by torch's
BatchSampler and dealt to the processes by accelerate's BatchSamplerShard. Packed pairs fill a micro-batch with
exactly their own tokens, so the largest micro-batch of the run is a number, not a bound: the plan sizes memory
for it instead of B copies of the longest pair (8 pairs of the bench: 9,125 tokens drawn against 13,344).

Used only where the order is that one: the default sampling strategy with the seedable sampler, no validation
split taken out of train, and no pair TRL could drop or truncate (the objective's max_length at least the
prepared one); otherwise the plan keeps the longest-pair bound."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from reprotune.preference import PAIR_LENGTHS_FILE


def read_pair_lengths(prepared: Path | str) -> list[int] | None:
    """Each training pair's packed tokens in train.jsonl's order (prepare's train_lengths.json), or None: pairs
    prepared before prepare wrote them, or a file that does not match train.jsonl's rows."""
    path = Path(prepared) / PAIR_LENGTHS_FILE
    if not path.is_file():
        return None
    lengths = [int(n) for n in json.loads(path.read_text())["packed_pair_tokens"]]
    with open(Path(prepared) / "train.jsonl", encoding="utf-8") as fh:
        rows = sum(1 for line in fh if line.strip())
    return lengths if len(lengths) == rows else None


def run_keys(cfg: DictConfig) -> dict[str, Any]:
    """The TrainingArguments keys that fix the order and the length of a preference run, as the trainer gets them
    (the objective group's keys win over the train group's; reprotune sets both seeds to cfg.seed)."""
    def key(name: str, default: Any) -> Any:
        value = cfg.objective.get(name)
        return cfg.train.get(name, default) if value is None else value

    accel = cfg.train.get("accelerator_config") or {}
    return {"seed": int(cfg.seed), "max_steps": int(key("max_steps", -1)),
            "num_train_epochs": float(key("num_train_epochs", 1.0)),
            "drop_last": bool(key("dataloader_drop_last", False)),
            "strategy": str(key("train_sampling_strategy", "random")),
            "seedable": bool(accel.get("use_seedable_sampler", True)),
            "keep_global_batch": bool(cfg.hardware.get("keep_global_batch", True))}


def order_is_known(cfg: DictConfig, prepared_max_length: int | None) -> bool:
    """The trainer draws its batches from the seeded permutation of every prepared row."""
    keys = run_keys(cfg)
    objective_max = cfg.objective.get("max_length")
    keeps_every_row = (prepared_max_length is not None and objective_max is not None
                       and int(objective_max) >= int(prepared_max_length))
    return (keys["strategy"] == "random" and keys["seedable"] and not cfg.train.get("eval_steps")
            and keeps_every_row)


def longest_drawn(lengths: list[int], batch_sizes: list[int], global_batch: int, keys: dict[str, Any],
                  world_size: int = 1) -> dict[int, int]:
    """For each batch size B (global_batch = B x accumulation: the configured rows x accumulation, which the fit
    keeps): the most tokens any micro-batch of the run holds, over every process and every micro-batch its steps
    take."""
    return {b: max((sum(lengths[i] for i in batch)
                    for batch in drawn_micro_batches(len(lengths), b, global_batch // b, keys, world_size)), default=0)
            for b in batch_sizes}


def drawn_micro_batches(n: int, b: int, accum: int, keys: dict[str, Any], world_size: int = 1) -> list[list[int]]:
    """The row indices of every micro-batch a run of n rows takes, B rows each, accum micro-batches a step
    (divided among world_size processes as reprotune.distributed.global_batch does), in the order the Trainer
    takes them (each epoch: accelerate's SeedableRandomSampler at data_seed + epoch, torch's BatchSampler, and
    with several processes accelerate's BatchSamplerShard; process 0's micro-batches, then process 1's, ...)."""
    from accelerate.data_loader import BatchSamplerShard, SeedableRandomSampler
    from torch.utils.data import BatchSampler

    per_step = _accumulation(accum, world_size, keys["keep_global_batch"])
    sampler = SeedableRandomSampler(range(n), data_seed=keys["seed"])
    left, out = _steps(n, b, per_step, world_size, keys), []
    epoch = 0
    while left > 0:
        sampler.set_epoch(epoch)  # what the Trainer does at the start of each epoch
        batches = BatchSampler(list(sampler), b, keys["drop_last"])
        shards = ([list(batches)] if world_size == 1 else
                  [list(BatchSamplerShard(batches, world_size, i, split_batches=False, even_batches=True))
                   for i in range(world_size)])
        if not shards[0]:  # drop_last with fewer rows than a batch: the trainer takes no micro-batch at all
            break
        steps = min(left, math.ceil(len(shards[0]) / per_step))  # an epoch's last step may take fewer
        for shard in shards:
            out.extend(shard[:steps * per_step])
        left -= steps
        epoch += 1
    return out


def _accumulation(accum: int, world_size: int, keep_global_batch: bool) -> int:
    """Each process's accumulation (reprotune.distributed.global_batch: divided among the processes where it
    divides and the global batch is kept, else each process accumulates all of it)."""
    return accum // world_size if keep_global_batch and accum % world_size == 0 else accum


def _batches_per_process(n: int, b: int, world_size: int, drop_last: bool) -> int:
    batches = n // b if drop_last else math.ceil(n / b)
    return batches // world_size if drop_last else math.ceil(batches / world_size)


def _steps(n: int, b: int, accum: int, world_size: int, keys: dict[str, Any]) -> int:
    """Optimizer steps of the run: max_steps, else num_train_epochs of them (the last one partial)."""
    if keys["max_steps"] > 0:
        return keys["max_steps"]
    per_epoch = math.ceil(_batches_per_process(n, b, world_size, keys["drop_last"]) / accum)
    return math.ceil(per_epoch * keys["num_train_epochs"])


def drawn_batch_tokens(cfg: DictConfig, prepared: Path | str, prepared_max_length: int | None, global_batch: int,
                       world_size: int = 1) -> tuple[tuple[int, int], ...]:
    """((B, the largest micro-batch's packed tokens), ...) for every B that divides the global batch, or ()
    where the run's order is not known before it starts (the plan then bounds a micro-batch by its longest
    pairs)."""
    if not order_is_known(cfg, prepared_max_length):
        return ()
    lengths = read_pair_lengths(prepared)
    if not lengths:
        return ()
    sizes = [b for b in range(1, global_batch + 1) if global_batch % b == 0]  # what the fit may pick
    found = {b: t for b, t in longest_drawn(lengths, sizes, global_batch, run_keys(cfg), world_size).items() if t}
    return tuple(sorted(found.items()))
