"""The default repro mode's kernel choices on a GPU, checked on the CPU: made in one place, none known to be
nondeterministic on CUDA.

reprotune.runtime decides both halves once: which attention kernel a run takes (`attention`, called by
reprotune.sizing.decide) and whether torch runs only deterministic kernels (`deterministic_kernels`, applied by
`set_reproducibility` before the model loads). Every GPU path of the default mode (SFT packed and padded, LoRA,
QLoRA, DoRA, DPO/ORPO/KTO, long context) must land on an attention kernel whose backward is deterministic under
torch's flag, with the flag on; repro=fast must turn it off; an unknown mode is refused by name. The bytes
themselves are checked twice over on a GPU by tests/test_repro_gpu.py.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.run import Run, resolve
from reprotune.runtime import REPRO_MODES, deterministic_kernels, set_reproducibility
from reprotune.sizing.decide import card, decide


def placed(cfg, device: str) -> Run:
    """cfg's Run as train would resolve it on `device` (a described one: this test machine may have no GPU)."""
    return replace(resolve(cfg, "params"), device=device, repro=str(cfg.repro), cpu_kernels=str(cfg.hardware.cpu_kernels))

# Attention kernels whose CUDA backward is deterministic with torch.use_deterministic_algorithms(True): the
# FlashAttention varlen/SDPA backward takes its deterministic form (dQ summed per split in a fixed order), flex
# attention's generated backward has no atomics, eager and pair_dense are plain matrix products and softmax.
DETERMINISTIC_UNDER_THE_FLAG = {"varlen_attention", "pair_varlen", "flex_attention", "eager", "pair_dense", None}

GPU_PATHS = {
    "sft packed": [],
    "sft padded": ["train.packing=false"],
    "qlora": ["method=qlora"],
    "dora": ["method=dora"],
    "long context": ["data.max_length=98304", "train.per_device_train_batch_size=1",
                     "train.gradient_accumulation_steps=1", "method=qlora", "hardware.memory_budget_gib=22"],
    "dpo": ["objective=dpo"],
    "dpo padded": ["objective=dpo", "train.packing=false"],
    "orpo": ["objective=orpo"],
    "kto": ["objective=kto"],
}


@pytest.mark.parametrize("path", list(GPU_PATHS))
def test_every_default_gpu_path_runs_deterministic_kernels(path: str) -> None:
    cfg = compose(["model=qwen3_8b", "hardware=gpu", "paths.prepared=/nonexistent", *GPU_PATHS[path]])
    assert cfg.repro == "default"
    run = decide(cfg, card("H100"), None, None)
    assert deterministic_kernels(cfg.repro, run.device)
    assert run.attn_implementation in DETERMINISTIC_UNDER_THE_FLAG, run.attn_implementation
    # the fast kernels are kept: the default costs no switch to a slower attention
    assert run.attn_implementation in ("varlen_attention", "pair_varlen", None), run.attn_implementation


def test_a_kernel_outside_the_known_set_would_be_caught() -> None:
    """The control: a run forced onto a kernel not in the set (SDPA by name, whose memory-efficient backward is
    chosen per shape) fails the membership check above."""
    cfg = compose(["model=qwen3_8b", "hardware=gpu", "paths.prepared=/nonexistent", "hardware.attn_implementation=sdpa"])
    assert decide(cfg, card("H100"), None, None).attn_implementation not in DETERMINISTIC_UNDER_THE_FLAG


@pytest.fixture
def restore_torch_flags():
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.utils.deterministic.fill_uninitialized_memory, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.utils.deterministic.fill_uninitialized_memory = before[2]
    if before[3] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = before[3]


@pytest.mark.parametrize(("mode", "device", "flag", "fill"), [
    ("default", "cuda", True, False),   # deterministic kernels, no NaN fill (a check, not a source of determinism)
    ("strict", "cuda", True, True),     # the same kernels, and torch's NaN fill of uninitialised memory
    ("fast", "cuda", False, False),     # every kernel in its fastest form
    ("default", "cpu", False, False),   # the CPU's kernels are pinned (reprotune.kernels): nothing more to ask
    ("strict", "cpu", True, True),
])
def test_set_reproducibility_applies_the_mode(mode: str, device: str, flag: bool, fill: bool,
                                              restore_torch_flags) -> None:
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    cfg = compose(["model=tiny_random", f"repro={mode}"])
    set_reproducibility(cfg, placed(cfg, device))
    assert torch.are_deterministic_algorithms_enabled() is flag
    assert not torch.is_deterministic_algorithms_warn_only_enabled()  # a nondeterministic op raises, never warns
    assert torch.utils.deterministic.fill_uninitialized_memory is fill
    assert (os.environ.get("CUBLAS_WORKSPACE_CONFIG") == ":4096:8") is flag


@pytest.mark.parametrize("where", ["set_reproducibility", "decide"])
def test_an_unknown_mode_is_one_line_naming_the_allowed_values(where: str) -> None:
    cfg = compose(["model=tiny_random", "repro=strcit"])
    with pytest.raises(ReprotuneError) as err:
        if where == "decide":  # what make plan calls first
            decide(cfg, card("H100"), None, None)
        else:
            set_reproducibility(cfg, placed(cfg, "cpu"))
    assert str(err.value) == f"repro: must be one of {', '.join(REPRO_MODES)}, not 'strcit'"
