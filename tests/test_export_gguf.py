"""make gguf on the tiny random model with the pinned llama.cpp: files, parity report, the failures that
other tools only show after shipping (unknown pre-tokenizer, degraded vocab, template drift), bad input."""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError

from .export_pipeline import tiny_export

pytestmark = pytest.mark.slow  # needs the llama.cpp build (compiled on first use)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    return tiny_export(tmp_path_factory, upto="gguf")


def test_gguf_files(exported: tuple[Path, list[str]]) -> None:
    root, _ = exported
    out = root / "outputs/gguf"
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "imatrix.gguf", "model-F16.gguf",
                                                      "model-Q4_K_M.gguf", "model-Q8_0.gguf", "parity.json"]
    for name in ("imatrix.gguf", "model-F16.gguf", "model-Q4_K_M.gguf", "model-Q8_0.gguf"):
        assert (out / name).read_bytes()[:4] == b"GGUF"
    assert (out / "model-Q4_K_M.gguf").stat().st_size < (out / "model-F16.gguf").stat().st_size
    manifest = json.loads((root / "outputs/export/gguf_manifest.json").read_text())
    assert manifest["llama_cpp"]["llama_cpp_python"] == "0.3.36"
    assert manifest["timing"]["convert_seconds"] > 0 and manifest["timing"]["quantize_Q4_K_M_seconds"] > 0
    assert not (root / "outputs/gguf.tmp").exists()
    # the imatrix: what it read is hashed (the text itself does not ship), the tools that made it too
    assert manifest["inputs"]["imatrix_data"]["source"].endswith("data/prepared/train.jsonl")
    assert len(manifest["inputs"]["imatrix_data"]["sha256"]) == 64
    # the two tools and the libraries they load from their folder (the quantize logic is libllama-quantize-impl's)
    assert {"llama-imatrix", "llama-quantize", "libllama-quantize-impl.so", "libllama-common.so.0.5.0",
            "libllama.so.0.5.0"} <= set(manifest["llama_cpp"]["tools_sha256"])
    assert not list(root.glob("outputs/.*imatrix-work*"))


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_llama_cpp_kernels_use_the_cpus_simd(exported: tuple[Path, list[str]]) -> None:
    """The pinned build's CPU kernels have SIMD (scripts/build_llama_cpp.sh; with the portable x86 build the parity
    step's F16 greedy took 130-170 s a prompt), and the manifest records which, since greedy answers depend on it."""
    root, _ = exported
    info = json.loads((root / "outputs/export/gguf_manifest.json").read_text())["llama_cpp"]["system_info"]
    if platform.machine() == "aarch64":
        assert "NEON = 1" in info, info  # part of the base ISA: the default build has it
    elif platform.machine() != "x86_64":
        pytest.skip(f"no SIMD expectation for {platform.machine()}")
    elif os.environ.get("LLAMA_CPP_CPU") == "portable" or not {"sse4_2", "avx", "f16c", "fma", "avx2",
                                                                  "bmi2"} <= cpu_flags():
        assert "AVX2 = 1" not in info, info  # it would die of SIGILL on this CPU
    else:
        assert all(f"{feature} = 1" in info for feature in ("AVX", "AVX2", "F16C", "FMA", "BMI2")), info


def test_parity_report(exported: tuple[Path, list[str]]) -> None:
    root, _ = exported
    report = json.loads((root / "outputs/gguf/parity.json").read_text())
    assert report["holdout_prompts"] == 8 and report["greedy_prompts"] == 3
    assert report["greedy_selection"].startswith("the first 3 holdout prompts in file order")
    for name in ("F16", "Q4_K_M", "Q8_0"):
        tok = report["tokenization"][name]
        assert tok["identical"] is True and tok["prompts"] == 8 and tok["tokens"] > 8 * 50
        greedy = report["greedy"][name]
        assert greedy["prompts"] == 3 and greedy["exact_match_rate"] == greedy["exact_matches"] / 3
        assert greedy["exact_matches"] + len(greedy["mismatched_prompts"]) == 3
        # every prompt matched exactly if and only if every generated token agreed
        assert (greedy["exact_matches"] == 3) == (greedy["token_prefix_agreement"] == 1.0)
        assert len(report["gguf_outputs"][name]) == 3
    assert 2 in report["eog_ids"]  # <|im_end|> ends generation in llama.cpp
    # the real type mix: F16 file is f16 (+ f32 norms); Q8_0 is mostly q8_0
    assert set(report["type_mix"]["F16"]) == {"F16", "F32"}
    assert "Q8_0" in report["type_mix"]["Q8_0"]
    assert sum(v["tensors"] for v in report["type_mix"]["Q4_K_M"].values()) == \
        sum(v["tensors"] for v in report["type_mix"]["F16"].values())


def test_gguf_metadata_carries_template_and_pre_tokenizer(exported: tuple[Path, list[str]]) -> None:
    from reprotune import llamacpp

    root, _ = exported
    info = llamacpp.gguf_info(llamacpp.source_dir(), root / "outputs/gguf/model-Q4_K_M.gguf")
    meta = info["metadata"]
    assert meta["tokenizer.ggml.pre"] == "smollm"
    assert meta["tokenizer.chat_template"] == (root / "outputs/merged/chat_template.jinja").read_text()
    assert meta["tokenizer.ggml.eos_token_id"] == 2


def test_gguf_general_name_is_the_datas(exported: tuple[Path, list[str]]) -> None:
    """Every GGUF's general.name is export.name, reprotune-<data.name> (the converter would name it after the
    merged folder, 'Merged', whatever the data); the quants carry it from the F16."""
    from reprotune import llamacpp

    root, overrides = exported
    name = compose(overrides).export.name
    assert name == "reprotune-invoices"
    for gguf_file in sorted((root / "outputs/gguf").glob("model-*.gguf")):
        meta = llamacpp.gguf_info(llamacpp.source_dir(), gguf_file)["metadata"]
        assert meta["general.name"] == name, gguf_file.name


def test_unknown_pre_tokenizer_fails_clearly(exported: tuple[Path, list[str]], tmp_path: Path) -> None:
    root, overrides = exported
    shutil.copytree(root / "outputs/merged", tmp_path / "outputs/merged")
    shutil.copytree(root / "data", tmp_path / "data")
    tok = json.loads((tmp_path / "outputs/merged/tokenizer.json").read_text())
    # a different pre-tokenizer (whitespace split before byte-level): the converter's hash no longer matches
    tok["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"},
                                                                  tok["pre_tokenizer"]]}
    (tmp_path / "outputs/merged/tokenizer.json").write_text(json.dumps(tok))
    from reprotune.gguf import gguf

    with pytest.raises(ReprotuneError) as err:
        gguf(compose([*overrides, f"paths.root={tmp_path}"]))
    message = str(err.value)
    assert message.startswith("gguf: llama.cpp 0.3.36 does not know the pre-tokenizer of")
    assert "chkhsh " in message and "?" not in message.split("chkhsh ")[1][:64]
    assert not (tmp_path / "outputs/gguf").exists()  # nothing shipped


def test_gguf_without_pre_tokenizer_is_refused(exported: tuple[Path, list[str]], tmp_path: Path) -> None:
    """A GGUF from which tokenizer.ggml.pre was removed (llama.cpp's own metadata tool): llama.cpp warns
    that generation quality will be degraded, and the check refuses it."""
    from reprotune import llamacpp
    from reprotune.gguf_build import check_loads_cleanly

    root, _ = exported
    src = llamacpp.source_dir()
    broken = tmp_path / "no-pre.gguf"
    subprocess.run([sys.executable, str(src / "gguf-py/gguf/scripts/gguf_new_metadata.py"),
                    "--remove-metadata", "tokenizer.ggml.pre", "--force",
                    str(root / "outputs/gguf/model-F16.gguf"), str(broken)],
                   check=True, capture_output=True, env={"PYTHONPATH": str(src / "gguf-py"), "PATH": ""})
    with pytest.raises(ReprotuneError, match="llama.cpp warns about no-pre.gguf: .*GENERATION QUALITY WILL BE DEGRADED"):
        check_loads_cleanly(broken)
    assert check_loads_cleanly(root / "outputs/gguf/model-F16.gguf")["eog_ids"]  # the real one loads cleanly


def test_chat_template_drift_is_a_hard_failure(exported: tuple[Path, list[str]]) -> None:
    from transformers import AutoTokenizer

    from reprotune.gguf_build import load_vocab
    from reprotune.gguf_parity import check_template_and_tokens, prompts_of
    from reprotune.merge import read_holdout
    from reprotune.run import resolve

    root, overrides = exported
    tokenizer = AutoTokenizer.from_pretrained(root / "outputs/merged")
    cfg = compose(overrides)
    prompts = prompts_of(read_holdout(resolve(cfg, "merge")))[:2]
    vocab = load_vocab(root / "outputs/gguf/model-Q4_K_M.gguf")
    assert len(check_template_and_tokens(vocab, tokenizer, prompts, "q4")) == 2
    tokenizer.chat_template = tokenizer.chat_template.replace("<|im_start|>assistant\n", "<|im_start|>assistant ")
    with pytest.raises(ReprotuneError, match="its chat template renders holdout prompt 0 differently"):
        check_template_and_tokens(vocab, tokenizer, prompts, "q4")


def test_unknown_quant_type_fails_before_any_work(exported: tuple[Path, list[str]], tmp_path: Path) -> None:
    from reprotune.gguf import gguf

    root, overrides = exported
    shutil.copytree(root / "outputs/merged", tmp_path / "outputs/merged")
    with pytest.raises(ReprotuneError, match=r"export.quant: unknown llama.cpp type 'Q4_K_X' \(known: .*Q4_K_M"):
        gguf(compose([*overrides, f"paths.root={tmp_path}", "export.quant=[Q4_K_X]"]))


def test_missing_merged_model_fails_clearly(tmp_path: Path) -> None:
    from reprotune.gguf import gguf

    with pytest.raises(ReprotuneError, match="outputs/merged/config.json not found; run 'make merge' first"):
        gguf(compose([f"paths.root={tmp_path}"]))


@pytest.mark.slow
def test_make_verify_reruns_the_gguf_manifest(exported: tuple[Path, list[str]]) -> None:
    """The gguf manifest is a stage manifest 'make verify' can re-run: same GGUF bytes, same parity report."""
    root, _ = exported
    manifest = json.loads((root / "outputs/export/gguf_manifest.json").read_text())
    assert manifest["manifest_path"] == "outputs/export/gguf_manifest.json"
    assert manifest["inputs"]["merged"]["path"] == "outputs/merged"
    proc = subprocess.run([sys.executable, "-m", "reprotune.verify", str(root / "outputs/export/gguf_manifest.json")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for name in ("F16", "Q4_K_M", "Q8_0", "imatrix", "parity"):
        assert re.search(rf"output {name}\s+identical", proc.stdout), proc.stdout[-2000:]


def test_gguf_metrics_are_numbers_only(exported: tuple[Path, list[str]]) -> None:
    """outputs/export/gguf_metrics.json (a DVC metrics file): numbers only, and no timing (tokens/s is the
    manifest's), so two identical exports give identical metrics bytes."""
    from .test_metrics_files import leaves, non_numbers

    root, _ = exported
    path = root / "outputs/export/gguf_metrics.json"
    assert not non_numbers(path), non_numbers(path)
    assert not [k for k, _ in leaves(json.loads(path.read_text())) if "per_second" in k or "seconds" in k]
