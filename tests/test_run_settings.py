"""One decision per run (reprotune.sizing.decide): make plan's pick and make train's pick are the same on every
model preset x method x card, and the same as before the decision was made in one place (tests/golden/run_picks.json,
recorded from the code that had make plan and the preflight decide separately; four 24 GB picks re-recorded after
the Mistral-7B calibration run moved the Liger SwiGLU rule from -2.0 to -1.8 bytes, all to more checkpointing; the
45 gemma3_270m rows recorded when that preset was added, from the one decision; 42 "long"/"huge" rows re-recorded
for issue #27, all toward activation offloading and the tiled MLP, 12 of them runs that used to be refused; two
re-recorded when the tiles' own cost was measured (8B Llama-shape LoRA/DoRA, 4x4096 rows, 24 GB: 2 rows without
offloading instead of 4 offloaded rows in 4,096-token tiles); 34 "huge" (32k-token) rows re-recorded when the
memory model counted FlashAttention's deterministic backward's dQ accumulators (issue #51: ceil(SMs / (sequences x
heads)) fp32 copies of dQ; a micro-batch of one or two 32k sequences gets several), all toward more checkpointing,
offloading, or a stop with QLoRA suggested; 39 offloading rows re-recorded for issue #48, the card before the host:
each offloads only the first layers' inputs that its card cannot keep, every other choice the same). No GPU:
a described card drives the CUDA branch."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from reprotune.config import CONF_DIR, compose
from reprotune.errors import ReprotuneError
from reprotune.run_settings import RunSettings
from reprotune.sizing import decide as d
from reprotune.sizing.fit import describe
from reprotune.sizing.preflight import preflight, train_shape
from reprotune.sizing.report import make_plan
from reprotune.sizing.shape import load_tables

REPO = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((Path(__file__).parent / "golden" / "run_picks.json").read_text())
MODELS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
CARDS = load_tables()["throughput"]["cards"]  # {24: "RTX 4090", ...}
# the default train group, and two longer contexts that need checkpointing, fewer rows, or do not fit at all
VARIANTS = {"default": [], "long": ["train.max_length=4096", "train.per_device_train_batch_size=4",
                                    "train.gradient_accumulation_steps=4"],
            "huge": ["train.max_length=32768", "train.per_device_train_batch_size=2",
                     "train.gradient_accumulation_steps=1"]}


def _cfg(model: str, method: str, variant: str, tmp: Path | None = None):
    return compose([f"model={model}", f"method={method}", "hardware=gpu", "paths.prepared=/nonexistent",
                    *([f"paths.root={tmp}"] if tmp else []), *VARIANTS[variant]])


def _golden_row(pick: RunSettings) -> dict:
    return {"pick": describe(pick.planned)} if pick.fits else {"stops": True, "fits_with": describe(pick.fallback)
                                                                if pick.fallback else None}


def _train_pick(cfg, gpu: str) -> tuple[RunSettings | None, str]:
    """What make train decides on `gpu`: train.train's own call, preflight(cfg, this GPU, train_shape(...)), with
    a model folder holding no config.json (the presets carry their shape). (settings, "") where it fits; (None,
    its one-line refusal) where it stops."""
    stderr = io.StringIO()
    try:
        with redirect_stderr(stderr):
            return preflight(cfg, d.card(gpu), train_shape(cfg, "/nonexistent")), ""
    except SystemExit as stop:
        assert stop.code == 2
        return None, stderr.getvalue().strip()


# every preset and method in the full lane (make test-all, CI); the fast lane (make test) keeps the 8B Qwen3's
# QLoRA (each case runs make_plan once per card inside the preflight: ~6 CPU seconds)
FAST_MODELS = ("qwen3_8b",)


@pytest.mark.parametrize("method", ["qlora", pytest.param("lora", marks=pytest.mark.slow),
                                    pytest.param("dora", marks=pytest.mark.slow)])
@pytest.mark.parametrize("model", [m if m in FAST_MODELS else pytest.param(m, marks=pytest.mark.slow) for m in MODELS])
def test_make_plan_and_make_train_pick_the_same_on_every_card(model: str, method: str, tmp_path: Path) -> None:
    """The two entry points, each as its command calls it: make plan's make_plan(cfg) (all `python -m
    reprotune.plan` computes before it prints and writes it; it describes the cards) and make train's preflight on
    each card. The plan's row for a card is the setting train takes there, train's outputs/train/plan.json holds
    the same fit table, and both are the recorded pick."""
    for variant in VARIANTS:
        cfg = _cfg(model, method, variant, tmp_path / variant)
        plan_fit = make_plan(cfg)["fit"]
        for size, gpu in CARDS.items():
            key, row = f"{model}/{method}/{variant}/{size}", plan_fit[f"{size} GB"]
            train, refusal = _train_pick(cfg, gpu)
            if train is None:  # train stops there; make plan says so and suggests the same overrides
                assert row["setting"] is None and {"stops": True, "fits_with": row["fits_with"]} == GOLDEN[key], key
                assert (" ".join(row["overrides"]) in refusal) if row["overrides"] else "nothing fits" in refusal, key
                continue
            assert _golden_row(train) == GOLDEN[key], key
            assert row["setting"] == describe(train.planned), key
            assert (train.per_device_train_batch_size, train.gradient_accumulation_steps,
                    train.activation_checkpointing) == (train.planned.batch_size, train.planned.grad_accum,
                                                        train.planned.checkpointing), key
            written = json.loads((Path(cfg.paths.train_dir) / "plan.json").read_text())
            assert written["fit"] == plan_fit, key


def test_the_preflight_takes_the_plans_pick_and_writes_it(tmp_path: Path) -> None:
    """The preflight itself on a described 24 GB card: the 8B QLoRA long-context run is make plan's 24 GB row, and
    outputs/train/plan.json records that setting, and so does `python -m reprotune.plan` (make plan) with the same
    overrides, as its own process; a LoRA that cannot fit stops with the overrides that would."""
    cfg = _cfg("qwen3_8b_random", "qlora", "long", tmp_path)
    run = preflight(cfg, d.card("RTX 4090"), None)
    written = json.loads((tmp_path / "outputs" / "train" / "plan.json").read_text())
    assert describe(run.planned) == GOLDEN["qwen3_8b_random/qlora/long/24"]["pick"] == written["fit"]["24 GB"]["setting"]
    command = subprocess.run([sys.executable, "-m", "reprotune.plan", "model=qwen3_8b_random", "method=qlora",
                              "hardware=gpu", "paths.prepared=/nonexistent", f"paths.root={tmp_path}",
                              *VARIANTS["long"]], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert command.returncode == 0, command.stderr[-2000:]
    assert json.loads((tmp_path / "outputs" / "plan.json").read_text())["fit"] == written["fit"]
    assert written["settings"]["batch_size"] == run.per_device_train_batch_size
    assert any(r.startswith("plan: ") for r in run.reasons)
    too_long = compose(["model=mistral_7b_random", "method=lora", "hardware=gpu", "paths.prepared=/nonexistent",
                        f"paths.root={tmp_path}", "train.max_length=262144", "train.per_device_train_batch_size=1",
                        "train.gradient_accumulation_steps=1"])
    with pytest.raises(SystemExit) as stop:  # (32k fits since issue #27: offloaded, the MLP in tiles)
        preflight(too_long, d.card("RTX 4090"), None)
    assert stop.value.code == 2


def test_liger_is_planned_only_where_it_runs() -> None:
    """A CUDA host without liger-kernel: the run uses unfused kernels, and so does the memory it is fitted to."""
    cfg = _cfg("qwen3_8b_random", "lora", "long")
    with_liger = d.decide(cfg, d.card("H100"), None, None)
    bare = d.decide(cfg, d.Hardware("cuda", with_liger.budget_bytes / 0.9, "H100", liger_installed=False), None, None)
    assert with_liger.liger and with_liger.planned.liger
    assert not bare.liger and not bare.planned.liger and "liger-kernel not installed" in " ".join(bare.reasons)
    assert bare.predicted["peak_gib"] != with_liger.predicted["peak_gib"]


@pytest.mark.slow  # full lane: decides 30 runs
def test_llama_style_norms_run_torchs_fused_kernel_where_liger_runs() -> None:
    """hardware.norm_kernel: auto = torch's fused rms_norm for a preference run's Llama-style norms, with Liger's
    other kernels (a DPO step waits on the host: docs/preference.md), Liger's for SFT and for Gemma's (1 + weight)
    norm, the model's own without Liger; the run's reasons say which; a value outside the list is one line."""
    def pick(model: str, *extra: str, hw: d.Hardware | None = None) -> RunSettings:
        return d.decide(compose([f"model={model}", "hardware=gpu", *extra]), hw or d.card("H100"), None, None)

    for model in ("qwen3_8b_random", "llama32_1b_random", "mistral_7b_random", "tiny_random_qwen3"):
        for objective in ("dpo", "orpo", "kto"):
            run = pick(model, f"objective={objective}")
            assert run.norm_kernel == "torch" and "torch's fused rms_norm" in " ".join(run.reasons), model
        assert pick(model).norm_kernel == "liger", model  # SFT
        assert pick(model, "hardware.norm_kernel=torch").norm_kernel == "torch", model
    assert pick("tiny_random_gemma3", "objective=dpo").norm_kernel == "liger"
    assert pick("tiny_random", "objective=dpo").norm_kernel == "torch"  # the flat random_init form is a Llama
    assert pick("qwen3_8b_random", "objective=dpo", "hardware.norm_kernel=liger").norm_kernel == "liger"
    assert pick("qwen3_8b_random", "objective=dpo", "hardware.liger_kernel=false").norm_kernel == "eager"
    assert d.decide(compose(["model=tiny_random", "hardware=cpu"]), d.Hardware("cpu"), None, None).norm_kernel == "eager"
    with pytest.raises(ReprotuneError, match=r"^hardware.norm_kernel: 'triton' is not one of auto, liger, torch$"):
        pick("qwen3_8b_random", "hardware.norm_kernel=triton")


def test_torch_rms_norm_computes_what_the_models_norm_does() -> None:
    """train.use_torch_rms_norm swaps every Llama-style norm of a model (Qwen3: 4 a layer and the final one) and
    leaves others alone; in float32 its outputs and gradients are the module's own (to rounding)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from reprotune.train import use_torch_rms_norm

    config = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    assert use_torch_rms_norm(AutoModelForCausalLM.from_config(config)) == 4 * 3 + 1
    torch.manual_seed(0)
    eager, fused = Qwen3RMSNorm(64, eps=1e-6), Qwen3RMSNorm(64, eps=1e-6)
    eager.weight.data.uniform_(0.5, 1.5)
    fused.load_state_dict(eager.state_dict())
    wrapper = torch.nn.Sequential(fused, torch.nn.LayerNorm(64))
    assert use_torch_rms_norm(wrapper) == 1 and "forward" not in vars(wrapper[1])
    x = torch.randn(3, 7, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    (eager(x) ** 2).sum().backward()
    (fused(x2) ** 2).sum().backward()
    torch.testing.assert_close(fused(x2), eager(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.weight.grad, eager.weight.grad, rtol=1e-5, atol=1e-5)


def test_off_cuda_nothing_is_fitted() -> None:
    cfg = compose(["model=tiny_random", "hardware=cpu"])
    run = d.decide(cfg, d.Hardware("cpu"), None, None)
    assert (run.packing, run.attn_implementation, run.liger, run.fused_lora, run.activation_checkpointing) == \
        (False, None, False, False, False)
    assert run.dtype == "float32" and run.budget_bytes is None and run.fits
    assert (run.per_device_train_batch_size, run.gradient_accumulation_steps) == \
        (int(cfg.train.per_device_train_batch_size), int(cfg.train.gradient_accumulation_steps))


def test_preference_pairs_on_a_gpu_take_the_varlen_kernel_in_every_mode() -> None:
    """DPO's pairs and KTO's rows are packed on the GPU (reprotune.preference.packed): the varlen kernel over the
    pair layout, in every repro mode (its backward is deterministic under default and strict); TRL 1.16 pads ORPO's
    pairs (and DPO's and KTO's with packing off): on CUDA the varlen kernel unpads each row from its mask, so no
    attention runs over padding; SFT's unpacked rows keep the library default."""
    def run(*overrides: str) -> RunSettings:
        cfg = compose(["model=qwen3_8b", "hardware=gpu", "paths.prepared=/nonexistent", *overrides])
        return d.decide(cfg, d.card("H200"), None, None)

    assert run("objective=dpo").attn_implementation == "pair_varlen" and run("objective=dpo").packing
    assert run("objective=dpo", "repro=strict").attn_implementation == "pair_varlen"
    assert run("objective=dpo", "repro=fast").attn_implementation == "pair_varlen"
    assert run("objective=dpo", "train.packing=false").attn_implementation == "varlen_attention"
    assert run("objective=dpo", "train.packing=false", "repro=strict").attn_implementation == "varlen_attention"
    # KTO's rows packed on the GPU too, each a document (the CPU keeps TRL's padded batch unless asked)
    assert run("objective=kto").attn_implementation == "pair_varlen" and run("objective=kto").packing
    assert run("objective=kto", "repro=strict").attn_implementation == "pair_varlen"
    assert run("objective=kto", "train.packing=false").attn_implementation == "varlen_attention"
    cpu = d.decide(compose(["model=tiny_random", "hardware=cpu", "objective=kto"]), d.Hardware("cpu"), None, None)
    assert not cpu.packing and cpu.attn_implementation is None
    # ORPO's pairs packed on the GPU as DPO's (the CPU keeps TRL's padded batch unless asked)
    assert run("objective=orpo").attn_implementation == "pair_varlen" and run("objective=orpo").packing
    assert run("objective=orpo", "repro=strict").attn_implementation == "pair_varlen"
    assert run("objective=orpo", "train.packing=false").attn_implementation == "varlen_attention"
    cpu = d.decide(compose(["model=tiny_random", "hardware=cpu", "objective=orpo"]), d.Hardware("cpu"), None, None)
    assert not cpu.packing and cpu.attn_implementation is None
    assert run("train.packing=false").attn_implementation is None


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_the_trainer_takes_the_fitted_micro_batch_not_the_configured_one(objective: str) -> None:
    """The micro-batch's path (docs/configuration.md): train.per_device_train_batch_size=16 x 1 is re-batched by
    the fit on a 24 GB card (the same 16 rows a step, 1 x 16 in float32), and the trainer's config holds the fitted
    pair: the train group's own value is never copied into it (trainer_args.FITTED_KEYS)."""
    from reprotune.preference.trainers import preference_config
    from reprotune.run import resolve
    from reprotune.train import sft_config
    from reprotune.trainer_args import FITTED_KEYS, passthrough_keys

    # float32: TrainingArguments refuses bf16 without a GPU; the fit re-batches either way
    cfg = compose(["model=qwen3_8b_random", f"objective={objective}", "hardware=gpu", "hardware.dtype=float32",
                   "train.per_device_train_batch_size=16", "train.gradient_accumulation_steps=1"])
    run = d.decide(cfg, d.card("RTX 4090"), None, None)
    fitted = (run.per_device_train_batch_size, run.gradient_accumulation_steps)
    assert fitted != (16, 1) and fitted[0] * fitted[1] == 16
    args = (sft_config(cfg, run, False) if objective == "sft"
            else preference_config(cfg, run, False, resolve(cfg, "params").objective))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == fitted
    assert args.per_device_eval_batch_size == fitted[0]
    assert not set(FITTED_KEYS) & set(passthrough_keys(cfg, "train"))


def test_the_configured_micro_batch_is_read_in_one_place() -> None:
    """train.per_device_train_batch_size and train.gradient_accumulation_steps are read from the config by
    reprotune.sizing.decide.configured_batch alone (ast): no second read before or after the fit."""
    import ast

    reads = []
    for path in sorted((REPO / "src/reprotune").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for func in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            for node in ast.walk(func):
                if (isinstance(node, ast.Attribute) and node.attr in ("per_device_train_batch_size",
                                                                      "gradient_accumulation_steps")
                        and ast.unparse(node.value).split(".")[-1] == "train"):
                    reads.append(f"{path.relative_to(REPO / 'src/reprotune')}:{func.name}")
    assert sorted(set(reads)) == ["sizing/decide.py:configured_batch"]
