"""Per architecture family (tiny Llama, Qwen3, Mistral, Gemma 3): train a few steps, then `make merge`'s merge
(base + adapter in float32 against the merged model, and the saved bf16 file) must hold its parity, with an
adapter that really moves the logits, and `make gguf`'s conversion must keep the token ids and the chat
template (issue #25). The export lane: each family trains, merges and converts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.config import compose

from .export_pipeline import EXPORT_ARGS, EXPORT_TRAIN
from .families import CLASSES, FAMILIES, family_params

pytestmark = pytest.mark.slow  # trains and merges one tiny model per family (gguf: + the llama.cpp build)
# the GGUF general.architecture llama.cpp's converter writes for each class
GGUF_ARCH = {"llama": "llama", "qwen3": "qwen3", "mistral": "llama", "gemma3": "gemma3"}


@pytest.fixture(scope="module", params=family_params())
def merged_family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from reprotune.invoices import generate
    from reprotune.merge import merge
    from reprotune.train import train

    from .conftest import write_jsonl

    root = tmp_path_factory.mktemp(f"family-{request.param}")
    rows = generate(24, seed=7)
    write_jsonl(root / "data/prepared/train.jsonl", rows[:20])
    write_jsonl(root / "data/prepared/holdout.jsonl", rows[20:])
    cfg = compose([*EXPORT_TRAIN, *EXPORT_ARGS, f"paths.root={root}", f"model={request.param}",
                   "export.quant=[Q8_0]"])
    train(cfg)
    merge(cfg)
    family = next(f for f, preset in FAMILIES.items() if preset == request.param)
    return family, request.param, root, cfg


def test_merge_parity_per_family(merged_family) -> None:
    family, preset, root, _ = merged_family
    adapter = json.loads((root / "outputs/adapter/adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"].startswith(f"random_init:{preset}@")
    parity = json.loads((root / "outputs/merged/parity.json").read_text())
    fp32, saved, effect = parity["fp32_merge"], parity["saved"], parity["adapter_effect"]
    assert fp32["passed"] and fp32["max_abs_diff"] <= 1e-3 and fp32["positions"] > 50
    assert effect["max_abs_diff"] > 20 * fp32["max_abs_diff"], "the adapter must move the logits"
    assert saved["passed"] and saved["top1_agreement"] >= 0.98
    merged = json.loads((root / "outputs/merged/config.json").read_text())
    assert merged["architectures"] == [CLASSES[family]]  # still the family's class


def test_gguf_per_family_keeps_token_ids_and_template(merged_family) -> None:
    from reprotune import llamacpp
    from reprotune.gguf import gguf

    family, _, root, cfg = merged_family
    gguf(cfg)
    report = json.loads((root / "outputs/gguf/parity.json").read_text())
    for name in ("F16", "Q8_0"):
        tok = report["tokenization"][name]
        assert tok["identical"] is True and tok["tokens"] > 4 * 50, (family, name, tok)
    info = llamacpp.gguf_info(llamacpp.source_dir(), root / "outputs/gguf/model-Q8_0.gguf")
    meta = info["metadata"]
    assert meta["general.architecture"] == GGUF_ARCH[family]
    assert meta["tokenizer.chat_template"] == (root / "outputs/merged/chat_template.jinja").read_text()
    modelfile = (root / "outputs/gguf/Modelfile").read_text()
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and "<|im_start|>assistant" in modelfile


def test_gguf_carries_a_real_template_trl_patched_for_training(tmp_path: Path) -> None:
    """Qwen2.5's real template (TRL's copy) as model.chat_template, training_chat_template null: TRL trains with its
    qwen2_5_training copy, and the GGUF (and the merged model) carry the real template, byte for byte."""
    import trl

    from reprotune import llamacpp
    from reprotune.gguf import gguf
    from reprotune.invoices import generate
    from reprotune.merge import merge
    from reprotune.train import train

    from .conftest import write_jsonl

    real = Path(trl.__file__).parent / "chat_templates/qwen2_5.jinja"
    rows = generate(24, seed=7)
    write_jsonl(tmp_path / "data/prepared/train.jsonl", rows[:20])
    write_jsonl(tmp_path / "data/prepared/holdout.jsonl", rows[20:])
    cfg = compose([*EXPORT_TRAIN, *EXPORT_ARGS, f"paths.root={tmp_path}", "model=tiny_random_qwen3",
                   f"model.chat_template={real}", "model.training_chat_template=null", "export.quant=[Q8_0]"])
    train(cfg)
    merge(cfg)
    gguf(cfg)
    assert (tmp_path / "outputs/merged/chat_template.jinja").read_text() == real.read_text()
    info = llamacpp.gguf_info(llamacpp.source_dir(), tmp_path / "outputs/gguf/model-Q8_0.gguf")
    assert info["metadata"]["tokenizer.chat_template"] == real.read_text()
    report = json.loads((tmp_path / "outputs/gguf/parity.json").read_text())
    assert report["tokenization"]["Q8_0"]["identical"] is True
