"""make plan and train's preflight on padded preference batches (issue #26): ORPO, KTO and DPO with
train.packing=false, as TRL 1.16's trainers batch them (reprotune.sizing.preference_plan.padded_batch): 2B rows of the
longest sequence for a DPO/ORPO pair, B rows and a KL batch for KTO, the reference forward without gradients."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.run_settings import RunSettings
from reprotune.sizing import decide as sz_decide
from reprotune.sizing import fit as sz_fit
from reprotune.sizing import memory as sz_memory
from reprotune.sizing import preflight as sz_preflight
from reprotune.sizing import report as sz_report
from reprotune.sizing import shape as sz_shape

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
MODEL = "model=qwen3_8b_random"
# a GPU packs DPO's and ORPO's pairs and KTO's rows: padded with packing off
PADDED = [("orpo", "train.packing=false"), ("kto", "train.packing=false"), ("dpo", "train.packing=false")]


def write_pairs(root: Path, longest: int = 700, mean: float = 500.0, n: int = 100, paired: bool = True,
                packed_longest: int = 1100) -> Path:
    """data/pairs as reprotune.preference.pairs.prepare_pairs writes it: report.json's token counts (the longest
    sequence of each pair, the packed pair, the answers' share) and a train.jsonl of that kind of row."""
    folder = root / "data" / "pairs"
    folder.mkdir(parents=True, exist_ok=True)
    row = ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
            "rejected": [{"role": "assistant", "content": "b"}]} if paired else
           {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "a"}],
            "label": True})
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for _ in range(n)))
    dist = {"n": n, "min": 100, "max": longest, "mean": mean, "total": int(n * mean)}
    report = {"objective": "dpo", "max_length": 2048,
              "pairs": {"overlong": {"policy": "drop", "dropped": 0}, "train": n, "paired": paired},
              "tokens": {"model": "qwen3_8b_random", "longest_sequence_of_pair": True, "train": dist,
                         "packed_pair_train": {**dist, "max": packed_longest, "mean": mean * 1.6,
                                               "total": int(n * mean * 1.6)},
                         "answer_share_train": 0.4}}
    (folder / "report.json").write_text(json.dumps(report))
    return folder


def cfg_for(tmp_path: Path, *over: str):
    return compose([MODEL, f"paths.root={tmp_path}", "data.max_length=2048", *over])


def planned(tmp_path: Path, *over: str, free_gib: float = 139.8) -> RunSettings:
    return sz_decide.decide(cfg_for(tmp_path, *over), sz_decide.Hardware("cuda", free_gib * GIB, "H200"))


# ------------------------------------------------------------------------------------------- the plan is made
@pytest.mark.parametrize("over", PADDED, ids=["orpo", "kto", "dpo-padded"])
def test_padded_preference_runs_are_planned_not_refused(over: tuple[str, ...], tmp_path: Path) -> None:
    write_pairs(tmp_path)
    cfg = cfg_for(tmp_path, f"objective={over[0]}", *over[1:])
    plan = sz_report.make_plan(cfg)
    assert not plan["settings"]["packing"] and plan["memory"]["peak_gib"] > plan["memory"]["parts_gib"]["weights"]
    assert plan["data"]["max_tokens"] == 700  # the prepared rows' longest sequence, not the packed pair (1100)
    assert plan["run"]["steps"] > 0 and plan["time_and_cost"][0]["tokens_per_second"] > 0
    said = [r for r in plan["reasons"] if "padded pairs:" in r]
    assert len(said) == 1 and said[0].endswith("(conf/plan/calibration.json)"), plan["reasons"]
    assert "padded pairs:" in sz_report.format_plan(plan)
    assert all(row["setting"] for row in plan["fit"].values() if row["gpu"] == "H200")
    json.dumps(plan)


@pytest.mark.slow  # full lane: two make plan processes (the in-process plans of ORPO/KTO stay fast)
def test_make_plan_command_prints_a_plan_for_orpo_and_kto(tmp_path: Path) -> None:
    """Before: `objective=orpo` was refused in one line (exit 2, memory not modelled)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    for name, extra in (("orpo", ["train.packing=false"]), ("orpo", []), ("kto", ["train.packing=false"]),
                        ("kto", [])):
        root = tmp_path / f"{name}{len(extra)}"
        write_pairs(root)
        proc = subprocess.run([sys.executable, "-m", "reprotune.plan", f"objective={name}", MODEL,
                               "data.max_length=2048", f"paths.root={root}", *extra], capture_output=True,
                              text=True, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr
        assert "predicted peak GPU memory" in proc.stdout
        written = json.loads((root / "outputs" / "plan.json").read_text())
        if name == "kto" and not extra:  # a GPU packs KTO's rows: each row a document of up to the longest
            assert "packed micro-batch 2800 tokens (bs 4, max_length 700)" in proc.stdout
            assert written["settings"]["packing"] and written["settings"]["kl_rows"]
        elif not extra:  # and ORPO's pairs: each pair one row of up to the longest packed pair
            assert "packed micro-batch 4400 tokens (bs 4, max_length 1100)" in proc.stdout
            assert written["settings"]["packing"] and not written["settings"]["full_logits"]
        else:
            assert written["settings"]["sequences"] == (1 if name == "kto" else 2)
            assert f"padded pairs: {name} modelled as" in proc.stdout


# ------------------------------------------------------------------------------------------------- the shapes
@pytest.mark.parametrize("over", [o for o in PADDED if o[0] != "kto"], ids=["orpo", "dpo-padded"])
def test_dpo_and_orpo_pairs_are_2b_rows_of_the_longest_sequence(over: tuple[str, ...], tmp_path: Path) -> None:
    forced = ("hardware.gradient_checkpointing=false", "train.per_device_train_batch_size=4")
    run = planned(tmp_path, f"objective={over[0]}", *over[1:], *forced)  # no prepared rows: max_length
    assert (run.planned.sequences, run.planned.batch_size) == (2, 4)
    assert run.predicted["tokens_per_micro_batch"] == 2 * 4 * 2048
    write_pairs(tmp_path, longest=700)
    run = planned(tmp_path, f"objective={over[0]}", *over[1:], *forced)
    assert run.predicted["tokens_per_micro_batch"] == 2 * 4 * 700
    # the policy's saved activations are those of 8 padded SFT rows of the same length
    sft = planned(tmp_path / "sft", "train.packing=false", "train.per_device_train_batch_size=8",
                  "hardware.gradient_checkpointing=false", "data.max_length=700")
    assert (run.predicted["parts_gib"]["activations_no_checkpointing"]
            == sft.predicted["parts_gib"]["activations_no_checkpointing"])


def test_padded_orpo_counts_the_logits_of_every_position(tmp_path: Path) -> None:
    """TRL's ORPO trainer takes outputs.logits (no fused LM head): its loss head grows with rows x vocabulary. The
    packed pairs go through TRL's fused LM head: no logits, every packed token scored (the chosen NLL)."""
    write_pairs(tmp_path, longest=700, packed_longest=1100)
    forced = ("hardware.gradient_checkpointing=true", "train.per_device_train_batch_size=4")
    orpo = planned(tmp_path, "objective=orpo", "train.packing=false", *forced)
    packed = planned(tmp_path, "objective=orpo", *forced)
    assert packed.planned.packing and not packed.planned.full_logits and packed.planned.max_length == 1100
    assert any("every token scored by the fused LM head" in r for r in packed.reasons)
    assert orpo.predicted["parts_gib"]["logits_loss"] > 5 * packed.predicted["parts_gib"]["logits_loss"]
    dpo = planned(tmp_path, "objective=dpo", "train.packing=false", *forced)
    shape = sz_shape.model_shape(cfg_for(tmp_path).model)
    logits = 2 * 4 * 700 * shape.vocab * 2  # bf16 logits of the 8 rows
    assert orpo.planned.full_logits and not dpo.planned.full_logits
    assert orpo.predicted["parts_gib"]["logits_loss"] >= 2 * logits / GIB > 5 * dpo.predicted["parts_gib"]["logits_loss"]


def test_kto_is_b_rows_with_gradients_and_a_kl_batch_without(tmp_path: Path) -> None:
    write_pairs(tmp_path, longest=700, paired=False)
    forced = ("hardware.gradient_checkpointing=false", "train.per_device_train_batch_size=4", "train.packing=false")
    run = planned(tmp_path, "objective=kto", *forced)
    s = run.planned
    assert (s.sequences, s.reference, s.kl_rows, s.full_logits) == (1, True, True, False)
    assert run.predicted["tokens_per_micro_batch"] == 4 * 700  # B completions with gradients
    # the reference over the B rows; the KL batch: B rows of a prompt and another completion (<= 2 x longest)
    assert sz_memory.no_grad_forwards(s, run_data(tmp_path, "kto")) == [(4, 700, 2800), (4, 1400, 5600)]
    assert sz_memory.no_grad_forwards(replace(s, max_length=1000), run_data(tmp_path, "kto"))[1] == (4, 1000, 4000)
    pre = planned(tmp_path, "objective=kto", "objective.precompute_ref_log_probs=true", *forced).planned
    assert not pre.reference and pre.kl_rows  # the policy's KL forward stays
    apo = planned(tmp_path, "objective=kto", "+objective.loss_type=apo_zero_unpaired", *forced).planned
    assert apo.reference and not apo.kl_rows
    # KTO unpairs a pair into two examples: paired rows give twice the examples, each one sequence
    write_pairs(tmp_path / "p", longest=700, paired=True)
    assert run_data(tmp_path / "p", "kto").examples == 200 and run_data(tmp_path / "p", "orpo").examples == 100


def test_packed_kto_rows_are_b_documents_of_the_longest_row_with_the_same_forwards(tmp_path: Path) -> None:
    """On a GPU KTO's rows are packed (reprotune.preference.packed, share_prompts=False): a micro-batch is B
    documents of up to the longest prepared row (not the packed DPO pair's length), with the reference and the
    KL batch's forwards without gradients as padded, and never one row with the KL term."""
    write_pairs(tmp_path, longest=700, paired=False, packed_longest=1100)
    forced = ("hardware.gradient_checkpointing=false", "train.per_device_train_batch_size=4")
    run = planned(tmp_path, "objective=kto", *forced)
    s = run.planned
    assert run.packing and run.attn_implementation == "pair_varlen"
    assert (s.packing, s.sequences, s.reference, s.kl_rows, s.max_length) == (True, 1, True, True, 700)
    assert run.predicted["tokens_per_micro_batch"] == 4 * 700
    assert sz_memory.no_grad_forwards(s, run_data(tmp_path, "kto")) == [(4, 700, 2800), (4, 700, 2800)]
    assert any(r.startswith("plan: an example is one packed row of up to 700 tokens") for r in run.reasons)
    assert "kto rows packed: no padding, each row one document (reprotune.preference.packed)" in run.reasons
    tight = ("train.per_device_train_batch_size=4", "hardware.memory_budget_gib=17", "hardware.embedding_on_host=false")
    assert planned(tmp_path, "objective=kto", *tight).per_device_train_batch_size == 2  # one row would fit 17 GiB
    assert planned(tmp_path, "objective=kto", "+objective.loss_type=apo_zero_unpaired", *tight
                   ).per_device_train_batch_size == 1  # without the KL term, one row


def run_data(root: Path, objective: str) -> sz_shape.DataShape:
    return sz_shape.load_data_shape(cfg_for(root, f"objective={objective}"), padded=True)


def test_kto_is_never_fitted_to_one_row(tmp_path: Path) -> None:
    """TRL's KTOTrainer refuses per_device_train_batch_size=1 with its KL term: a budget that one row would meet
    keeps two (the smallest KTO can run); without the KL term (loss_type apo_zero_unpaired) one row."""
    write_pairs(tmp_path, longest=2000, paired=False)
    # the input embedding on the GPU: on the host (hardware.embedding_on_host's auto), two rows fit 19 GiB
    budget = ("train.per_device_train_batch_size=4", "hardware.memory_budget_gib=19", "hardware.embedding_on_host=false")
    kto = planned(tmp_path, "objective=kto", *budget)
    assert (kto.per_device_train_batch_size, kto.gradient_accumulation_steps) == (2, 2)
    assert kto.activation_checkpointing and kto.predicted["card_gib"] + 0.5 > 19  # over it: nothing smaller runs
    apo = planned(tmp_path, "objective=kto", "+objective.loss_type=apo_zero_unpaired", *budget)
    assert (apo.per_device_train_batch_size, apo.gradient_accumulation_steps) == (1, 4)
    assert apo.predicted["card_gib"] + 0.5 <= 19


# ---------------------------------------------------------------------------------------------- the reference
def test_the_reference_forward_adds_no_saved_activations(tmp_path: Path) -> None:
    write_pairs(tmp_path, longest=700)
    for ckpt in ("true", "false"):
        run = planned(tmp_path, "objective=dpo", "train.packing=false", f"hardware.gradient_checkpointing={ckpt}")
        cfg = cfg_for(tmp_path, "objective=dpo", "train.packing=false")
        shape, data, consts = sz_shape.model_shape(cfg.model), run_data(tmp_path, "dpo"), sz_shape.load_table("memory.yaml")
        s = run.planned
        p = sz_shape.count_params(shape, list(s.targets), s.r, s.dora)
        with_ref, without = (sz_memory.memory(shape, p, c, data, consts) for c in (s, replace(s, reference=False)))
        assert s.reference
        for part in ("activations_checkpointing", "activations_no_checkpointing"):
            assert with_ref["parts_gib"][part] == without["parts_gib"][part]
        assert with_ref["parts_gib"]["no_grad_forward_transient"] > 0
        assert "no_grad_forward_transient" not in without["parts_gib"]
        assert 0 <= with_ref["peak_gib"] - without["peak_gib"] <= with_ref["parts_gib"]["no_grad_forward_transient"]
        # a reference with gradients would save as much again as the policy: the no-grad one costs far less
        grad_ref = sz_memory.memory(shape, p, replace(s, reference=False, sequences=4), data, consts)
        assert grad_ref["peak_gib"] - without["peak_gib"] > 4 * (with_ref["peak_gib"] - without["peak_gib"] + 0.01)


def test_a_no_grad_forward_is_counted_beside_what_the_policy_saved_only_after_its_forward(tmp_path: Path) -> None:
    """With a transient that outweighs the backward's: the reference (after the policy's forward) adds it to the
    saved activations; KTO's KL rows through the policy alone (before its forward, precompute_ref_log_probs) do
    not."""
    write_pairs(tmp_path, longest=700, paired=False)
    consts = copy.deepcopy(sz_shape.load_table("memory.yaml"))
    consts["activations"]["no_grad_forward"]["h_coef"] = 2000.0  # a transient larger than anything else
    forced = ("hardware.gradient_checkpointing=false", "train.per_device_train_batch_size=4")
    data = run_data(tmp_path, "kto")
    for over, after_forward in (((), True), (("objective.precompute_ref_log_probs=true",), False)):
        cfg = cfg_for(tmp_path, "objective=kto", *over, *forced)
        s = sz_decide.configured_settings(cfg)
        shape = sz_shape.model_shape(cfg.model)
        p = sz_shape.count_params(shape, list(s.targets), s.r, s.dora)
        mem = sz_memory.memory(shape, p, s, data, consts)
        static = sz_memory.weight_bytes(p, s, consts) + sz_memory.adapter_bytes(p, s, consts)
        no_grad = mem["parts_gib"]["no_grad_forward_transient"] * GIB
        saved = mem["parts_gib"]["activations_no_checkpointing"] * GIB
        expected = static + no_grad + (saved if after_forward else 0.0)
        assert mem["peak_allocated_bytes"] == pytest.approx(expected, rel=1e-3), over


# ------------------------------------------------------------------------------------------ refused when over
@pytest.mark.parametrize("over", PADDED, ids=["orpo", "kto", "dpo-padded"])
def test_preflight_refuses_a_padded_run_that_cannot_fit_in_one_line(over: tuple[str, ...], tmp_path: Path,
                                                                   capsys) -> None:
    write_pairs(tmp_path, longest=1800)
    cfg = cfg_for(tmp_path, f"objective={over[0]}", *over[1:], "hardware=gpu", "hardware.gradient_checkpointing=false",
                  "train.per_device_train_batch_size=8")
    with pytest.raises(SystemExit) as stop:
        sz_preflight.preflight(cfg, sz_decide.Hardware("cuda", 24 * GIB, "Test GPU"), None)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("train: preflight: predicted "), err
    assert "24.0 GiB free on Test GPU" in err and "settings that fit:" in err
    plan = json.loads((Path(cfg.paths.train_dir) / "plan.json").read_text())  # train's declared output
    assert plan["run_settings"]["fits"] is False and plan["memory"]["peak_gib"] > 24
    # the settings it names do fit that GPU: with them the preflight lets the run go on
    named = err.split("settings that fit: ")[1].rsplit(" (", 1)[0].split()
    assert "hardware.gradient_checkpointing=true" in named
    fixed = cfg_for(tmp_path, f"objective={over[0]}", *over[1:], "hardware=gpu", "train.per_device_train_batch_size=8",
                    *named)
    assert sz_preflight.preflight(fixed, sz_decide.Hardware("cuda", 24 * GIB, "Test GPU"), None).fits


def test_preflight_fits_a_padded_run_to_its_budget(tmp_path: Path) -> None:
    """hardware.gradient_checkpointing=auto: rows, accumulation and checkpointing fitted to the budget as for SFT
    rows, the global batch kept."""
    write_pairs(tmp_path, longest=700)
    batch = ("objective=orpo", "train.packing=false", "train.per_device_train_batch_size=8",
             "train.gradient_accumulation_steps=2")
    roomy, tight, tighter = (planned(tmp_path, *batch, *budget) for budget in
                             ((), ("hardware.memory_budget_gib=48",), ("hardware.memory_budget_gib=36",)))
    assert not roomy.activation_checkpointing and tight.activation_checkpointing
    assert tighter.per_device_train_batch_size < tight.per_device_train_batch_size == 8
    for run, budget in ((tight, 48), (tighter, 36)):
        assert run.predicted["card_gib"] + 0.5 <= budget < roomy.predicted["card_gib"]
    for run in (roomy, tight, tighter):
        assert run.per_device_train_batch_size * run.gradient_accumulation_steps == 16
    assert "bs 8 pairs (16 padded rows)" in sz_fit.describe(roomy.planned)


def test_packed_dpo_pairs_keep_their_model(tmp_path: Path) -> None:
    """DPO with packing (the GPU default) is modelled as before: packed rows of the longest pair, none of the
    padded batch's fields."""
    write_pairs(tmp_path, longest=700, packed_longest=1100)
    run = planned(tmp_path, "objective=dpo")
    s = run.planned
    assert s.packing and s.max_length == 1100
    assert (s.sequences, s.reference, s.kl_rows, s.full_logits) == (1, False, False, False)
    assert "no_grad_forward_transient" not in run.predicted["parts_gib"]
    assert not [r for r in run.reasons if "padded pairs:" in r]
