"""Host memory as a budget beside the card's (issue #48): hardware.host_memory_budget_gib (null: MemAvailable less
a margin where train runs), the fit offloading only the layer inputs its card cannot keep (hardware.offload_layers)
and trading offloaded inputs for recompute when the host is short, make plan's host column, the one-line refusal
naming both numbers, and the hooks that keep some layers' inputs on the GPU under TRL's offloading. No GPU: a
described card drives the CUDA branch; the hooks run on the CPU under torch's own saved_tensors_hooks."""

from __future__ import annotations

import io
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from reprotune import schema
from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.run_settings import RunSettings
from reprotune.sizing import decide as d
from reprotune.sizing.fit import overrides_for
from reprotune.sizing.host import HOST_MARGIN_GIB, host_available_bytes, host_budget
from reprotune.sizing.memory import GIB
from reprotune.sizing.preflight import preflight
from reprotune.sizing.report import format_plan, make_plan

FAST = ["repro=fast"]  # atomic dQ sums (the fits of issue #27 were made so; test_long_context.py says why)
# the fit's choice of how many layer inputs to offload (issue #48): opt-in until its GPU side is measured on a card
FEWEST = ["hardware.offload_layers=auto"]
LORA_128K = ["model=qwen3_8b", "method=lora", "data.max_length=131072", *FAST, *FEWEST]
QLORA_64K = ["model=qwen3_8b", "method=qlora", "data.max_length=65536", *FAST, *FEWEST]


def _cfg(overrides: list[str], root: Path | None = None):
    return compose(["hardware=gpu", "paths.prepared=/nonexistent", "train.per_device_train_batch_size=1",
                    "train.gradient_accumulation_steps=1", *([f"paths.root={root}"] if root else []), *overrides])


def _host(gpu: str, available_gib: float = 128) -> d.Hardware:
    """A described card on a host with `available_gib` of MemAvailable (what detect() reads on a GPU host)."""
    return d.Hardware(**{**d.card(gpu).__dict__, "host_available_bytes": available_gib * GIB})


def _decide(overrides: list[str], hw: d.Hardware) -> RunSettings:
    return d.decide(_cfg(overrides), hw, None, None)


# ------------------------------------------------------------------------------------------------ the budget
def test_the_default_budget_reads_memavailable_less_the_margin(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   52428800 kB\n")
    assert host_available_bytes(meminfo=meminfo) == 50 * GIB
    assert host_available_bytes(2, meminfo=meminfo) == 25 * GIB  # shared by the run's processes
    assert host_available_bytes(meminfo=tmp_path / "absent") is None
    null, auto = _cfg([]), _cfg(["hardware.host_memory_budget_gib=auto"])
    assert host_budget(null, 50 * GIB) == host_budget(auto, 50 * GIB) == (50 - HOST_MARGIN_GIB) * GIB
    assert host_budget(null, None) is None  # a described card's host: not checked
    assert host_budget(_cfg(["hardware.host_memory_budget_gib=20"]), 50 * GIB) == 20 * GIB
    assert host_budget(_cfg(["hardware.host_memory_budget_gib=100"]), 50 * GIB) == 50 * GIB  # never over what is free
    assert host_budget(_cfg(["hardware.host_memory_budget_gib=100"]), None) == 100 * GIB
    real = host_available_bytes()
    if Path("/proc/meminfo").is_file():
        assert real is not None and real > 0


def test_the_default_budget_is_what_the_decision_checks() -> None:
    """With the budget null, the decision's host budget is MemAvailable - the margin of the host it is given, and
    the plan's reason names it."""
    run = _decide(LORA_128K, _host("H100", 64))
    assert run.host_budget_bytes == (64 - HOST_MARGIN_GIB) * GIB
    assert any(f"of a {64 - HOST_MARGIN_GIB:.1f} GiB host budget" in r for r in run.reasons), run.reasons
    assert _decide(LORA_128K, d.card("H100")).host_budget_bytes is None


def test_the_keys_are_checked_at_the_door() -> None:
    assert schema.problems(_cfg(["hardware.host_memory_budget_gib=0"])) == [
        "hardware.host_memory_budget_gib: 0 is not one of auto, a number > 0"]
    assert schema.problems(_cfg(["hardware.offload_layers=0"])) == [
        "hardware.offload_layers: 0 is not one of auto, an integer >= 1"]
    assert schema.problems(_cfg(["hardware.offload_layers=12", "hardware.host_memory_budget_gib=48.5"])) == []
    with pytest.raises(ReprotuneError, match=r"^hardware.offload_layers=40: the model has 36 decoder layers"):
        _decide([*LORA_128K, "hardware.offload_layers=40"], _host("H100"))
    with pytest.raises(ReprotuneError, match=r"^hardware.offload_layers=4: hardware.activation_offloading=false"):
        _decide([*LORA_128K, "hardware.offload_layers=4", "hardware.activation_offloading=false"], _host("H100"))


# ------------------------------------------------------------------------------------------------ the fit
def test_the_card_before_the_host() -> None:
    """128k LoRA on an 80 GB card: the fit offloads only the inputs the card cannot keep (22 of 36), and each one
    kept on the GPU is one less on the host than offloading all of them."""
    run = _decide(LORA_128K, _host("H100"))
    assert run.fits and run.activation_offloading and 0 < run.offload_layers < 36
    assert run.predicted["offloaded_layers"] == run.offload_layers == run.planned.offload_layers
    assert run.predicted["card_gib"] <= 79.2 - 0.5
    everything = _decide([*LORA_128K, "hardware.offload_layers=36"], _host("H100"))
    assert everything.predicted["offloaded_layers"] == 36
    block = 131072 * 4096 * 2  # one bf16 layer input of 128k tokens: 1 GiB, a power of two already
    kept = 36 - run.offload_layers
    assert everything.predicted["host_offload_gib"] - run.predicted["host_offload_gib"] == kept * block / GIB
    assert everything.predicted["card_gib"] < run.predicted["card_gib"]
    assert any(f"the inputs of {run.offload_layers} of 36 layers" in r for r in run.reasons), run.reasons
    # the default (null) offloads every layer's input, as measured on cards: the same as offload_layers=36
    default = _decide([x for x in LORA_128K if x not in FEWEST], _host("H100"))
    assert default.activation_offloading and default.offload_layers == 0
    assert default.predicted["offloaded_layers"] == 36
    assert default.predicted["host_offload_gib"] == everything.predicted["host_offload_gib"]
    assert f"hardware.offload_layers={run.offload_layers}" in overrides_for(run.planned, d.configured_settings(
        _cfg(LORA_128K), _host("H100")))


def test_a_smaller_host_budget_offloads_less_and_recomputes_more() -> None:
    """With the host free, 128k LoRA on 80 GB offloads 22 inputs and runs the MLP whole (27 GiB of host); with a
    20 GiB host budget the fit tiles the MLP (one more MLP forward per layer: recomputed) so that the card keeps
    all but 4 inputs, 9 GiB of host; its predicted speed is lower, which is why it is not the pick with room."""
    roomy = _decide(LORA_128K, _host("H100"))
    short = _decide([*LORA_128K, "hardware.host_memory_budget_gib=20"], _host("H100"))
    assert roomy.fits and short.fits
    assert roomy.predicted["host_offload_gib"] > 20 >= short.predicted["host_offload_gib"]
    assert short.offload_layers < roomy.offload_layers
    assert short.tiled_mlp_tokens and not roomy.tiled_mlp_tokens
    from reprotune.sizing.shape import load_table, model_shape
    from reprotune.sizing.throughput import model_tokens_per_second

    shape, tp = model_shape(_cfg(LORA_128K).model), load_table("throughput.yaml")
    assert model_tokens_per_second(shape, short.planned, None, tp) < model_tokens_per_second(shape, roomy.planned,
                                                                                             None, tp)


def _refusal(overrides: list[str], root: Path) -> str:
    """train's preflight on a 24 GB card of a 128 GiB host: its one line on stderr (exit 2)."""
    err = io.StringIO()
    with redirect_stderr(err), pytest.raises(SystemExit) as stop:
        preflight(_cfg(overrides, root), _host("RTX 4090"), None)
    lines = err.getvalue().strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1, lines
    return lines[0]


def test_a_host_budget_too_small_refuses_in_one_line_naming_both_numbers(tmp_path: Path) -> None:
    """64k QLoRA on a 24 GB card (22 GiB budget) needs 18 GiB of host memory at its fastest and 22 at its smallest
    on the card (every input offloaded, 4,096-token tiles): a 16 GiB host budget fits neither, and train's preflight
    stops with one line naming the card's need and budget and the host's, and the overrides that fit both if the
    run may take the whole card (23.5 GiB free); with 8 GiB of host nothing fits at all."""
    line = _refusal([*QLORA_64K, "hardware.host_memory_budget_gib=16"], tmp_path)
    assert line.startswith("train: preflight: nothing fits both budgets on RTX 4090: the smallest setting ("), line
    assert "needs 15.44 GiB of the card (budget 22.0 GiB) and 22.0 GiB of host memory" in line, line
    assert "(host budget 16.0 GiB (hardware.host_memory_budget_gib))" in line, line
    assert "; settings that fit: " in line and "hardware.offload_layers=" in line, line
    none = _refusal([*QLORA_64K, "hardware.host_memory_budget_gib=8"], tmp_path)
    assert "and 22.0 GiB of host memory (host budget 8.0 GiB" in none, none
    assert none.endswith("; a larger host budget, a shorter train.max_length, or a larger card"), none
    fits = _decide([*QLORA_64K, "hardware.host_memory_budget_gib=24"], _host("RTX 4090"))
    assert fits.fits and fits.predicted["host_offload_gib"] <= 24


# ------------------------------------------------------------------------------------------------ make plan
def test_make_plan_shows_the_host_beside_the_gpu(tmp_path: Path) -> None:
    """Every card's row: GPU peak, what it takes of the card, and the pinned host memory against the budget; the
    main line says the budget (or that a described card's host is not checked)."""
    cfg = _cfg([*QLORA_64K, "hardware.host_memory_budget_gib=100"], tmp_path)
    plan = make_plan(cfg)
    text = format_plan(plan)
    rows = [line for line in text.splitlines() if line.strip().split(" ")[0] in ("24", "40", "48", "80", "141")]
    assert len(rows) == 5 and all(" GiB peak (" in r and ", host " in r and " of 100.0" in r for r in rows), rows
    row24 = next(r for r in rows if r.strip().startswith("24 GB"))
    assert "offloaded to host" in row24 and f"host {plan['fit']['24 GB']['host_gib']} GiB of 100.0" in row24
    assert plan["fit"]["24 GB"]["host_gib"] > 10
    assert "host memory (pinned offload): " in text and "of a 100.0 GiB host budget" in text
    unset = format_plan(make_plan(_cfg(QLORA_64K, tmp_path)))
    assert "host budget not checked for a described card" in unset
    short = format_plan(make_plan(_cfg([*QLORA_64K, "hardware.host_memory_budget_gib=16"], tmp_path)))
    row = next(line for line in short.splitlines() if line.strip().startswith("24 GB"))
    assert "does not fit" in row and "of the card (budget 22.0 GiB)" in row and "host budget 16.0 GiB" in row, row


# ------------------------------------------------------------------------------------------------ the hooks
def _tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _step(model, offloaded: int) -> tuple[set[int], list[int], list]:
    """One forward and backward under an outer saved_tensors_hooks (what TRL's OffloadActivations is): the storages
    it was handed, each decoder layer's input storage, and the gradients."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from reprotune.offload_layers import decoder_layers, keep_layer_inputs

    packed: set[int] = set()
    inputs: list[int] = []
    handles = [layer.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].data_ptr()))
               for layer in decoder_layers(model)]

    def pack(t):
        packed.add(t.data_ptr())
        return t

    ids = torch.arange(24).reshape(2, 12) % 128
    model.zero_grad()
    with keep_layer_inputs(model, offloaded) as kept:
        assert kept == (0 if offloaded in (0, 4) else 4 - offloaded)
        with saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    for h in handles:
        h.remove()
    return packed, inputs, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_only_the_first_layers_inputs_reach_the_offloading_hooks() -> None:
    """The checkpointed layers' inputs are what offloading moves; with offload_layers=2 of 4 only layers 0 and 1
    hand theirs to the outer hooks, the others keep theirs; the gradients are the same bits either way, and the
    hooks are gone afterwards."""
    import torch

    model = _tiny_llama()
    packed_all, inputs_all, grads_all = _step(model, 0)
    assert all(ptr in packed_all for ptr in inputs_all)  # every layer input saved under the outer hooks
    packed, inputs, grads = _step(model, 2)
    assert [ptr in packed for ptr in inputs] == [True, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(grads_all, grads, strict=True))
    assert len(packed) < len(packed_all)
    again, inputs_again, _ = _step(model, 0)  # the hooks were removed: all four inputs offloaded again
    assert all(ptr in again for ptr in inputs_again)
