"""Config passes through: the train and method groups are the libraries' own keyword arguments, and every key the
code reads is declared in conf/."""

from __future__ import annotations

import ast
import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from reprotune import speed
from reprotune.config import CONF_DIR, compose, library_keys
from reprotune.sizing.decide import Hardware, card, decide
from reprotune.train import lora_config, sft_config

SRC = Path(__file__).resolve().parents[1] / "src/reprotune"
GROUPS = {group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
          for group in ("model", "method", "hardware", "objective")}


def test_every_train_key_reaches_sftconfig_unchanged(tmp_path: Path) -> None:
    cfg = compose([f"paths.root={tmp_path}", "+train.label_smoothing_factor=0.1", "train.learning_rate=3e-4"])
    args = sft_config(cfg, decide(cfg, Hardware("cpu"), None, None), has_val=False)
    # reprotune sets these itself (where checkpoints go and how they rotate, the validation split, privacy;
    # batch shape and packing fitted by reprotune.speed; a CPU run's AdamW, below)
    overridden = {"save_total_limit", "eval_steps", "report_to", "packing", "per_device_train_batch_size",
                  "gradient_accumulation_steps", "optim"}
    passed = library_keys(cfg, "train")
    assert passed["label_smoothing_factor"] == 0.1  # a key conf/ does not list, added on the command line
    for key, value in passed.items():
        if key not in overridden:
            assert getattr(args, key) == value, key
    assert args.learning_rate == 3e-4 and args.save_total_limit is None and args.report_to in ([], "none", None)


def test_a_cpu_run_takes_the_fused_adamw_and_a_gpu_run_the_configured_optimizer(tmp_path: Path) -> None:
    """The per-tensor AdamW's torch.sqrt moves with the CPU maker (docs/reproducibility.md): a CPU run swaps it for
    the fused kernel, with the reason; a GPU run and any other optimizer keep train.optim."""
    cfg = compose([f"paths.root={tmp_path}"])
    assert cfg.train.optim == "adamw_torch"
    cpu = decide(cfg, Hardware("cpu"), None, None)
    assert sft_config(cfg, cpu, has_val=False).optim == "adamw_torch_fused" == cpu.optim
    assert any(r.startswith("optimizer adamw_torch_fused (train.optim=adamw_torch on a CPU") for r in cpu.reasons)
    gpu = decide(cfg, Hardware("cuda", free_bytes=80 * 2**30), None, None)
    assert gpu.optim == "adamw_torch" and not any(r.startswith("optimizer ") for r in gpu.reasons)
    sgd = compose([f"paths.root={tmp_path}", "train.optim=sgd"])
    assert sft_config(sgd, decide(sgd, Hardware("cpu"), None, None), has_val=False).optim == "sgd"


def test_fitted_partial_checkpointing_reaches_sftconfig(tmp_path: Path) -> None:
    """A fit of 'every 4th layer' (make plan's preflight on a GPU) becomes transformers' every_n_layers, next to
    the user's own activation_checkpointing_kwargs; with checkpointing off nothing is added."""
    cfg = compose([f"paths.root={tmp_path}", "++train.activation_checkpointing_kwargs={use_reentrant: false}"])
    fitted = replace(decide(cfg, Hardware("cpu"), None, None), activation_checkpointing=True, checkpoint_every_n_layers=4,
                     per_device_train_batch_size=4, gradient_accumulation_steps=4, process_accumulation=4)
    args = sft_config(cfg, fitted, has_val=False)
    assert args.activation_checkpointing is True
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False, "every_n_layers": 4}
    off = sft_config(cfg, replace(fitted, activation_checkpointing=False, checkpoint_every_n_layers=1), has_val=False)
    assert off.activation_checkpointing is False and off.activation_checkpointing_kwargs == {"use_reentrant": False}


def test_unknown_train_key_fails_with_trls_message(tmp_path: Path) -> None:
    cfg = compose([f"paths.root={tmp_path}", "+train.learning_rat=1e-4"])
    with pytest.raises(TypeError, match="unexpected keyword argument 'learning_rat'"):
        sft_config(cfg, decide(cfg, Hardware("cpu"), None, None), has_val=False)


@pytest.mark.parametrize("method", GROUPS["method"])
def test_every_method_key_reaches_loraconfig_unchanged(method: str) -> None:
    cfg = compose([f"method={method}", "+method.rank_pattern={q_proj: 4}"])
    config = lora_config(cfg)
    for key, value in library_keys(cfg, "method").items():
        if key != "target_modules":
            assert getattr(config, key) == value, key
    assert config.rank_pattern == {"q_proj": 4}
    assert config.target_modules == set(cfg.model.lora_target_modules)  # null: the model preset's


def test_unknown_method_key_fails_with_peft_message() -> None:
    with pytest.raises(TypeError, match="unexpected keyword argument 'lora_alpah'"):
        lora_config(compose(["+method.lora_alpah=8"]))


# --------------------------------------------------------------------------------- every read key is declared
def read_paths() -> set[tuple[str, ...]]:
    """Every config path the code reads as cfg.a.b.c or cfg.a.get("b") (a chain on the name `cfg`)."""
    found = set()
    for path in SRC.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            chain: list[str] = []
            cur = node
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                chain, cur = [node.args[0].value], node.func.value
            elif not isinstance(node, ast.Attribute):
                continue
            while isinstance(cur, ast.Attribute):
                chain.insert(0, cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "cfg" and chain:
                found.add(tuple(chain))
    return {p for p in found if p[-1] not in {"get", "items", "keys", "values"}}


def declared(cfgs: list, path: tuple[str, ...]) -> bool:
    for cfg in cfgs:
        node = cfg
        for key in path:
            if not OmegaConf.is_dict(node) or key not in node:
                break
            node = node[key]
        else:
            return True
    return False


def test_every_key_the_code_reads_is_declared_in_conf() -> None:
    paths = read_paths()
    assert ("train", "run", "keep_checkpoints") in paths and ("train", "save_total_limit") in paths  # the reader works
    default = compose([])
    missing = {p for p in paths if not declared([default], p)}
    # some keys exist in one preset only (model.builtin, method.quantization's keys, objective.beta): try every
    # preset, lazily
    for objective, model, method, hardware in itertools.product(GROUPS["objective"], GROUPS["model"],
                                                                GROUPS["method"], GROUPS["hardware"]):
        if not missing:
            break
        cfg = compose([f"objective={objective}", f"model={model}", f"method={method}", f"hardware={hardware}"])
        missing = {p for p in missing if not declared([cfg], p)}
    assert sorted(".".join(p) for p in missing) == []


def test_the_reader_would_catch_an_undeclared_key() -> None:
    assert not declared([compose([])], ("train", "keep_checkpoints"))  # read but declared nowhere, before #16


def test_flex_attention_compiles_with_dynamic_shapes_from_the_first_call() -> None:
    """On a GPU the fast path's flex attention (a GPU or torch without the varlen kernel) is compiled for
    symbolic lengths at once (the static compile of its block mask stalled for minutes at 8,800+ tokens per
    micro-step on the H200); the CPU path leaves dynamo alone."""
    from dataclasses import replace

    import torch._dynamo

    cfg = compose(["model=tiny_random", "hardware=gpu"])
    gpu = decide(cfg, replace(card("H200"), varlen_attention=False), None, None)
    cpu = decide(compose(["model=tiny_random", "hardware=cpu"]), Hardware("cpu"), None, None)
    assert gpu.attn_implementation == "flex_attention" and gpu.dynamic_shapes and gpu.as_record()["dynamic_shapes"]
    assert not cpu.dynamic_shapes
    before = torch._dynamo.config.assume_static_by_default
    try:
        speed.apply_compile_settings(cpu)
        assert torch._dynamo.config.assume_static_by_default is before
        speed.apply_compile_settings(gpu)
        assert torch._dynamo.config.assume_static_by_default is False
    finally:
        torch._dynamo.config.assume_static_by_default = before
