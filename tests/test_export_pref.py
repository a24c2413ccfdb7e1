"""Export of the preference adapter (merge_pref, gguf_pref) and make verify of a preference run, on the tiny model:
DPO from the shared tiny SFT adapter on the built-in pairs, merged into the base and converted to GGUF under
outputs/pref (the SFT run's outputs left byte for byte), the parity checks of merge and gguf run on the preference
holdout, and the train_pref manifest re-run by reprotune.verify from its start adapter (copied, sha256-checked)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.manifest import sha256_tree, tree_digest

from .conftest import REPO, TINY_ADAPTER_TRAIN, built_once, small_invoices, tiny_adapter_run

# DPO from the SFT adapter (objective.init_adapter's default, outputs/adapter): 2 steps at a high learning rate,
# so the preference adapter is visibly not the SFT one
PREF = [*TINY_ADAPTER_TRAIN, "objective=dpo", "++objective.max_steps=2", "++objective.learning_rate=1e-2",
        "data.scrub=false", "export.merge.prompts=3", "export.parity.examples=2", "export.parity.max_new_tokens=16",
        "export.quant=[Q8_0]"]


def pref_run(factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """session_dir/tiny-pref: the shared tiny SFT adapter in outputs/adapter, the built-in pairs of small_invoices in
    data/pairs, a DPO adapter trained from it in outputs/pref; built once, read-only (tests copy what they change)."""
    def build(root: Path) -> None:
        from reprotune.prepare import prepare
        from reprotune.train import train

        small_invoices(root)
        shutil.copytree(tiny_adapter_run(factory) / "outputs/adapter", root / "outputs/adapter")
        over = [*PREF, f"paths.root={root}", "data.path=${paths.raw}/invoices.jsonl"]
        prepare(compose(over))
        train(compose(over))
        (root / "overrides.json").write_text(json.dumps(over))

    root = built_once(factory, "tiny-pref", build)
    return root, json.loads((root / "overrides.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    return pref_run(tmp_path_factory)


@pytest.fixture(scope="module")
def exported(trained: tuple[Path, list[str]], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """merge and gguf with objective=dpo on a copy of the shared run (merge_pref, gguf_pref's code)."""
    from reprotune.gguf import gguf
    from reprotune.merge import merge

    src, over = trained
    root = tmp_path_factory.mktemp("pref-export") / "run"
    shutil.copytree(src, root)
    over = [*over, f"paths.root={root}"]
    before = sha256_tree(root / "outputs/adapter")
    merged = merge(compose(over))
    converted = gguf(compose(over))
    return {"root": root, "over": over, "sft_before": before, "merge": merged, "gguf": converted}


@pytest.mark.slow  # DPO, merge and reloads on the tiny model
def test_merge_pref_merges_the_preference_adapter_with_parity(exported: dict) -> None:
    import torch
    from peft import PeftModel

    from reprotune.merge import compare_logits, logits_of, parity_batches, read_holdout
    from reprotune.models import load_float32, load_tokenizer, resolve_model_dir
    from reprotune.run import resolve
    root = exported["root"]
    out = root / "outputs/pref/merged"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "parity.json"):
        assert (out / name).is_file(), name
    # its own outputs: the SFT run's adapter untouched, no SFT merge or export written
    assert not (root / "outputs/merged").exists() and not (root / "outputs/export").exists()
    assert sha256_tree(root / "outputs/adapter") == exported["sft_before"]
    record = exported["merge"]
    assert record["manifest_path"] == "outputs/pref/export/merge_manifest.json"
    assert record["inputs"]["adapter"]["path"] == "outputs/pref/adapter"
    assert record["inputs"]["holdout"]["path"] == "data/pairs/holdout.jsonl"
    assert record["outputs"]["merged"]["path"] == "outputs/pref/merged"
    parity = json.loads((out / "parity.json").read_text())
    assert parity == record["parity"] and parity["holdout_conversations"] == 3
    assert parity["fp32_merge"]["passed"] and parity["saved"]["passed"]
    assert parity["adapter_effect"]["max_abs_diff"] > 20 * parity["fp32_merge"]["max_abs_diff"]

    # the merged model is base + the trained preference adapter (one whole adapter: the SFT weights trained
    # further), not base + the SFT adapter it started from, nor the two stacked
    cfg = compose(exported["over"])
    tokenizer = load_tokenizer(out)
    batches = parity_batches(tokenizer, read_holdout(resolve(cfg, "merge"))[:3])
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    torch.manual_seed(0)
    merged = logits_of(load_float32(out), batches)

    def with_adapters(*dirs: Path) -> list:
        model = load_float32(model_dir, cfg.model)
        for d in dirs:  # each adapter merged in turn: the stack of both when given two
            model = PeftModel.from_pretrained(model, str(d)).merge_and_unload()
        return logits_of(model.eval(), batches)

    pref = compare_logits(with_adapters(root / "outputs/pref/adapter"), merged)
    sft = compare_logits(with_adapters(root / "outputs/adapter"), merged)
    stacked = compare_logits(with_adapters(root / "outputs/adapter", root / "outputs/pref/adapter"), merged)
    assert pref["top1_agreement"] >= 0.98
    assert sft["max_abs_diff"] > 10 * pref["max_abs_diff"] and stacked["max_abs_diff"] > 10 * pref["max_abs_diff"]


def report_gate_only(report: dict) -> bool:
    """A preference export has no reference answers for a task metric: its gate is parity alone."""
    return report["task"] == {} and all(v["task_metric"] is None for v in report["gate"].values())


@pytest.mark.slow  # needs the llama.cpp build
def test_gguf_pref_converts_with_parity_on_the_preference_holdout(exported: dict) -> None:
    root, record = exported["root"], exported["gguf"]
    out = root / "outputs/pref/gguf"
    assert sorted(p.name for p in out.iterdir()) == ["Modelfile", "imatrix.gguf", "model-F16.gguf", "model-Q8_0.gguf",
                                                      "parity.json"]
    assert not (root / "outputs/gguf").exists()
    assert record["manifest_path"] == "outputs/pref/export/gguf_manifest.json"
    # the importance matrix read the preference pairs (prompt + chosen answer), not the SFT split
    assert record["inputs"]["imatrix_data"]["source"].endswith("data/pairs/train.jsonl")
    assert report_gate_only(json.loads((out / "parity.json").read_text()))
    assert record["inputs"]["merged"]["path"] == "outputs/pref/merged"
    assert record["inputs"]["holdout"]["path"] == "data/pairs/holdout.jsonl"
    holdout = (root / "data/pairs/holdout.jsonl").read_text().splitlines()
    report = json.loads((out / "parity.json").read_text())
    assert report["holdout_prompts"] == len(holdout) > 0 and report["greedy_prompts"] == 2
    for name in ("F16", "Q8_0"):
        assert report["tokenization"][name]["identical"] is True
        assert report["tokenization"][name]["prompts"] == len(holdout)
        greedy = report["greedy"][name]
        assert greedy["prompts"] == 2 and (greedy["exact_matches"] == 2) == (greedy["token_prefix_agreement"] == 1.0)
    # the Modelfile's system prompt is the one every training pair's prompt starts with
    system = json.loads((root / "data/pairs/train.jsonl").read_text().splitlines()[0])["prompt"][0]
    assert system["role"] == "system" and report["modelfile"]["system"] == system["content"]
    assert 'SYSTEM """' in (out / "Modelfile").read_text()


@pytest.mark.slow  # a second merge in the re-run
def test_make_verify_reruns_the_merge_pref_manifest(exported: dict) -> None:
    proc = subprocess.run([sys.executable, "-m", "reprotune.verify",
                           str(exported["root"] / "outputs/pref/export/merge_manifest.json")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert re.search(r"output merged\s+identical", proc.stdout) and "RESULT: identical" in proc.stdout


@pytest.mark.slow  # a second DPO run in the re-run
def test_make_verify_reruns_a_preference_train_from_its_start_adapter(trained: tuple[Path, list[str]],
                                                                      tmp_path: Path) -> None:
    """The train_pref manifest records its start adapter under objective (path, sha256), not inputs: verify copies
    it into the re-run and checks its sha256 first; a changed start adapter is one line and exit 2."""
    root, _ = trained
    manifest = json.loads((root / "outputs/pref/train/manifest.json").read_text())
    init = manifest["objective"]["init_adapter"]
    assert init["path"] == "outputs/adapter" and "adapter" not in manifest["inputs"]
    assert init["sha256"] == tree_digest(sha256_tree(root / "outputs/adapter"))
    proc = subprocess.run([sys.executable, "-m", "reprotune.verify", str(root / "outputs/pref/train/manifest.json")],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"output adapter\s+identical", proc.stdout) and "RESULT: identical" in proc.stdout
    assert re.search(r"input\s+data\s+same", proc.stdout)

    # the same run with another start adapter in outputs/adapter: refused before anything is re-run
    copy = tmp_path / "run"
    for rel in ("data/pairs", "outputs/adapter", "outputs/pref/train"):
        shutil.copytree(root / rel, copy / rel)
    weights = copy / "outputs/adapter/adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "reprotune.verify", str(copy / "outputs/pref/train/manifest.json")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "re-running stage" not in proc.stdout, proc.stderr
    assert re.fullmatch(rf"verify: objective.init_adapter: the start adapter {copy}/outputs/adapter is not the one "
                        rf"this run started from \(sha256 [0-9a-f]{{16}}, the manifest records "
                        rf"{init['sha256'][:16]}\); .*", lines[0])


def test_export_paths_of_a_preference_run_are_its_own(tmp_path: Path) -> None:
    cfg = compose(["objective=dpo", f"paths.root={tmp_path}"])  # conf/objective/paths/preference.yaml
    assert (cfg.paths.merged, cfg.paths.gguf, cfg.paths.export_dir) == (
        f"{tmp_path}/outputs/pref/merged", f"{tmp_path}/outputs/pref/gguf", f"{tmp_path}/outputs/pref/export")
    # its inputs and training outputs too, and it starts from the SFT run's adapter, not its own
    assert (cfg.paths.prepared, cfg.paths.adapter, cfg.paths.train_dir, cfg.paths.eval_dir, cfg.paths.checkpoints) == (
        f"{tmp_path}/data/pairs", *(f"{tmp_path}/outputs/pref/{d}" for d in ("adapter", "train", "eval", "checkpoints")))
    assert cfg.objective.init_adapter == f"{tmp_path}/outputs/adapter"
    sft = compose([f"paths.root={tmp_path}"])
    assert (sft.paths.merged, sft.paths.gguf) == (f"{tmp_path}/outputs/merged", f"{tmp_path}/outputs/gguf")


@pytest.mark.slow  # needs the llama.cpp build
def test_gguf_of_text_pairs_checks_and_answers_their_text_prompts(exported: dict, tmp_path: Path) -> None:
    """Text (standard) pairs train on raw text, so gguf_pref checks them as text: llama.cpp tokenizes each holdout
    prompt (real HH transcripts read as TRL's text layout) into the ids HF gives it, as its completion endpoint
    does (no chat template), the greedy answers are compared on them, and the Modelfile passes the prompt as it is
    (no turns, no system prompt). The weights are the shared run's merged preference model: what is checked is
    the export of whatever weights, on text prompts."""
    from reprotune.gguf import gguf
    from reprotune.modelfile import parse_modelfile
    from reprotune.models import load_tokenizer
    from reprotune.prepare import prepare

    root = tmp_path / "run"
    shutil.copytree(exported["root"] / "outputs/pref/merged", root / "outputs/pref/merged")
    over = [*(o for o in exported["over"] if not o.startswith(("paths.root=", "data.path="))),
            f"paths.root={root}", f"data.path={REPO}/tests/data/real/preference/hh_rlhf_harmless_base_test.jsonl",
            "data.format=trl"]
    prepare(compose(over))
    holdout = [json.loads(line) for line in (root / "data/pairs/holdout.jsonl").read_text().splitlines()]
    assert len(holdout) > 2 and all(isinstance(row["prompt"], str) for row in holdout)
    gguf(compose(over))

    report = json.loads((root / "outputs/pref/gguf/parity.json").read_text())
    tokenizer = load_tokenizer(root / "outputs/pref/merged")
    text_ids = [tokenizer(text=row["prompt"])["input_ids"] for row in holdout]
    assert report["prompt_format"] == "text" and report["greedy_prompts"] == 2
    for name in ("F16", "Q8_0"):
        # the prompts' own tokens, as TRL tokenizes a text prompt: no chat turns around them
        assert report["tokenization"][name] == {"identical": True, "prompts": len(holdout),
                                                "tokens": sum(map(len, text_ids))}
        greedy = report["greedy"][name]
        assert greedy["prompts"] == 2 and (greedy["exact_matches"] == 2) == (greedy["token_prefix_agreement"] == 1.0)
    modelfile = parse_modelfile((root / "outputs/pref/gguf/Modelfile").read_text())
    assert modelfile["TEMPLATE"] == ["{{ .Prompt }}"] and "SYSTEM" not in modelfile
    assert modelfile["PARAMETER"] == [f'stop "{tokenizer.eos_token}"']


def test_merge_pref_without_a_preference_adapter_says_which_make_train(tmp_path: Path) -> None:
    from reprotune.merge import merge

    with pytest.raises(ReprotuneError) as err:
        merge(compose(["model=tiny_random", "objective=dpo", f"paths.root={tmp_path}"]))
    assert str(err.value) == (f"{tmp_path}/outputs/pref/adapter/adapter_config.json: file: not found; run "
                              "'make train ARGS=\"objective=dpo\"' first")


@pytest.mark.slow  # full lane: make serve-info in its own process on a preference run
def test_serve_info_of_a_preference_run_names_its_own_gguf_and_adapter(tmp_path: Path) -> None:
    """make serve ARGS="objective=dpo" serves what make gguf ARGS="objective=dpo" wrote (outputs/pref/gguf)."""
    proc = subprocess.run([sys.executable, "-m", "reprotune.serve", "model=tiny_random", "objective=dpo",
                           f"paths.root={tmp_path}", "export.serve.info_only=true"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # before make gguf: the default export.quant=auto has not chosen yet, and serve-info says so
    assert f"# serves {tmp_path}/outputs/pref/gguf/model-<the quant make gguf chooses>.gguf" in proc.stdout
    assert f"--lora-modules reprotune-invoices={tmp_path}/outputs/pref/adapter" in proc.stdout
    assert f"cd {tmp_path}/outputs/pref/gguf && ollama create" in proc.stdout
