"""Long context on one card (issue #27): the tiled MLP computes what the whole MLP computes and keeps less for the
backward, a run with it reruns to the same bytes, and the plan reaches for offloading and tiles only when a run
would not fit otherwise, counting the host memory offloading takes. Activation offloading itself (TRL's
OffloadActivations) moves GPU tensors only, so its numbers are checked on the GPU (tests/test_long_context_gpu.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.models import load_base_model, resolve_model_dir
from reprotune.run_settings import RunSettings
from reprotune.sizing import decide as d
from reprotune.sizing.fit import describe
from reprotune.tiled_mlp import tiled_mlp
from reprotune.train import lora_config, train

from .families import family_params

GIB = 2**30


def _lora_model(preset: str, root: Path):
    from peft import get_peft_model

    cfg = compose([f"model={preset}", "hardware=cpu", f"paths.root={root}", "method.lora_dropout=0.0"])
    model = load_base_model(resolve_model_dir(cfg.model, cfg.paths.model_cache), cfg, "cpu", "float32", None)
    torch.manual_seed(0)
    model = get_peft_model(model, lora_config(cfg))
    for name, p in model.named_parameters():  # LoRA's B starts at zero: move it so every adapter has a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _loss_and_grads(model, ids: torch.Tensor, tile: int) -> tuple[float, dict]:
    """Loss and adapter gradients with the MLP over `tile`-token tiles (0: whole)."""
    model.zero_grad(set_to_none=True)
    with tiled_mlp(model, tile):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


@pytest.mark.parametrize("preset", family_params(fast=("qwen3",)))
def test_tiled_mlp_gives_the_whole_mlps_loss_and_gradients(preset: str, tmp_path: Path) -> None:
    """fp32 on the CPU: the tiles' products are the same products on fewer rows, so loss and every adapter
    gradient agree to 1e-5 relative (and 1e-7 absolute); and the forward keeps less for the backward (the
    intermediate-wide tensors are rebuilt there, a tile at a time), the point of tiling."""
    model = _lora_model(preset, tmp_path)
    torch.manual_seed(1)
    ids = torch.randint(0, 1000, (2, 96))
    loss, grads = _loss_and_grads(model, ids, 0)
    t_loss, t_grads = _loss_and_grads(model, ids, 32)  # three tiles per row
    assert grads.keys() == t_grads.keys() and any("mlp" in n for n in grads)
    assert t_loss == pytest.approx(loss, rel=1e-6)
    for name, g in grads.items():
        torch.testing.assert_close(t_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    mlp = next(m for n, m in model.named_modules() if n.endswith("layers.0.mlp"))
    x = torch.randn(2, 96, model.config.hidden_size, requires_grad=True)
    kept = {tile: _mlp_saved_bytes(mlp, x, tile, model) for tile in (0, 32)}
    assert kept[32] <= x.numel() * x.element_size() < kept[0] / 2, kept  # the input's tiles alone


def _mlp_saved_bytes(mlp, x: torch.Tensor, tile: int, model) -> int:
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with tiled_mlp(model, tile), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mlp(x)
    return sum(saved)


def test_the_gradient_check_catches_a_dropped_tile(tmp_path: Path) -> None:
    """Control for the check above: a tiling that loses the last tile's MLP output (zeros in its place) is told
    apart at once by the same tolerance."""
    from reprotune import tiled_mlp as tm

    model = _lora_model("tiny_random_qwen3", tmp_path)
    ids = torch.randint(0, 1000, (2, 96))
    _, grads = _loss_and_grads(model, ids, 0)
    original = tm.tiled

    def lossy(forward, tile):
        whole = original(forward, tile)

        def run(x):
            out = whole(x)
            return torch.cat([out[..., :-tile, :], torch.zeros_like(out[..., -tile:, :])], dim=-2)
        return run

    tm.tiled = lossy
    try:
        _, bad = _loss_and_grads(model, ids, 32)
    finally:
        tm.tiled = original
    with pytest.raises(AssertionError):
        for name, g in grads.items():
            torch.testing.assert_close(bad[name], g, rtol=1e-5, atol=1e-7)


def test_tiled_mlp_restores_the_model(tmp_path: Path) -> None:
    model = _lora_model("tiny_random", tmp_path)
    mlps = [m for n, m in model.named_modules() if n.endswith("mlp")]
    with tiled_mlp(model, 16) as n:
        assert n == len(mlps) > 0 and all("forward" in vars(m) for m in mlps)
    assert not any("forward" in vars(m) for m in mlps)


@pytest.mark.slow  # a full training or NER pass: the full lane (make test-all, CI); make test stays <= 3 min
def test_a_tiled_run_reruns_to_the_same_bytes_and_records_the_tile(workspace: tuple[Path, list[str]]) -> None:
    """A CPU training run with hardware.tiled_mlp=true (tiles of 64 tokens: the invoices are 200-300 long)
    reruns to the same adapter bytes; the manifest says the tile; the loss is the untiled run's to 1e-5."""
    _, overrides = workspace
    common = ["model=tiny_random", "train.max_steps=2", "train.logging_steps=1", "method.lora_dropout=0.0",
              *overrides]
    tiled = [*common, "hardware.tiled_mlp=true", "hardware.tiled_mlp_tokens=64"]
    root = Path(overrides[0].split("=", 1)[1])
    first = train(compose(tiled))
    tiled_loss = json.loads((root / "outputs/train/metrics.json").read_text())["final_train_loss"]
    second = train(compose(tiled))
    assert first["outputs"]["adapter"]["sha256"] == second["outputs"]["adapter"]["sha256"]
    assert first["run_settings"]["tiled_mlp_tokens"] == 64
    assert first["run_settings"]["activation_offloading"] is False
    whole = train(compose(common))
    assert whole["run_settings"]["tiled_mlp_tokens"] == 0
    final = json.loads((root / "outputs/train/metrics.json").read_text())["final_train_loss"]
    assert final == pytest.approx(tiled_loss, rel=1e-5)


# ------------------------------------------------------------------------------------------------ the plan
def _decide(overrides: list[str], hw: d.Hardware) -> RunSettings:
    cfg = compose(["hardware=gpu", "paths.prepared=/nonexistent", "train.per_device_train_batch_size=1",
                   "train.gradient_accumulation_steps=1", *overrides])
    return d.decide(cfg, hw, None, None)


# FlashAttention's deterministic backward (the default on CUDA, issue #51) keeps ceil(SMs / (sequences x heads))
# fp32 dQ sums: one 96k sequence on a 24 GB card's 128 SMs gets 4 of 1.5 GiB. The long-context fits of issue #27
# were made with atomic adds, which repro=fast keeps.
FAST = ["repro=fast"]


def test_96k_qlora_fits_a_24_gb_card_with_offloading_and_tiles() -> None:
    run = _decide(["model=qwen3_8b", "method=qlora", "data.max_length=98304", *FAST], d.card("RTX 4090"))
    assert run.fits and run.activation_checkpointing and run.activation_offloading and run.tiled_mlp_tokens
    assert run.predicted["card_gib"] <= 22.0 and run.predicted["host_offload_gib"] > 20
    assert any("activation offloading" in r for r in run.reasons) and any("tiles" in r for r in run.reasons)


def test_the_deterministic_backward_counts_its_dq_sums() -> None:
    """Default vs repro=fast, 96k QLoRA: the backward transient differs by exactly (splits - 1) fp32 copies of dQ
    (H100: ceil(132 / 32) = 5 sums, the 6.0 GiB measured between 22.85 and 16.84 GiB peaks); a packed batch of
    many short sequences (the built-in SFT shape) needs no extra sum; the 24 GB card no longer fits the default."""
    args = ["model=qwen3_8b", "method=qlora", "data.max_length=98304", "hardware.tiled_mlp_tokens=16384"]
    for card, splits in (("H100", 5), ("RTX 4090", 4)):
        default, fast = (_decide([*args, *extra], d.card(card)) for extra in ([], FAST))
        extra_gib = (splits - 1) * (98304 + 128) * 32 * 128 * 4 / GIB
        delta = default.predicted["parts_gib"]["backward_transient"] - fast.predicted["parts_gib"]["backward_transient"]
        assert abs(delta - extra_gib) < 0.01, (card, delta, extra_gib)
    assert not _decide(args, d.card("RTX 4090")).fits
    short = ["model=qwen3_8b", "method=lora", "data.max_length=4096", "train.per_device_train_batch_size=8"]
    same = [_decide([*short, *extra], d.card("H100")).predicted["parts_gib"]["backward_transient"]
            for extra in ([], FAST)]
    assert same[0] == same[1]


def test_the_fit_takes_the_largest_tile_that_fits_and_a_named_one() -> None:
    """16,384-token tiles ran faster than 4,096 (96k QLoRA on the H200: 2,012 vs 1,969 tok/s) and keep more: the
    fit takes the large tile where it fits, the small one where only that fits, never a tile the whole sequence
    fits in (it would change nothing), and exactly hardware.tiled_mlp_tokens when that is set."""
    card = d.card("RTX 4090")
    qlora = ["model=qwen3_8b", "method=qlora", *FAST]
    assert _decide([*qlora, "data.max_length=98304"], card).tiled_mlp_tokens == 16384
    tight = _decide([*qlora, "data.max_length=114688"], card)  # 112k: only the 4,096-token tiles fit
    assert tight.fits and tight.tiled_mlp_tokens == 4096, tight.reasons
    named = _decide([*qlora, "data.max_length=98304", "hardware.tiled_mlp_tokens=8192"], card)
    assert named.fits and named.tiled_mlp_tokens == 8192 and named.predicted["card_gib"] <= 22.0
    for rows, length in ((1, 12288), (4, 4096)):  # sequences of 12,288 and 16,384 tokens: no 16,384 tile
        run = _decide(["model=qwen3_8b", "method=lora", f"data.max_length={length}",
                       f"train.per_device_train_batch_size={rows}"], card)
        assert run.tiled_mlp_tokens in (0, 4096), (rows, length, run.reasons)


def test_the_techniques_come_only_when_needed_and_in_order() -> None:
    """16k QLoRA fits a 24 GB card checkpointed alone; 48k needs the layer inputs offloaded; 96k also the tiled
    MLP; a 16-bit LoRA of 96k on the H200 (its budget: 90% of the card, QLoRA's is a 24 GB card's) none of them."""
    picks = {n: _decide(["model=qwen3_8b", "method=qlora", f"data.max_length={n}", *FAST], d.card("RTX 4090"))
             for n in (16384, 49152, 98304)}
    assert [(p.activation_offloading, bool(p.tiled_mlp_tokens)) for p in picks.values()] == [
        (False, False), (True, False), (True, True)]
    h200 = _decide(["model=qwen3_8b", "method=lora", "data.max_length=98304"], d.card("H200"))
    assert h200.fits and h200.activation_checkpointing
    assert not h200.activation_offloading and not h200.tiled_mlp_tokens


def test_256k_lora_fits_80_gb() -> None:
    run = _decide(["model=qwen3_8b", "method=lora", "data.max_length=262144"], d.card("H100"))
    assert run.fits and run.activation_offloading and run.tiled_mlp_tokens
    assert describe(run.planned).startswith("lora, checkpointing on, activations offloaded to host, MLP in")


def test_too_little_host_memory_for_offloading_refuses() -> None:
    """The offloaded layer inputs of 96k tokens take ~35 GiB of pinned host memory: a host with 16 GiB free
    cannot hold them, and no setting fits the card without offloading."""
    card = d.card("RTX 4090")
    small_host = d.Hardware(**{**card.__dict__, "host_available_bytes": 16 * GIB})
    run = _decide(["model=qwen3_8b", "method=qlora", "data.max_length=98304"], small_host)
    assert not run.fits and run.fallback is None


def test_a_forced_switch_is_kept_and_cpu_offloading_is_one_line() -> None:
    off = _decide(["model=qwen3_8b", "method=qlora", "data.max_length=98304", "hardware.activation_offloading=false"],
                  d.card("RTX 4090"))
    assert not off.activation_offloading and not off.fits
    trl_key = _decide(["model=qwen3_8b", "method=qlora", "data.max_length=16384",
                       "+train.activation_offloading=true"], d.card("H200"))
    assert trl_key.activation_offloading  # TRL's own key, passed through by hand, counts as the switch
    with pytest.raises(ReprotuneError, match="hardware.activation_offloading=true: .* this run is on cpu"):
        d.decide(compose(["model=tiny_random", "hardware=cpu", "hardware.activation_offloading=true"]),
                 d.Hardware("cpu"), None, None)


@pytest.mark.slow  # full lane: the train stage in its own process
def test_offloading_on_a_cpu_run_is_one_line_through_the_stage(workspace: tuple[Path, list[str]]) -> None:
    import subprocess
    import sys

    _, overrides = workspace
    done = subprocess.run([sys.executable, "-m", "reprotune.train", "model=tiny_random", "hardware=cpu",
                           "hardware.activation_offloading=true", *overrides], capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in done.stderr.splitlines() if "activation_offloading" in line]
    assert done.returncode == 2 and len(lines) == 1 and "this run is on cpu" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_make_plan_names_the_technique(tmp_path: Path) -> None:
    from reprotune.sizing.report import format_plan, make_plan

    cfg = compose(["model=qwen3_8b", "method=qlora", "hardware=gpu", f"paths.root={tmp_path}",
                   "data.max_length=98304", "train.per_device_train_batch_size=1",
                   "train.gradient_accumulation_steps=1", *FAST])
    text = format_plan(make_plan(cfg))
    row = next(line for line in text.splitlines() if line.strip().startswith("24 GB"))
    assert "offloaded to host" in row and "tiles" in row, row
