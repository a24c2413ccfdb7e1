"""The micro-batches a preference run will draw, known before it starts (reprotune.sizing.draws): the plan sizes
memory for the largest one instead of B copies of the longest pair. Checked against the training loop itself: a
real TRL DPO run on the CPU (tiny Qwen3, packed pairs as on a GPU) takes exactly the predicted micro-batches, in
order, across epochs with a short last batch, and each packed micro-batch holds exactly the tokens prepare
recorded for its pairs."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.invoices import generate, wrong_extraction
from reprotune.preference import PAIR_LENGTHS_FILE
from reprotune.preference.pairs import lengths_bytes, sequence_lengths
from reprotune.sizing import draws
from reprotune.sizing import memory as sz_memory
from reprotune.sizing.decide import Hardware, decide
from reprotune.sizing.shape import load_table

GIB = 2**30
N_PAIRS = 11  # B = 2: every epoch ends on a short batch of one pair


def unique_pairs(n: int) -> list[dict]:
    """Built-in invoice pairs, each prompt marked with its index (the recorded batches name their rows)."""
    rows = []
    for i, ex in enumerate(generate(n, seed=3)):
        *prompt, answer = ex["messages"]
        prompt[-1] = {**prompt[-1], "content": f"[row {i}] " + prompt[-1]["content"]}
        wrong = wrong_extraction(answer["content"], random.Random(i))
        rows.append({"prompt": prompt, "chosen": [answer], "rejected": [{"role": "assistant", "content": wrong}]})
    return rows


@pytest.mark.slow  # full lane: a real TRL DPO run of 7 steps on the CPU
def test_the_drawn_micro_batches_are_the_ones_training_takes(tmp_path: Path) -> None:
    from datasets import Dataset

    from reprotune.models import load_base_model, load_tokenizer, resolve_model_dir
    from reprotune.preference import packed
    from reprotune.preference.trainers import preference_config, trl_classes
    from reprotune.run import resolve
    from reprotune.train import lora_config

    steps = 7  # 6 micro-batches an epoch, 3 steps: epochs 0, 1 and the first step of 2
    cfg = compose(["model=tiny_random_qwen3", "hardware=cpu", f"paths.root={tmp_path}", "objective=dpo",
                   "train.packing=true", "train.per_device_train_batch_size=2", "train.gradient_accumulation_steps=2",
                   f"objective.max_steps={steps}", "train.logging_steps=100", "train.save_steps=100000"])
    run = decide(cfg, Hardware("cpu"), None, None)
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    tokenizer = load_tokenizer(model_dir, cfg.model)
    packed.register_pair_attention(run.attn_implementation)
    model = load_base_model(model_dir, cfg, "cpu", "float32", run.attn_implementation)
    trainer_class = packed.packed_class(trl_classes("dpo")[0], "dpo")
    rows = unique_pairs(N_PAIRS)
    trainer = trainer_class(model=model, args=preference_config(cfg, run, False, resolve(cfg, "params").objective), processing_class=tokenizer,
                            train_dataset=Dataset.from_list(rows), peft_config=lora_config(cfg, tokenizer))
    marks = [tokenizer(f"[row {i}]", add_special_tokens=False)["input_ids"] for i in range(N_PAIRS)]

    def row_of(example: dict) -> int:
        ids = example["prompt_ids"]
        found = [i for i, m in enumerate(marks)
                 if any(ids[k:k + len(m)] == m for k in range(len(ids) - len(m) + 1))]
        assert len(found) == 1, found
        return found[0]

    taken: list[list[int]] = []
    packed_tokens: list[int] = []
    collate = trainer.data_collator

    def recording(examples: list[dict]) -> dict:
        batch = collate(examples)
        taken.append([row_of(e) for e in examples])
        packed_tokens.append(int(batch["packed"].input_ids.shape[1]))
        return batch

    trainer.data_collator = recording
    trainer.train()
    assert trainer.state.global_step == steps

    keys = draws.run_keys(cfg)
    assert (keys["seed"], keys["max_steps"]) == (int(cfg.seed), steps)
    predicted = draws.drawn_micro_batches(N_PAIRS, 2, 2, keys)
    # the DataLoader may collate one micro-batch ahead of the step that takes it: the taken ones are the first
    assert len(predicted) == 2 * steps and taken[:len(predicted)] == predicted
    assert {len(b) for b in predicted} == {1, 2}  # the short last batch of an epoch is a micro-batch of its own
    assert len({tuple(b) for b in predicted}) > 6  # epochs are drawn in other orders (seed + epoch)
    # prepare's lengths: each micro-batch packed holds exactly its pairs' recorded tokens
    lengths = [sequence_lengths(tokenizer, row)[1] for row in rows]
    assert packed_tokens[:len(predicted)] == [sum(lengths[i] for i in b) for b in predicted]
    assert draws.longest_drawn(lengths, [2], 4, keys) == {2: max(packed_tokens[:len(predicted)])}


def test_several_processes_draw_every_micro_batch_once_between_them() -> None:
    keys = {"seed": 42, "max_steps": 3, "num_train_epochs": 1.0, "drop_last": False, "strategy": "random",
            "seedable": True, "keep_global_batch": True}
    one = draws.drawn_micro_batches(32, 2, 4, keys)
    two = draws.drawn_micro_batches(32, 2, 4, keys, world_size=2)
    # the global batch kept: two processes each take 2 of the 4 micro-batches of a step, the same 12 in all
    assert len(one) == len(two) == 12
    assert sorted(map(tuple, one)) == sorted(map(tuple, two))
    # with the global batch multiplied each process accumulates all 4 of its 8 batches an epoch: two steps of
    # epoch 0 (16 micro-batches between them) and one of epoch 1 (8)
    assert len(draws.drawn_micro_batches(32, 2, 4, keys | {"keep_global_batch": False}, world_size=2)) == 24


# ------------------------------------------------------------------------------------------------ the plan
def write_bench_like_pairs(root: Path, lengths: list[int]) -> Path:
    """data/pairs as prepare writes it, with these packed pair lengths (train.jsonl's rows in that order)."""
    folder = root / "data" / "pairs"
    folder.mkdir(parents=True, exist_ok=True)
    row = {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
           "rejected": [{"role": "assistant", "content": "b"}]}
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for _ in lengths))
    dist = {"n": len(lengths), "min": min(lengths), "max": max(lengths), "mean": sum(lengths) / len(lengths),
            "total": sum(lengths)}
    report = {"objective": "dpo", "max_length": 2048,
              "pairs": {"overlong": {"policy": "drop", "dropped": 0}, "train": len(lengths), "paired": True},
              "tokens": {"model": "qwen3_8b_random", "longest_sequence_of_pair": True,
                         "train": {**dist, "max": 1200, "mean": dist["mean"] * 0.7},
                         "packed_pair_train": dist, "answer_share_train": 0.4}}
    (folder / "report.json").write_text(json.dumps(report))
    (folder / PAIR_LENGTHS_FILE).write_bytes(lengths_bytes(lengths))
    return folder


def bench_lengths() -> list[int]:
    """400 pairs shaped like bench/dpo_recipe.py's (mean ~940 packed tokens, the longest 1,668)."""
    rng = random.Random(0)
    return [1668] + [rng.randint(560, 1320) for _ in range(399)]


def dpo_cfg(root: Path, *over: str):
    return compose(["model=qwen3_8b_random", "objective=dpo", "objective.init_adapter=null", f"paths.root={root}",
                    "hardware=gpu", "data.max_length=2048", "train.per_device_train_batch_size=4",
                    "train.gradient_accumulation_steps=4", "objective.max_steps=5", *over])


H200 = Hardware("cuda", 139.8 * GIB, "NVIDIA H200")


def test_the_plan_sizes_the_largest_drawn_micro_batch_and_fits_more_pairs(tmp_path: Path) -> None:
    lengths = bench_lengths()
    write_bench_like_pairs(tmp_path, lengths)
    run = decide(dpo_cfg(tmp_path, "hardware.memory_budget_gib=22"), H200)
    b = run.per_device_train_batch_size
    drawn = draws.longest_drawn(lengths, [b], 16, draws.run_keys(dpo_cfg(tmp_path)))[b]
    assert run.predicted["tokens_per_micro_batch"] == drawn < b * 1668
    said = [r for r in run.reasons if "this run draws" in r]
    assert said == [f"plan: the largest micro-batch of {b} pairs this run draws holds {drawn} tokens (its seeded "
                    f"order, reprotune.sizing.draws), not {b} x the longest pair = {b * 1668}"]
    # the bound the plan used before: every pair as long as the longest; the same budget then fits fewer pairs
    (tmp_path / "data" / "pairs" / PAIR_LENGTHS_FILE).unlink()
    bound = decide(dpo_cfg(tmp_path, "hardware.memory_budget_gib=22"), H200)
    assert bound.predicted["tokens_per_micro_batch"] == bound.per_device_train_batch_size * 1668
    assert (b, bound.per_device_train_batch_size) == (8, 4)
    assert not [r for r in bound.reasons if "this run draws" in r]


@pytest.mark.parametrize("over", [("train.eval_steps=2",), ("++train.train_sampling_strategy=group_by_length",),
                                  ("++train.accelerator_config.use_seedable_sampler=false",),
                                  ("objective.max_length=1024",)],
                         ids=["validation-split", "other-sampler", "unseeded-sampler", "pairs-truncated"])
def test_where_the_order_is_not_known_the_plan_keeps_the_longest_pair_bound(over: tuple[str, ...],
                                                                           tmp_path: Path) -> None:
    write_bench_like_pairs(tmp_path, bench_lengths())
    cfg = dpo_cfg(tmp_path, "hardware.gradient_checkpointing=true", *over)
    run = decide(cfg, H200)
    assert run.predicted["tokens_per_micro_batch"] == 4 * 1668  # B x the longest packed pair
    assert not draws.order_is_known(cfg, 2048)


def test_a_lengths_file_that_does_not_match_train_jsonl_is_not_used(tmp_path: Path) -> None:
    folder = write_bench_like_pairs(tmp_path, bench_lengths())
    (folder / "train.jsonl").write_text((folder / "train.jsonl").read_text() * 2)
    assert draws.read_pair_lengths(folder) is None
    run = decide(dpo_cfg(tmp_path, "hardware.gradient_checkpointing=true"), H200)
    assert run.predicted["tokens_per_micro_batch"] == 4 * 1668


def test_eager_scores_of_drawn_pairs_stay_bounded_by_the_longest_pair(tmp_path: Path) -> None:
    """pair_dense (asked for by name on a GPU) keeps each document's score matrix: bounded by the longest pair x
    the tokens."""
    write_bench_like_pairs(tmp_path, bench_lengths())
    cfg = dpo_cfg(tmp_path, "hardware.attn_implementation=pair_dense", "hardware.gradient_checkpointing=true")
    run = decide(cfg, H200)
    s, data = run.planned, sz_shape_of(tmp_path, cfg)
    assert s.eager_attention and sz_memory.drawn_tokens(s, data)
    tokens = sz_memory.drawn_tokens(s, data)
    consts = load_table("memory.yaml")
    from reprotune.sizing.shape import model_shape

    shape = model_shape(cfg.model)
    with_scores = sz_memory.activation_bytes(shape, s, tokens, consts)["recompute_layer"]
    without = sz_memory.activation_bytes(shape, replace(s, eager_attention=False), tokens, consts)["recompute_layer"]
    scores = shape.heads * 1668 * tokens * consts["activations"]["eager_score_bytes"]
    assert with_scores - without == pytest.approx(scores)


def sz_shape_of(root: Path, cfg) -> object:
    from reprotune.sizing.decide import configured_batch
    from reprotune.sizing.shape import load_data_shape

    rows, accum = configured_batch(cfg)
    return load_data_shape(cfg, global_batch=rows * accum)


def test_the_plan_counts_a_preference_runs_own_steps_and_pairs(tmp_path: Path) -> None:
    """The run's length as the trainer gets it: objective.max_steps wins over train.max_steps, and a packed
    micro-batch holds B pairs (not B rows filled to the longest pair), so 400 pairs are 25 steps of 16."""
    from reprotune.sizing.report import make_plan

    write_bench_like_pairs(tmp_path, bench_lengths())
    plan = make_plan(dpo_cfg(tmp_path, "objective.max_steps=60", "train.max_steps=50"))
    assert (plan["run"]["steps"], plan["run"]["steps_per_epoch"], plan["run"]["epochs"]) == (60, 25, 2.4)
    assert any(w.startswith("objective.max_steps=60 passes over the 400 examples 2.4 times") for w in plan["warnings"])


def test_fewer_rows_than_a_batch_with_drop_last_draw_nothing_and_end() -> None:
    """dataloader_drop_last with fewer rows than B: the trainer takes no micro-batch; the draw ends (it looped
    forever before) and such a B gets no drawn size (the plan keeps the bound there)."""
    keys = {"seed": 42, "max_steps": 5, "num_train_epochs": 1.0, "drop_last": True, "strategy": "random",
            "seedable": True, "keep_global_batch": True}
    assert draws.drawn_micro_batches(3, 8, 2, keys) == []
    assert draws.longest_drawn([10, 20, 30], [1, 8], 16, keys) == {1: 30, 8: 0}
