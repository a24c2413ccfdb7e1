"""make merge on the tiny random model: outputs, logit parity, QLoRA into full precision, loud failures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.merge import merge

from .conftest import TINY_TRAIN, tiny_adapter_run, write_jsonl
from .export_pipeline import EXPORT_ARGS, EXPORT_TRAIN, tiny_export


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    return tiny_export(tmp_path_factory, upto="merge")


@pytest.mark.slow  # trains, merges and reloads (the export lane)
def test_merged_dir_is_a_complete_hf_model(merged: tuple[Path, list[str]]) -> None:
    root, _ = merged
    out = root / "outputs/merged"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.jinja", "parity.json"):
        assert (out / name).is_file(), name
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"  # export.dtype default
    assert "quantization_config" not in config
    # the inference chat template of the adapter travels unchanged
    assert (out / "chat_template.jinja").read_text() == (root / "outputs/adapter/chat_template.jinja").read_text()
    gen = json.loads((out / "generation_config.json").read_text())
    eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert 2 in eos  # <|im_end|>, the end of an assistant turn in ChatML
    assert not (root / "outputs/merged.tmp").exists()


@pytest.mark.slow  # trains, merges and reloads (the export lane)
def test_merge_parity(merged: tuple[Path, list[str]]) -> None:
    root, _ = merged
    parity = json.loads((root / "outputs/merged/parity.json").read_text())
    fp32, saved, effect = parity["fp32_merge"], parity["saved"], parity["adapter_effect"]
    assert parity["holdout_conversations"] == 3 and fp32["positions"] > 100
    assert fp32["passed"] and fp32["max_abs_diff"] <= fp32["tolerance_max_abs_diff"] == 1e-3
    # the adapter really changes the model, by far more than the merge error: the check has teeth
    assert effect["max_abs_diff"] > 20 * fp32["max_abs_diff"]
    assert saved["passed"] and saved["top1_agreement"] >= 0.98 and saved["dtype"] == "bfloat16"
    manifest = json.loads((root / "outputs/export/merge_manifest.json").read_text())
    assert manifest["timing"]["merge_seconds"] > 0
    assert manifest["parity"] == parity
    assert len(manifest["outputs"]["merged"]["sha256"]) == 64


@pytest.mark.slow  # trains, merges and reloads (the export lane)
def test_qlora_adapter_merges_into_full_precision_base(tmp_path: Path) -> None:
    from reprotune.train import train

    from .export_pipeline import tiny_workspace

    overrides = [*tiny_workspace(tmp_path), "method=qlora"]
    train(compose(overrides))
    assert json.loads((tmp_path / "outputs/adapter/adapter_config.json").read_text())["peft_type"] == "LORA"
    record = merge(compose(overrides))
    parity = record["parity"]
    assert parity["qlora_merged_into_full_precision"] is True
    assert parity["fp32_merge"]["passed"] and parity["saved"]["passed"]
    config = json.loads((tmp_path / "outputs/merged/config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(tmp_path / "outputs/merged/model.safetensors", "pt") as fh:
        dtypes = {str(fh.get_slice(k).get_dtype()) for k in fh.keys()}  # noqa: SIM118
    assert dtypes == {"BF16"}  # dense weights, no packed 4-bit tensors


def test_missing_adapter_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write_jsonl(tmp_path / "data/prepared/holdout.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ReprotuneError) as err:
        merge(compose([*TINY_TRAIN, f"paths.root={tmp_path}"]))
    assert str(err.value) == f"{tmp_path}/outputs/adapter/adapter_config.json: file: not found; run 'make train' first"


@pytest.mark.slow  # trains, merges and reloads (the export lane)
def test_bad_holdout_names_file_and_line_and_keeps_earlier_output(merged: tuple[Path, list[str]],
                                                                   tmp_path: Path) -> None:
    import shutil

    root, overrides = merged
    # a copy of the finished workspace with a broken holdout: the old merged model must survive
    shutil.copytree(root / "outputs", tmp_path / "outputs")
    good = (root / "data/prepared/holdout.jsonl").read_text().splitlines()
    (tmp_path / "data/prepared").mkdir(parents=True)
    (tmp_path / "data/prepared/holdout.jsonl").write_text(good[0] + "\n" + '{"messages": [oops\n')
    before = (tmp_path / "outputs/merged/model.safetensors").read_bytes()
    with pytest.raises(ReprotuneError) as err:
        merge(compose([*overrides, f"paths.root={tmp_path}"]))
    assert str(err.value).startswith(f"{tmp_path}/data/prepared/holdout.jsonl:2: json: not valid JSON")
    assert (tmp_path / "outputs/merged/model.safetensors").read_bytes() == before


@pytest.mark.slow
def test_make_verify_reruns_the_merge_manifest(merged: tuple[Path, list[str]]) -> None:
    """The merge manifest is a stage manifest 'make verify' can re-run: same merged bytes."""
    import subprocess
    import sys

    root, _ = merged
    manifest = json.loads((root / "outputs/export/merge_manifest.json").read_text())
    assert manifest["manifest_path"] == "outputs/export/merge_manifest.json"
    assert manifest["inputs"]["adapter"]["path"] == "outputs/adapter"
    assert Path(manifest["inputs"]["base_model"]["path"]).is_absolute()
    proc = subprocess.run([sys.executable, "-m", "reprotune.verify", str(root / "outputs/export/merge_manifest.json")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"output merged\s+identical", proc.stdout) and "RESULT: identical" in proc.stdout


def test_merge_refuses_an_adapter_of_another_base(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    import shutil

    from reprotune.errors import ReprotuneError

    # the adapter the export run merges (export_pipeline's train stage), without waiting for that merge
    root = tiny_adapter_run(tmp_path_factory)
    overrides = [*EXPORT_TRAIN, *EXPORT_ARGS]
    shutil.copytree(root / "outputs/adapter", tmp_path / "outputs/adapter")
    shutil.copytree(root / "data", tmp_path / "data")
    with pytest.raises(ReprotuneError, match=r"base_model_name_or_path: the adapter was trained on random_init:tiny_random@"
                                         r"[0-9a-f]{16}, but model= is builtin:smollm2_135m@"):
        merge(compose([*overrides, f"paths.root={tmp_path}", "model=smollm2_135m"]))
