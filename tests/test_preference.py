"""Preference tuning (issue #26): the formats read into TRL's rows, prepare's pairs (ties, prompt-keyed split, PII
replaced alike in prompt and answers), and TRL's DPO/ORPO/KTO trainers really run on the tiny model: byte-identical
reruns, the reference model recorded, starting from an SFT adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.preference.formats import read_preference_data
from reprotune.run import resolve
from reprotune.sizing.decide import Hardware, card, decide
from reprotune.sizing.shape import DataShape

from .conftest import tiny_adapter_run

FIX = Path(__file__).parent / "data" / "preference"


def u(c: str) -> dict:
    return {"role": "user", "content": c}


def a(c: str) -> dict:
    return {"role": "assistant", "content": c}


# --------------------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize(("name", "fmt", "index", "row"), [
    ("trl_conversational.jsonl", "trl", 0,
     {"prompt": [{"role": "system", "content": "Answer briefly."}, u("What is 2+2?")], "chosen": [a("4")],
      "rejected": [a("5")]}),
    ("trl_implicit.jsonl", "trl", 0, {"prompt": [u("Say hi.")], "chosen": [a("Hi!")], "rejected": [a("Go away.")]}),
    ("trl_standard.jsonl", "trl", 0, {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}),
    ("openai.jsonl", "openai", 1,
     {"prompt": [{"role": "system", "content": "Be terse."}, u("Largest planet?")], "chosen": [a("Jupiter.")],
      "rejected": [a("Saturn, I think, but let me explain at length...")]}),
    ("sharegpt_pairwise.json", "sharegpt_pairwise", 1,
     {"prompt": [{"role": "system", "content": "You are a math tutor."}, u("3*3?")], "chosen": [a("9")],
      "rejected": [a("6")]}),
    ("kto.jsonl", "kto", 1, {"prompt": [u("2+2?")], "completion": [a("5")], "label": False}),
    ("hh.jsonl", "hh", 1,
     {"prompt": [u("Hi"), a("Hello! How can I help?"), u("Name a prime.")], "chosen": [a("7.")],
      "rejected": [a("9.")]}),
])
def test_each_format_is_detected_and_read_to_trl_rows(name: str, fmt: str, index: int, row: dict) -> None:
    records, skipped, _ = read_preference_data(FIX / name, "auto", {}, "error")
    assert {r.format for r in records} == {fmt}
    assert records[index].row == row
    assert not skipped


def test_key_mapping_reads_other_names() -> None:
    mapping = {"prompt": "question", "chosen": "response_j", "rejected": "response_k"}
    records, _, _ = read_preference_data(FIX / "mapped.jsonl", "auto", mapping, "error")
    assert records[0].row == {"prompt": "Which is heavier, 1 kg of iron or 1 kg of feathers?",
                              "chosen": "They weigh the same.", "rejected": "Iron."}
    with pytest.raises(ReprotuneError, match=r"mapped.jsonl:1: record: no preference format"):
        read_preference_data(FIX / "mapped.jsonl", "auto", {}, "error")


def test_bad_records_are_file_line_field_errors_all_at_once() -> None:
    with pytest.raises(ReprotuneError) as err:
        read_preference_data(FIX / "bad.jsonl", "auto", {}, "error")
    lines = str(err.value).splitlines()
    assert any("bad.jsonl:2: chosen[0].role: unknown role 'robot'" in line for line in lines)
    assert any('bad.jsonl:3: label: expected true or false, got "yes"' in line for line in lines)
    assert any("bad.jsonl:4: record: no preference format has these keys (foo)" in line for line in lines)
    assert any("bad.jsonl:5: non_preferred_output: expected a non-empty list of messages" in line for line in lines)
    assert not any("bad.jsonl:1:" in line for line in lines)


# --------------------------------------------------------------------------------------------------- prepare
def prepared(root: Path, data: Path, *overrides: str) -> tuple[list[dict], list[dict], dict]:
    from reprotune.prepare import prepare

    prepare(compose([f"paths.root={root}", "model=tiny_random", "objective=dpo", f"data.path={data}",
                     "data.scrub=false", *overrides]))
    out = root / "data" / "pairs"  # its own folder: an SFT prepare's data/prepared is left alone
    read = lambda f: [json.loads(x) for x in (out / f).read_text().splitlines()]  # noqa: E731
    return read("train.jsonl"), read("holdout.jsonl"), json.loads((out / "report.json").read_text())


def test_prepare_reports_ties_and_duplicates_and_splits_by_prompt(tmp_path: Path) -> None:
    train, holdout, report = prepared(tmp_path, FIX / "trl_conversational.jsonl", "data.holdout_fraction=0.5")
    pairs = report["pairs"]
    assert pairs["duplicates_dropped"] == 1 and pairs["ties"]["count"] == 1 and pairs["ties"]["dropped"] == 1
    assert pairs["ties"]["where"] == [f"{FIX / 'trl_conversational.jsonl'}:4"]
    assert len(train) + len(holdout) == 4 and report["split_key"] == "prompt"
    prompts = lambda rows: {json.dumps(r["prompt"]) for r in rows}  # noqa: E731
    assert not prompts(train) & prompts(holdout)
    france = [r for r in train + holdout if r["prompt"] == [u("Capital of France?")]]
    assert len(france) == 2  # two pairs of one prompt, on one side
    _, _, kept = prepared(tmp_path, FIX / "trl_conversational.jsonl", "data.holdout_fraction=0.5",
                          "data.preference.ties=keep")
    assert kept["pairs"]["ties"] == {**pairs["ties"], "policy": "keep", "dropped": 0}
    assert kept["pairs"]["train"] + kept["pairs"]["holdout"] == 5


def test_prepare_records_each_training_pairs_packed_tokens_in_order(tmp_path: Path) -> None:
    """data/pairs/train_lengths.json: one number per train.jsonl row, the row's packed tokens as measured with
    the model's tokenizer (what the plan draws micro-batches from, reprotune.sizing.draws)."""
    from reprotune.models import load_tokenizer, resolve_model_dir
    from reprotune.preference.pairs import sequence_lengths

    train, _, report = prepared(tmp_path, FIX / "trl_conversational.jsonl", "data.holdout_fraction=0.5")
    recorded = json.loads((tmp_path / "data" / "pairs" / "train_lengths.json").read_text())["packed_pair_tokens"]
    cfg = compose([f"paths.root={tmp_path}", "model=tiny_random"])
    tokenizer = load_tokenizer(resolve_model_dir(cfg.model, cfg.paths.model_cache), cfg.model)
    assert recorded == [sequence_lengths(tokenizer, row)[1] for row in train] and len(set(recorded)) > 1
    assert sum(recorded) == report["tokens"]["packed_pair_train"]["total"]


def test_pii_is_replaced_alike_in_prompt_chosen_and_rejected(tmp_path: Path) -> None:
    train, holdout, _ = prepared(tmp_path, FIX / "pii.jsonl", "data.scrub=true", "data.pii.names=false",
                                 "data.holdout_fraction=0")
    row = (train + holdout)[0]
    texts = [row["prompt"][0]["content"], row["chosen"][0]["content"], row["rejected"][0]["content"]]
    assert not any("jane.roe@acme-mail.de" in t for t in texts)
    fake = texts[0].split("Email ")[1].split(" the invoice")[0]
    assert "@" in fake and fake in texts[1] and fake in texts[2]


def test_builtin_invoices_get_wrong_extractions_deterministically(workspace: tuple[Path, list[str]]) -> None:
    from reprotune.invoices import FIELDS, generate, write_jsonl
    from reprotune.prepare import in_holdout

    root, over = workspace
    raw = root / "raw.jsonl"
    write_jsonl(generate(12, 1234), raw)
    first, hold, report = prepared(root, raw, "data.preference.rejected=invoices", "data.holdout_fraction=0.3")
    again, hold_again, _ = prepared(root, raw, "data.preference.rejected=invoices", "data.holdout_fraction=0.3")
    assert (first, hold) == (again, hold_again) and len(first) + len(hold) == 12
    assert report["inputs"][0]["format"] == "sft+invoices" and report["split_key"].startswith("conversation")
    sft_holdout = [ex for ex in generate(12, 1234) if in_holdout(ex, 0.3)]  # the SFT prepare's split
    assert [r["prompt"] + r["chosen"] for r in hold] == [ex["messages"] for ex in sft_holdout] and hold
    for row in first + hold:
        chosen, rejected = (json.loads(row[k][0]["content"]) for k in ("chosen", "rejected"))
        assert chosen != rejected and list(rejected) == list(FIELDS)
        assert sum(chosen[f] != rejected[f] for f in FIELDS) in (1, 2)  # one mistake (a swap moves two fields)


def _mistake_kind(chosen: dict, rejected: dict) -> str:
    """Which of reprotune.invoices.MISTAKES turned `chosen` into `rejected` (read from the two answers)."""
    from datetime import date

    changed = [f for f in chosen if chosen[f] != rejected[f]]
    if changed == ["date"]:
        old, new = chosen["date"], rejected["date"]
        if "/" in new or new.count("-") == 2 and len(new.split("-")[0]) == 2:
            return "date_format"
        a, b = date.fromisoformat(old), date.fromisoformat(new)
        return "day_month_swapped" if (a.month, a.day) == (b.day, b.month) else "day_off_by_one"
    if changed == ["total", "tax"] and (rejected["total"], rejected["tax"]) == (chosen["tax"], chosen["total"]):
        return "swap_total_tax"
    if changed == ["currency"]:
        return "currency_symbol"
    if changed == ["invoice_number"]:
        return "number_prefix"
    (field,) = changed
    if isinstance(rejected[field], str):
        return "total_as_text"
    return "thousands_point" if abs(rejected[field] * 1000 - chosen[field]) < 1e-6 else "dropped_decimal"


def test_wrong_extractions_cover_the_format_slips_and_the_sft_adapters_digit_slips() -> None:
    """The built-in rejected answers: every kind of MISTAKES occurs on the 600 built-in invoices, the digit slips
    (what the SFT adapter still gets wrong on its holdout) being one field of valid JSON each, as the model writes it."""
    import random
    from collections import Counter

    from reprotune.invoices import (
        MISTAKES,
        _day_month_swapped,
        _day_off_by_one,
        _last_decimal_dropped,
        _thousands_as_decimal_point,
        generate,
        wrong_extraction,
    )

    assert (_last_decimal_dropped(1585.22), _last_decimal_dropped(1585.2), _last_decimal_dropped(634.0)) == \
        (1585.2, 1585, None)
    assert (_thousands_as_decimal_point(12596918.0), _thousands_as_decimal_point(999.0),
            _thousands_as_decimal_point(12.5)) == (12596.918, None, None)
    assert (_day_month_swapped("2023-11-02"), _day_month_swapped("2023-11-13"), _day_month_swapped("2023-05-05")) == \
        ("2023-02-11", None, None)
    assert (_day_off_by_one("2023-11-02"), _day_off_by_one("2023-02-28")) == ("2023-11-03", "2023-02-27")
    kinds = Counter()
    for i, example in enumerate(generate(600, 1234)):
        answer = example["messages"][-1]["content"]
        wrong = wrong_extraction(answer, random.Random(i))
        assert wrong != answer and json.loads(wrong).keys() == json.loads(answer).keys()
        kinds[_mistake_kind(json.loads(answer), json.loads(wrong))] += 1
    assert set(kinds) == set(MISTAKES) and min(kinds.values()) >= 5, kinds  # thousands_point: JPY amounts only


def test_sft_format_name_with_a_preference_objective_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ReprotuneError, match=r"data.format: 'chat' is not a preference format"):
        prepared(tmp_path, FIX / "openai.jsonl", "data.format=chat")


# ----------------------------------------------------------------------------------------------------- train
# objective.max_steps: a preference objective's own step count wins over train.max_steps (conf/objective/dpo.yaml)
PAIRS_TRAIN = ["model=tiny_random", "train.max_steps=2", "++objective.max_steps=2", "train.save_steps=100",
               "train.logging_steps=1",
               "train.per_device_train_batch_size=2", "train.learning_rate=1e-2"]


def pair_workspace(root: Path, fixture: str = "trl_conversational.jsonl", folder: str = "pairs") -> None:
    """data/pairs/train.jsonl as prepare writes it for objective=dpo (the fixture read as it is, ties dropped)."""
    records, _, _ = read_preference_data(FIX / fixture, "auto", {}, "error")
    (root / "data" / folder).mkdir(parents=True, exist_ok=True)
    rows = [r.row for r in records if r.row.get("chosen") != r.row.get("rejected") or "label" in r.row]
    (root / f"data/{folder}/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_train(root: Path, *overrides: str) -> dict:
    """train() on root; a preference objective from a fresh adapter unless the overrides name one to start from."""
    from reprotune.train import train

    named = any(o.startswith("objective.init_adapter=") for o in overrides)
    fresh = [] if named or not any(o.startswith("objective=") for o in overrides) else ["objective.init_adapter=null"]
    return train(compose([*PAIRS_TRAIN, f"paths.root={root}", *fresh, *overrides]))


@pytest.mark.parametrize("packing", [pytest.param(False, marks=pytest.mark.slow), True],  # full lane: padded
                         ids=["padded", "packed"])
def test_dpo_reruns_give_the_same_adapter_bytes_and_record_the_objective(tmp_path: Path, packing: bool) -> None:
    """TRL's padded pairs, and the packed pairs of reprotune.preference.packed (the GPU default) on the CPU. The
    packed rerun collates in a DataLoader worker (the GPU default for packed pairs): the same bytes."""
    records = []
    for name, workers in (("one", 0), ("two", int(packing))):
        pair_workspace(tmp_path / name)
        records.append(run_train(tmp_path / name, "objective=dpo", f"train.packing={packing}",
                                 f"hardware.dataloader_workers={workers}"))
    one, two = records
    assert one["run_settings"]["packing"] is packing
    assert (one["run_settings"]["dataloader_workers"], two["run_settings"]["dataloader_workers"]) == (0, int(packing))
    assert one["run_settings"]["attn_implementation"] == ("pair_dense" if packing else None)
    assert one["outputs"]["adapter"]["sha256"] == two["outputs"]["adapter"]["sha256"]
    assert one["objective"] == {"name": "dpo", "reference": "base (the adapter disabled)", "beta": 0.5,
                                "loss_type": ["sigmoid", "sft"], "init_adapter": None}
    assert one["inputs"]["train_data"]["sha256"]
    metrics = json.loads((tmp_path / "one/outputs/pref/train/metrics.json").read_text())
    assert metrics["global_step"] == 2 and metrics["assistant_tokens"] > 0
    adapter = tmp_path / "one/outputs/pref/adapter"
    assert not (tmp_path / "one/outputs/adapter").exists() and not (tmp_path / "one/data/prepared").exists()
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "ref").exists()


@pytest.mark.parametrize("packing", [pytest.param(False, marks=pytest.mark.slow), True],  # full lane: padded
                         ids=["padded", "packed"])
def test_dpo_starts_from_the_sft_adapter_which_is_the_reference(tmp_path: Path, packing: bool,
                                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """The default objective.init_adapter is the SFT run's outputs/adapter: trained further into outputs/pref, the
    SFT adapter and its train record left byte for byte, recorded in the manifest by sha256; on TRL's padded
    pairs and on packed ones (TRL's 'ref' adapter is the reference through the packed forward too)."""
    from safetensors.torch import load_file

    from reprotune.manifest import sha256_tree, tree_digest
    from reprotune.train import train

    sft_run = tiny_adapter_run(tmp_path_factory)
    shutil.copytree(sft_run / "outputs", tmp_path / "outputs")
    sft, sft_files = tmp_path / "outputs" / "adapter", sha256_tree(tmp_path / "outputs")
    pair_workspace(tmp_path)
    record = train(compose([*PAIRS_TRAIN, f"paths.root={tmp_path}", "objective=dpo",  # init_adapter: the default
                            f"train.packing={packing}"]))
    assert record["run_settings"]["packing"] is packing
    assert record["objective"]["reference"] == "init_adapter (a frozen copy of it, TRL's 'ref' adapter)"
    init = record["objective"]["init_adapter"]
    assert init["path"] == "outputs/adapter" and init["sha256"] == tree_digest(sha256_tree(sft_run / "outputs/adapter"))
    out = tmp_path / "outputs" / "pref" / "adapter"
    assert record["outputs"]["adapter"]["path"] == "outputs/pref/adapter"
    assert not (out / "ref").exists()  # TRL's frozen copy is not an output
    before, after = load_file(sft / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    assert any(not before[k].equal(after[k]) for k in before)  # trained further from the SFT weights
    assert {k: v for k, v in sha256_tree(tmp_path / "outputs").items() if not k.startswith("pref/")} == sft_files
    with pytest.raises(ReprotuneError, match=r"objective.init_adapter: is this run's own output"):
        run_train(tmp_path, "objective=dpo", f"objective.init_adapter={out}")


@pytest.mark.parametrize(("objective", "fixture", "packing"), [("dpo", "trl_conversational.jsonl", False),
                                                                ("dpo", "trl_conversational.jsonl", True),
                                                                ("kto", "kto.jsonl", False),
                                                                ("kto", "kto.jsonl", True),
                                                                ("orpo", "trl_conversational.jsonl", True)],
                         ids=["dpo-padded", "dpo-packed", "kto", "kto-packed", "orpo-packed"])
@pytest.mark.slow  # full lane: a training step per objective and layout
def test_the_reference_forward_leaves_checkpointing_as_train_set_it(tmp_path: Path, objective: str, fixture: str,
                                                                     packing: bool) -> None:
    """TRL 1.16 turns checkpointing off and back on around each reference forward, and the re-enable drops
    every_n_layers (every layer checkpointed from the second micro-step on, then torch's checkpoint fails on the
    key). reprotune leaves the setting alone: a run checkpointing every second layer trains to the adapter bytes of
    the same run without checkpointing."""
    adapters = []
    for name, ckpt in (("ckpt", ["hardware.gradient_checkpointing=true",
                                  "++train.activation_checkpointing_kwargs={every_n_layers:2}"]),
                       ("plain", ["hardware.gradient_checkpointing=false"])):
        pair_workspace(tmp_path / name, fixture)
        record = run_train(tmp_path / name, f"objective={objective}", f"train.packing={packing}", *ckpt)
        assert record["run_settings"]["activation_checkpointing"] is (name == "ckpt")
        if name == "ckpt":
            assert record["run_settings"]["checkpoint_every_n_layers"] == 2
        metrics = json.loads((tmp_path / name / "outputs/pref/train/metrics.json").read_text())
        assert metrics["global_step"] == 2
        adapters.append(record["outputs"]["adapter"]["sha256"])
    assert adapters[0] == adapters[1]


@pytest.mark.parametrize(("objective", "fixture", "method"), [("orpo", "trl_conversational.jsonl", "lora"),
                                                               ("kto", "kto.jsonl", "lora"),
                                                               ("dpo", "trl_standard.jsonl", "dora")])
def test_orpo_kto_and_dpo_on_dora_train_with_trl(tmp_path: Path, objective: str, fixture: str, method: str) -> None:
    pair_workspace(tmp_path, fixture)
    record = run_train(tmp_path, f"objective={objective}", f"method={method}")
    assert record["run_settings"]["method"] == method
    assert record["objective"]["name"] == objective
    assert record["objective"]["reference"].startswith("none" if objective == "orpo" else "base")
    if method == "dora":
        assert json.loads((tmp_path / "outputs/pref/adapter/adapter_config.json").read_text())["use_dora"] is True
    metrics = json.loads((tmp_path / "outputs/pref/train/metrics.json").read_text())
    assert metrics["global_step"] == 2 and metrics["final_train_loss"] == metrics["final_train_loss"]  # not NaN


def test_wrong_data_for_the_objective_is_one_line(tmp_path: Path, workspace: tuple[Path, list[str]]) -> None:
    root, _ = workspace  # SFT conversations in data/prepared
    shutil.copytree(root / "data/prepared", root / "data/pairs")  # ... where the pairs belong
    with pytest.raises(ReprotuneError, match=r"pairs/train.jsonl:1: prompt: holds SFT conversations"):
        run_train(root, "objective=dpo")
    pair_workspace(tmp_path, "kto.jsonl")
    with pytest.raises(ReprotuneError, match=r"pairs/train.jsonl:1: chosen: unpaired \(KTO\) data; objective=dpo"):
        run_train(tmp_path, "objective=dpo")
    pair_workspace(tmp_path, folder="prepared")
    with pytest.raises(ReprotuneError, match=r"prepared/train.jsonl:1: messages: holds preference data"):
        run_train(tmp_path)  # objective=sft on pairs
    pair_workspace(tmp_path)
    with pytest.raises(ReprotuneError, match=r"outputs/adapter/adapter_config.json:0: objective.init_adapter: no "):
        run_train(tmp_path, "objective=dpo", f"objective.init_adapter={tmp_path}/outputs/adapter")  # no SFT run yet


def pair_shape(longest: int, mean: float) -> DataShape:
    return DataShape(examples=400, max_tokens=longest, mean_tokens=mean, total_tokens=int(400 * mean),
                     assistant_share=0.6, prepared_max_length=2048, tokenizer_model=None, overlong=0, source="test")


def test_decide_plans_packed_dpo_pairs_and_runs_padded_ones_as_configured(tmp_path: Path) -> None:
    """DPO's packed pairs are planned as packed rows of the longest pair (prompt once, both answers; bound: twice
    max_length); ORPO's and KTO's padded pairs are planned too, as TRL pads them (tests/test_plan_pref.py)."""
    base = [f"paths.root={tmp_path}", "model=qwen3_8b_random", "data.max_length=2048"]
    run = decide(compose([*base, "objective=dpo"]), card("H200"), None, None)
    assert run.packing and run.planned is not None and run.planned.max_length == 2 * 2048
    assert any("a pair is one packed row of up to 4096 tokens" in r for r in run.reasons)
    # a 24 GB card's budget: a LoRA DPO run of real pairs must checkpoint, and its plan stays inside the budget
    small = decide(compose([*base, "objective=dpo", "hardware.memory_budget_gib=22"]), card("H200"), None,
                   pair_shape(1668, 938.0))
    assert small.planned.max_length == 1668 and small.activation_checkpointing
    assert small.predicted["card_gib"] <= 22.0
    roomy = decide(compose([*base, "objective=dpo"]), card("H200"), None, pair_shape(1668, 938.0))
    assert not roomy.activation_checkpointing and roomy.predicted["peak_gib"] > small.predicted["peak_gib"]
    packed_kto = decide(compose([*base, "objective=kto"]), card("H200"), None, None)  # rows packed, one document each
    assert packed_kto.packing and packed_kto.planned.max_length == 2048 and packed_kto.planned.kl_rows
    packed_orpo = decide(compose([*base, "objective=orpo"]), card("H200"), None, None)  # pairs packed, as DPO's
    assert packed_orpo.packing and packed_orpo.planned.max_length == 2 * 2048
    assert not packed_orpo.planned.full_logits and not packed_orpo.planned.reference
    for name in ("kto", "orpo"):
        padded = decide(compose([*base, f"objective={name}", "train.packing=false"]), card("H200"), None, None)
        assert padded.planned is not None and not padded.packing and padded.fits
        assert padded.planned.max_length == 2048 and padded.planned.sequences == (1 if name == "kto" else 2)
        assert any(f"padded pairs: {name} modelled as" in r for r in padded.reasons)
    assert decide(compose([*base, "objective=dpo"]), Hardware("cpu"), None, None).per_device_train_batch_size == 4


def test_packed_dpo_pairs_never_get_the_tiled_mlp_or_offloading_unasked(tmp_path: Path) -> None:
    """Measured on the H200: the tiled MLP's recompute fails on packed pairs, and offloading halves their speed
    (a new row length every micro-step); a budget that SFT would meet with them gets neither for DPO."""
    base = [f"paths.root={tmp_path}", "model=qwen3_8b_random", "data.max_length=2048", "objective=dpo",
            "method=qlora", "hardware.memory_budget_gib=8"]
    run = decide(compose(base), card("H200"), None, pair_shape(1668, 938.0))
    assert not run.activation_offloading and run.tiled_mlp_tokens == 0
    sft = decide(compose([*base[:3], "method=qlora", "hardware.memory_budget_gib=8", "data.max_length=16384"]),
                 card("H200"), None, None)
    assert sft.activation_offloading or sft.tiled_mlp_tokens  # the control: SFT at this budget does use them
    forced = decide(compose([*base, "hardware.activation_offloading=true"]), card("H200"), None,
                    pair_shape(1668, 938.0))
    assert forced.activation_offloading
    with pytest.raises(ReprotuneError, match="hardware.tiled_mlp=true: not with DPO's packed pairs"):
        decide(compose([*base, "hardware.tiled_mlp=true"]), card("H200"), None, None)


@pytest.mark.slow  # three training processes, one killed mid-run
def test_dpo_kill_9_then_rerun_gives_the_uninterrupted_adapter(tmp_path: Path) -> None:
    """The SFT resume machinery (reprotune.checkpoints: sealed checkpoints, the run's fingerprint) under DPO."""
    import sys

    from .test_resume import killed_at_step_then_rerun

    run = [*PAIRS_TRAIN, "objective=dpo", "objective.init_adapter=null", "train.max_steps=4", "++objective.max_steps=4",
           "train.save_steps=2"]
    cmd = lambda root: [sys.executable, "-m", "reprotune.train", *run, f"paths.root={root}"]  # noqa: E731
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    for root in (straight, killed):
        pair_workspace(root)
    resumed, whole = killed_at_step_then_rerun(cmd, straight, killed, "outputs/pref")
    assert resumed["outputs"]["adapter"]["sha256"] == whole["outputs"]["adapter"]["sha256"]
    assert (killed / "outputs/pref/train/metrics.json").read_bytes() == \
        (straight / "outputs/pref/train/metrics.json").read_bytes()


@pytest.mark.slow  # prepare + a DPO run on the built-in pairs + eval of three systems
def test_eval_of_a_preference_run_compares_base_sft_and_preference_adapter(
        tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    from reprotune.evaluate import evaluate
    from reprotune.invoices import generate, write_jsonl
    from reprotune.prepare import prepare

    sft = tmp_path / "sft_adapter"
    shutil.copytree(tiny_adapter_run(tmp_path_factory) / "outputs" / "adapter", sft)
    write_jsonl(generate(16, 1234), tmp_path / "raw.jsonl")
    over = [f"paths.root={tmp_path}", "model=tiny_random", "objective=dpo", f"objective.init_adapter={sft}",
            f"data.path={tmp_path / 'raw.jsonl'}", "data.scrub=false", "data.holdout_fraction=0.3"]
    prepare(compose(over))
    run_train(tmp_path, *over[2:])
    result = evaluate(compose([*over, "eval.max_examples=3", "eval.max_new_tokens=8"]))
    pref = result["metrics"]["preference"]
    assert pref["pairs"] == 3 and pref["beta"] == 0.5
    assert "reward_accuracy" not in pref["base"] and {"reward_accuracy", "reward_margin"} <= pref["sft"].keys()
    assert pref["tuned"]["reward_margin"] != pref["sft"]["reward_margin"]  # DPO moved the adapter
    assert pref["sft"]["logp_chosen"] != pref["base"]["logp_chosen"]  # the SFT adapter really is loaded
    out = tmp_path / "outputs" / "pref" / "eval"
    assert json.loads((out / "metrics.json").read_text())["preference"] == pref
    assert "Holdout pairs (objective dpo)" in (out / "report.md").read_text()
    first = json.loads((out / "predictions.jsonl").read_text().splitlines()[0])
    assert set(first["logps"]) == {"index", "base", "sft", "tuned"}
    task = result["metrics"]  # the task's metrics next to the pairs': base, the SFT adapter it started from, DPO's
    assert {"base", "sft", "tuned"} <= task.keys() and task["tuned"]["field_accuracy"] >= 0
    assert task["delta_tuned_vs_sft"]["loss"] == pytest.approx(task["tuned"]["loss"] - task["sft"]["loss"], abs=1e-5)
    assert len({task[s]["loss"] for s in ("base", "sft", "tuned")}) == 3  # three different models really scored
    assert set(first["predictions"]) == {"base", "sft", "tuned"}
    assert "| SFT adapter (start) |" in (out / "report.md").read_text().split("## Holdout pairs")[0]


def test_make_plan_plans_packed_dpo_and_padded_pairs(tmp_path: Path) -> None:
    from reprotune.sizing.report import make_plan

    plan = make_plan(compose([f"paths.root={tmp_path}", "model=qwen3_8b_random", "objective=dpo"]))
    assert json.dumps(plan) and plan["settings"]["packing"]  # the whole plan, JSON-able
    kto = make_plan(compose([f"paths.root={tmp_path}", "model=qwen3_8b_random", "objective=kto"]))
    assert kto["settings"]["packing"] and kto["memory"]["peak_gib"] > 0  # KTO's rows packed on a GPU
    assert any(r.startswith("plan: an example is one packed row") for r in kto["reasons"])
    padded = make_plan(compose([f"paths.root={tmp_path}", "model=qwen3_8b_random", "objective=kto",
                                "train.packing=false"]))
    assert not padded["settings"]["packing"] and padded["memory"]["peak_gib"] > 0
    assert any("held to one H200 run each" in r for r in padded["reasons"])


# ------------------------------------------------------------------------- eval of text pairs and KTO rows
@pytest.fixture(scope="module")
def tiny_peft(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """The tiny base with the session's SFT adapter as the 'tuned' system (it differs from the base)."""
    from reprotune.evaluation.generation import load_model_and_tokenizer

    root = tiny_adapter_run(tmp_path_factory)
    cfg = compose(["model=tiny_random", f"paths.root={root}", "hardware=cpu"])
    model, tokenizer, _ = load_model_and_tokenizer(cfg, resolve(cfg, "eval"))  # on the CPU in float32
    return model, tokenizer


def swapped(rows: list[dict]) -> list[dict]:
    return [{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in rows]


def test_text_pairs_are_tokenized_as_trl_does_and_evaluated(tiny_peft: tuple, tmp_path: Path) -> None:
    from reprotune.preference import pair_eval

    model, tokenizer = tiny_peft
    (tmp_path / "holdout.jsonl").write_text((FIX / "trl_standard.jsonl").read_text())
    rows = pair_eval.read_pairs(tmp_path / "holdout.jsonl")
    full, start = pair_eval.tokenized(tokenizer, rows[0]["prompt"], [rows[0]["chosen"], rows[0]["rejected"]])
    assert full[0][:start] == tokenizer(text="The sky is")["input_ids"]  # no chat template on text
    assert tokenizer.decode(full[0][start:]) == " blue." + tokenizer.eos_token  # TRL appends the EOS
    metrics, records = pair_eval.preference_eval(model, tokenizer, rows, 0.1)
    assert metrics["pairs"] == 2 and set(metrics) == {"pairs", "beta", "base", "tuned"}
    assert all(r["base"]["chosen"] < 0 and r["tuned"]["chosen"] != r["base"]["chosen"] for r in records)
    margins = [0.1 * ((r["tuned"]["chosen"] - r["base"]["chosen"]) - (r["tuned"]["rejected"] - r["base"]["rejected"]))
               for r in records]
    assert metrics["tuned"]["reward_margin"] == pytest.approx(sum(margins) / 2, abs=1e-5)
    flipped, _ = pair_eval.preference_eval(model, tokenizer, swapped(rows), 0.1)
    assert flipped["tuned"]["reward_margin"] == pytest.approx(-metrics["tuned"]["reward_margin"], abs=1e-5)
    assert flipped["base"]["logp_accuracy"] == 1 - metrics["base"]["logp_accuracy"]
    assert "| logp_chosen |" in pair_eval.table(metrics)


def test_kto_rows_are_evaluated_by_label(tiny_peft: tuple, tmp_path: Path) -> None:
    from reprotune.preference import pair_eval

    model, tokenizer = tiny_peft
    records, _, _ = read_preference_data(FIX / "kto.jsonl", "auto", {}, "error")
    rows = [r.row for r in records]
    text = [{"prompt": "2+2 =", "completion": " 4", "label": True}, {"prompt": "2+2 =", "completion": " 5",
                                                                    "label": False}]
    for i, kind in enumerate((rows, text)):
        (tmp_path / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kind))
        assert pair_eval.read_pairs(tmp_path / f"{i}.jsonl") == kind
    metrics, per_row = pair_eval.preference_eval(model, tokenizer, rows, 0.1)
    assert metrics["kto_rows"] == 4 and metrics["base"]["desirable"] == metrics["base"]["undesirable"] == 2
    good = [r["base"]["completion"] for r in per_row if r["label"]]
    assert metrics["base"]["logp_desirable"] == pytest.approx(sum(good) / 2, abs=1e-5)
    rewards = [0.1 * (r["tuned"]["completion"] - r["base"]["completion"]) for r in per_row]
    signs = [(x > 0) == r["label"] for x, r in zip(rewards, per_row, strict=True)]
    assert metrics["tuned"]["reward_accuracy"] == sum(signs) / 4
    assert "reward_accuracy" not in metrics["base"] and all(x != 0 for x in rewards)
    flipped, _ = pair_eval.preference_eval(model, tokenizer, [{**r, "label": not r["label"]} for r in rows], 0.1)
    assert flipped["tuned"]["reward_accuracy"] == pytest.approx(1 - metrics["tuned"]["reward_accuracy"])
    assert flipped["tuned"]["reward_margin"] == pytest.approx(-metrics["tuned"]["reward_margin"], abs=1e-5)
    text_metrics, _ = pair_eval.preference_eval(model, tokenizer, text, 0.1)
    assert text_metrics["tuned"]["logp_desirable"] != text_metrics["base"]["logp_desirable"]
    assert "| reward_desirable |" in pair_eval.table(metrics)


def test_a_holdout_of_mixed_rows_is_one_line(tmp_path: Path) -> None:
    from reprotune.preference import pair_eval

    rows = [{"prompt": "a", "chosen": " b", "rejected": " c"}, {"prompt": "a", "completion": " b", "label": True}]
    (tmp_path / "h.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ReprotuneError, match=r"h.jsonl:2: prompt: mixes pairs and KTO rows"):
        pair_eval.read_pairs(tmp_path / "h.jsonl")
    (tmp_path / "h.jsonl").write_text(json.dumps({"prompt": "a", "chosen": [], "rejected": " c"}) + "\n")
    with pytest.raises(ReprotuneError, match=r"h.jsonl:1: prompt: not a preference row"):
        pair_eval.read_pairs(tmp_path / "h.jsonl")


def eval_workspace(root: Path, factory: pytest.TempPathFactory, rows: list[dict]) -> list[str]:
    """data/pairs/holdout.jsonl of these rows and the session's tiny adapter as the preference run's output; the
    overrides of a make eval ARGS="objective=kto" on it."""
    shutil.copytree(tiny_adapter_run(factory) / "outputs/adapter", root / "outputs/pref/adapter")
    (root / "data/pairs").mkdir(parents=True)
    (root / "data/pairs/holdout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"paths.root={root}", "model=tiny_random", "objective.init_adapter=null", "eval.max_new_tokens=8"]


@pytest.mark.slow  # full lane: a KTO eval run of three systems
def test_make_eval_on_a_kto_holdout_scores_rows_and_desirable_answers(tmp_path: Path,
                                                                     tmp_path_factory: pytest.TempPathFactory) -> None:
    """KTO rows of the built-in task: the preference metrics on every row, the task metrics (field accuracy) on
    the label-true rows, whose completion is the reference; report.md says so."""
    import random

    from reprotune.evaluate import evaluate
    from reprotune.invoices import generate, wrong_extraction

    rows = []
    for i, ex in enumerate(generate(4, 99)):
        answer = ex["messages"][-1]["content"]
        good = i % 2 == 0
        rows.append({"prompt": ex["messages"][:-1], "label": good, "completion": [
            {"role": "assistant", "content": answer if good else wrong_extraction(answer, random.Random(i))}]})
    over = eval_workspace(tmp_path, tmp_path_factory, rows)
    result = evaluate(compose([*over, "objective=kto"]))
    metrics = result["metrics"]
    assert metrics["examples"] == 2 and metrics["preference"]["kto_rows"] == 4
    assert metrics["preference"]["tuned"]["desirable"] == 2 and "reward_accuracy" in metrics["preference"]["tuned"]
    assert 0 <= metrics["tuned"]["field_accuracy"] <= 1
    out = tmp_path / "outputs/pref/eval"
    report = (out / "report.md").read_text()
    assert "Task metrics on the 2 KTO rows with label true" in report and "## Holdout KTO rows (objective kto)" in report
    predictions = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert [p["logps"]["index"] for p in predictions] == [0, 2]  # each example next to its own row's log-probs
    assert predictions[1]["reference"] == rows[2]["completion"][0]["content"]
    assert not (tmp_path / "outputs/eval").exists()  # the SFT eval's folder is not touched


def test_make_eval_on_text_pairs_asks_their_raw_prompts(tiny_peft: tuple, tmp_path: Path,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """Text (standard) pairs train on raw text, so the task pass asks each text prompt as it is (tokenized as TRL
    tokenizes one, no chat template) and scores the reply against the chosen answer, next to the preference
    metrics; the reference loss is over the chosen answer + EOS after the prompt's own tokens."""
    import torch

    from reprotune.evaluate import evaluate

    model, tokenizer = tiny_peft
    rows = [json.loads(x) for x in (FIX / "trl_standard.jsonl").read_text().splitlines()]
    text_task = ["data.task.type=text", "data.task.primary_metric=rougeL", "data.task.metrics=[]"]
    result = evaluate(compose([*eval_workspace(tmp_path, tmp_path_factory, rows), "objective=dpo", *text_task]))
    metrics = result["metrics"]
    assert metrics["examples"] == len(rows) and metrics["preference"]["pairs"] == len(rows)
    assert set(metrics["tuned"]) >= {"exact_match", "token_f1", "rougeL", "loss"}
    out = tmp_path / "outputs/pref/eval"
    report = (out / "report.md").read_text()
    assert f"Task metrics on the {len(rows)} holdout text rows (pairs: the chosen answer is the reference)" in report
    assert result["manifest"]["task_pass"].startswith("Task metrics on the")
    predictions = [json.loads(x) for x in (out / "predictions.jsonl").read_text().splitlines()]
    assert [(p["input"], p["reference"]) for p in predictions] == [(r["prompt"], r["chosen"]) for r in rows]
    assert all("base" in p["logps"] for p in predictions)
    # the base's reference loss, by hand: the text prompt's ids, then the chosen answer and the EOS
    for pred, row in zip(predictions, rows, strict=True):
        prompt = tokenizer(text=row["prompt"])["input_ids"]
        answer = tokenizer.encode(row["chosen"], add_special_tokens=False) + [tokenizer.eos_token_id]
        with torch.inference_mode(), model.disable_adapter():
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits[len(prompt) - 1:-1], torch.tensor(answer))
        assert pred["reference_loss"]["base"] == pytest.approx(float(nll), abs=1e-4)


def test_text_pairs_under_the_json_task_are_one_line_naming_the_row(tmp_path: Path,
                                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """The built-in task scores JSON answers: free-text chosen answers under it stop eval before any model pass, in
    one line that names the row and the setting to change."""
    from reprotune.evaluate import evaluate

    rows = [json.loads(x) for x in (FIX / "trl_standard.jsonl").read_text().splitlines()]
    with pytest.raises(ReprotuneError) as err:
        evaluate(compose([*eval_workspace(tmp_path, tmp_path_factory, rows), "objective=dpo", "data.task.type=json"]))
    assert str(err.value) == (f"{tmp_path}/data/pairs/holdout.jsonl:1: chosen: the reference answer is not a JSON "
                              "object, but data.task.type is json; for free-text answers set data.task.type=text (or "
                              "auto: inferred from the answers)")
    assert not (tmp_path / "outputs/pref/eval").exists()


def test_a_text_row_in_a_message_holdout_is_one_line(tmp_path: Path) -> None:
    from reprotune.evaluation.holdout import read_holdout

    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"prompt": "a", "completion": " b", "label": True}]
    (tmp_path / "holdout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ReprotuneError, match=r"holdout.jsonl:2: prompt: mixes text \(standard\) rows and message "):
        read_holdout(tmp_path / "holdout.jsonl")
    (tmp_path / "holdout.jsonl").write_text(json.dumps(rows[1]) + "\n")
    assert [(e.prompt, e.reference) for e in read_holdout(tmp_path / "holdout.jsonl")] == [("a", " b")]


# ----------------------------------------------------------------------------------- tools in preference data
TOOL_TEMPLATE = f"model.chat_template={Path(__file__).parents[1] / 'conf/chat_templates/qwen2_5_tools.jinja'}"


@pytest.mark.slow  # full lane: prepare and a DPO training run
def test_tool_calls_results_and_tools_survive_prepare_and_train_with_dpo(tmp_path: Path) -> None:
    with pytest.raises(ReprotuneError, match=r"openai_tools.jsonl:1: tools: 2 record\(s\) use tools, but "
                                             r"model.chat_template \(the tokenizer of tiny_random\) leaves"):
        prepared(tmp_path, FIX / "openai_tools.jsonl")  # ChatML renders neither the tools nor the calls
    train, holdout, report = prepared(tmp_path, FIX / "openai_tools.jsonl", TOOL_TEMPLATE, "data.scrub=true",
                                      "data.pii.names=false", "data.holdout_fraction=0")
    assert report["pairs"]["train"] == 2 and not holdout
    paris = next(r for r in train if len(r["prompt"]) == 3)
    assert [m["role"] for m in paris["prompt"]] == ["user", "assistant", "tool"]
    assert paris["prompt"][1]["tool_calls"][0] == {"type": "function", "id": "call_1", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert paris["prompt"][2] == {"role": "tool", "content": '{"temp_c": 18, "sky": "cloudy"}', "tool_call_id": "call_1"}
    assert [t["function"]["name"] for t in json.loads(paris["tools"])] == ["get_weather", "send_mail"]
    call = json.loads(paris["chosen"][0]["tool_calls"][0]["function"]["arguments"])  # an object in the source
    assert call["body"] == "Paris: 18 C, cloudy." and call["to"] != "jane.roe@acme-mail.de"
    assert call["to"] in paris["prompt"][0]["content"]  # one fake for the address in the prompt and in the call
    assert paris["rejected"] == [a("It is sunny in Paris.")]
    record = run_train(tmp_path, "objective=dpo", TOOL_TEMPLATE)
    assert record["objective"]["name"] == "dpo"
    assert json.loads((tmp_path / "outputs/pref/train/metrics.json").read_text())["global_step"] == 2


def test_sharegpt_pairwise_function_call_and_observation_turns_are_tool_messages() -> None:
    records, _, _ = read_preference_data(FIX / "sharegpt_pairwise_tools.json", "auto", {}, "error")
    first, second = (r.row for r in records)
    assert [m["role"] for m in first["prompt"]] == ["user", "assistant", "tool"]
    assert first["prompt"][1]["tool_calls"] == [{"type": "function", "function": {
        "name": "convert", "arguments": '{"amount": 100, "from": "USD", "to": "EUR"}'}}]
    assert first["prompt"][2] == {"role": "tool", "content": '{"result": 92.5}'}
    assert json.loads(first["tools"])[0] == {"type": "function", "function": {
        "name": "convert", "description": "Convert currency", "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}}}}}
    assert second["chosen"][0]["tool_calls"][0]["function"]["name"] == "convert"  # the preferred answer is a call
    assert second["rejected"] == [a("About 5 USD.")]


@pytest.mark.parametrize(("objective", "fixture", "start"), [("dpo", "trl_conversational.jsonl", "fresh"),
                                                              ("dpo", "trl_conversational.jsonl", "sft_adapter"),
                                                              ("kto", "kto.jsonl", "fresh")])
@pytest.mark.slow  # full lane: two DPO/KTO training runs per case
def test_the_light_reference_switch_trains_to_trls_bytes(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                         monkeypatch: pytest.MonkeyPatch, objective: str,
                                                         fixture: str, start: str) -> None:
    """The reference forward's adapter switch without PEFT's walks (trainers.light_use_adapter: the base with the
    adapter disabled, or TRL's 'ref' adapter of the SFT start) and the FLOPs count read once train to the adapter
    bytes of TRL's own use_adapter and the Trainer's count; and TRL's switch is really left out."""
    import importlib

    from reprotune.preference import trainers

    trl_module = importlib.import_module(f"trl.trainer.{objective}_trainer")
    records, trl_switches = [], []
    for name, trl_path in (("light", False), ("trl", True)):
        root = tmp_path / name
        if start == "sft_adapter":
            shutil.copytree(tiny_adapter_run(tmp_path_factory) / "outputs", root / "outputs")
        pair_workspace(root, fixture)
        calls: list[str | None] = []
        original = trl_module.use_adapter
        monkeypatch.setattr(trl_module, "use_adapter",
                            lambda model, adapter_name, _o=original, _c=calls: _c.append(adapter_name) or _o(model, adapter_name))
        monkeypatch.setattr(trainers, "TRL_HOST_PATH", trl_path)
        fresh = ["objective.init_adapter=null"] if start == "fresh" else []
        from reprotune.train import train

        records.append(train(compose([*PAIRS_TRAIN, f"paths.root={root}", f"objective={objective}", *fresh,
                                      "train.packing=true"])))
        trl_switches.append(calls)
        monkeypatch.undo()
    light, trl = records
    assert trl_switches[0] == [] and len(trl_switches[1]) >= 2  # one reference forward a micro-step at least
    assert set(trl_switches[1]) == {"ref" if start == "sft_adapter" else None}
    assert light["outputs"]["adapter"]["sha256"] == trl["outputs"]["adapter"]["sha256"]


def test_the_light_switch_puts_every_flag_back_and_leaves_requires_grad(tmp_path: Path) -> None:
    """Inside: every adapter layer disabled (or on TRL's 'ref' adapter); after: the flags as they were, and no
    adapter tensor's requires_grad touched (PEFT's own switch sets and resets them)."""
    import contextlib

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from reprotune.models import resolve_model_dir
    from reprotune.preference.trainers import light_use_adapter

    cfg = compose(["model=tiny_random", f"paths.root={tmp_path}"])
    base = AutoModelForCausalLM.from_pretrained(resolve_model_dir(cfg.model, cfg.paths.model_cache))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    model.add_adapter("ref", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    unused = contextlib.nullcontext
    switch = light_use_adapter(lambda *_: unused())
    with torch.no_grad():
        with switch(model, None):
            assert all(m.disable_adapters for m in layers) and model._adapters_disabled
        assert not any(m.disable_adapters for m in layers) and not model._adapters_disabled
        with switch(model, "ref"):
            assert all(m.active_adapters == ["ref"] for m in layers)
        assert all(m.active_adapters == ["default"] for m in layers)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == grads
    assert any(grads.values())
    # the FLOPs count read once is the Trainer's
    from types import SimpleNamespace

    from transformers import Trainer
    from trl import DPOTrainer

    from reprotune.preference.trainers import reference_keeps_checkpointing

    holder, inputs = SimpleNamespace(model=model), {"input_ids": torch.ones(3, 17, dtype=torch.long)}
    ours = reference_keeps_checkpointing(DPOTrainer).floating_point_ops
    assert ours(holder, inputs) == ours(holder, inputs) == Trainer.floating_point_ops(holder, inputs) > 0
    assert holder._reprotune_parameters == model.num_parameters(exclude_embeddings=True)
