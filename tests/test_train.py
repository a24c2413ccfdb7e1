"""Train stage on the tiny random model: outputs, manifest, privacy, determinism, loud failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.manifest import sha256_tree, tree_digest
from reprotune.train import train

from .conftest import TINY_TRAIN

FAKE_SECRET = "hf_FAKEsecretTOKEN1234567890"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    import os

    from reprotune.invoices import generate

    from .conftest import write_jsonl

    root = tmp_path_factory.mktemp("tiny")
    write_jsonl(root / "data/prepared/train.jsonl", generate(32, seed=7))
    os.environ["HF_TOKEN"] = FAKE_SECRET
    os.environ["WANDB_API_KEY"] = "wandbFAKEkey0987654321"
    try:
        record = train(compose([*TINY_TRAIN, f"paths.root={root}"]))
    finally:
        os.environ.pop("HF_TOKEN")
        os.environ.pop("WANDB_API_KEY")
    return root, record


def test_outputs_at_fixed_paths(tiny_run: tuple[Path, dict]) -> None:
    root, _ = tiny_run
    adapter = root / "outputs/adapter"
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "chat_template.jinja",
                 "README.md"):
        assert (adapter / name).is_file(), name
    assert "<|im_start|>" in (adapter / "chat_template.jinja").read_text()
    assert "{% generation %}" not in (adapter / "chat_template.jinja").read_text()  # inference template
    for name in ("metrics.json", "loss_curves.json", "loss.png", "manifest.json"):
        assert (root / "outputs/train" / name).is_file(), name
    assert (root / "outputs/train/loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (root / "outputs/checkpoints").exists()  # a finished run leaves no checkpoints to resume


def test_metrics_and_manifest(tiny_run: tuple[Path, dict]) -> None:
    root, record = tiny_run
    metrics = json.loads((root / "outputs/train/metrics.json").read_text())
    assert metrics["global_step"] == 3
    assert len(json.loads((root / "outputs/train/loss_curves.json").read_text())["train"]) == 3
    assert metrics["assistant_tokens"] > 0 and metrics["tokens_seen"] > metrics["train_examples"]
    manifest = json.loads((root / "outputs/train/manifest.json").read_text())
    assert manifest["config"]["model"]["name"] == "tiny_random"
    assert manifest["config"]["train"]["report_to"] == "none"
    assert set(manifest["git"]) == {"commit", "dirty"}
    assert len(manifest["lock"]["sha256"]) == 64
    assert manifest["packages"]["key"]["trl"] and manifest["packages"]["key"]["peft"]
    assert manifest["runtime"]["python"] and manifest["runtime"]["torch"].startswith("2.13.0")
    assert manifest["hardware"]["cpu_count"] >= 1 and manifest["device"] == "cpu"
    assert manifest["seeds"]["seed"] == 42
    assert len(manifest["inputs"]["train_data"]["sha256"]) == 64
    adapter_files = sha256_tree(root / "outputs/adapter")
    assert manifest["outputs"]["adapter"]["sha256"] == tree_digest(adapter_files)
    assert manifest["timing"]["tokens_per_second"] > 0 and manifest["timing"]["wall_seconds"] > 0


def test_no_secret_in_any_output(tiny_run: tuple[Path, dict]) -> None:
    root, _ = tiny_run
    for path in (root / "outputs").rglob("*"):
        if path.is_file():
            blob = path.read_bytes()
            assert FAKE_SECRET.encode() not in blob, path
            assert b"wandbFAKEkey0987654321" not in blob, path


@pytest.mark.slow  # full lane: two training runs (test_repro_golden's golden bytes are the fast lane's)
def test_two_runs_give_byte_identical_adapters(tiny_run: tuple[Path, dict], tmp_path: Path) -> None:
    from reprotune.invoices import generate

    from .conftest import write_jsonl

    root, record = tiny_run
    write_jsonl(tmp_path / "data/prepared/train.jsonl", generate(32, seed=7))
    again = train(compose([*TINY_TRAIN, f"paths.root={tmp_path}"]))
    assert again["outputs"]["adapter"]["files"] == record["outputs"]["adapter"]["files"]
    assert (tmp_path / "outputs/train/metrics.json").read_bytes() == (root / "outputs/train/metrics.json").read_bytes()


def test_empty_loss_mask_fails_loudly(workspace: tuple[Path, list[str]], tmp_path: Path) -> None:
    # a "training" template whose generation block is empty: no token would ever be learned
    template = tmp_path / "empty_mask.jinja"
    template.write_text(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
        "{% generation %}{% endgeneration %}{% endfor %}")
    root, overrides = workspace
    with pytest.raises((RuntimeError, ReprotuneError), match="assistant"):  # TRL checks first, per example
        train(compose([*TINY_TRAIN, *overrides, f"model.training_chat_template={template}"]))
    assert not (root / "outputs/adapter").exists()


def test_missing_prepared_data_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ReprotuneError, match="train.jsonl: file: not found; run 'make prepare' first"):
        train(compose([*TINY_TRAIN, f"paths.root={tmp_path}"]))


@pytest.mark.slow  # full lane: a QLoRA and a DoRA training run (LoRA's is the fast lane's)
@pytest.mark.parametrize("method", ["qlora", "dora"])
def test_other_methods_train(method: str, workspace: tuple[Path, list[str]]) -> None:
    root, overrides = workspace
    record = train(compose([*TINY_TRAIN, *overrides, f"method={method}", "train.max_steps=2"]))
    config = json.loads((root / "outputs/adapter/adapter_config.json").read_text())
    assert config["use_dora"] is (method == "dora")
    assert bool(record["config"]["method"]["quantization"]) is (method == "qlora")


@pytest.mark.slow  # training subprocesses
def test_adapter_does_not_depend_on_the_hash_seed_or_the_cache_location(workspace: tuple[Path, list[str]],
                                                                        tmp_path_factory) -> None:
    """Two processes with different PYTHONHASHSEED and the model cache in two different places (REPROTUNE_CACHE
    unset, and an absolute path elsewhere, as in a pod) write byte-identical adapters (PEFT keeps target_modules
    in a set; it records the base by its load path): the base is named by its identity, never a path."""
    import os
    import subprocess
    import sys

    from reprotune.manifest import sha256_tree

    root, overrides = workspace
    trees = []
    elsewhere = {"REPROTUNE_CACHE": str(tmp_path_factory.mktemp("other-cache"))}
    for seed, extra in (("1", {}), ("2", elsewhere)):
        out = root / f"run{seed}"
        (out / "data").mkdir(parents=True)
        (out / "data/prepared").symlink_to(root / "data/prepared")
        env = {k: v for k, v in os.environ.items() if k != "REPROTUNE_CACHE"}
        subprocess.run([sys.executable, "-m", "reprotune.train", *TINY_TRAIN, "train.max_steps=1",
                        f"paths.root={out}"], check=True, capture_output=True, timeout=600,
                       env=dict(env, PYTHONHASHSEED=seed, **extra))
        trees.append(sha256_tree(out / "outputs/adapter"))
    assert any(Path(elsewhere["REPROTUNE_CACHE"]).glob("models/random-*/config.json"))  # really materialised there
    assert trees[0] == trees[1]
    config = json.loads((root / "run1/outputs/adapter/adapter_config.json").read_text())
    assert config["base_model_name_or_path"].startswith("random_init:tiny_random@"), config
    assert "/" not in config["base_model_name_or_path"] and config["revision"] is None


def test_base_identity_maps_back_to_the_local_model() -> None:
    """Every source has an identity without a host path, and reprotune's loader maps it back."""
    from reprotune.errors import ReprotuneError
    from reprotune.models import base_identity, resolve_base_identity, resolve_model_dir

    tiny = compose(["model=tiny_random"])
    identity, revision = base_identity(tiny.model)
    assert revision is None
    assert resolve_base_identity(identity, tiny.paths.model_cache) == resolve_model_dir(tiny.model,
                                                                                          tiny.paths.model_cache)
    builtin = compose([]).model
    assert base_identity(builtin) == (f"builtin:smollm2_135m@{builtin.builtin.sha256}", None)
    hub = compose(["model=qwen3_8b", "model.revision=abc123"]).model
    assert base_identity(hub) == ("Qwen/Qwen3-8B", "abc123")
    assert resolve_base_identity("Qwen/Qwen3-8B", "unused") == "Qwen/Qwen3-8B"
    local = compose(["model=llama32_1b", "model.source=local", "model.path=/data/models/my-llama"]).model
    assert base_identity(local) == ("local:my-llama", None)
    # a preset whose spec changed since the adapter was trained is refused, not silently swapped
    with pytest.raises(ReprotuneError, match="conf/model/tiny_random.yaml now describes random_init:tiny_random@"):
        resolve_base_identity("random_init:tiny_random@0000000000000000", tiny.paths.model_cache)


@pytest.mark.slow  # full lane: two training runs
def test_hub_preset_from_two_local_copies_gives_identical_adapters(tmp_path: Path) -> None:
    """The README's `model=qwen3_8b model.path=/models/Qwen3-8B`, with the same (tiny) weights kept in two
    different directories: the adapter names the hub id and revision, never the directory, so both runs write
    the same bytes; the manifest records a digest of the weights loaded; merge's check finds the base again."""
    import shutil

    from reprotune.invoices import generate
    from reprotune.merge import check_adapter
    from reprotune.models import resolve_model_dir

    from .conftest import write_jsonl

    tiny = compose(["model=tiny_random"])
    source = Path(resolve_model_dir(tiny.model, tiny.paths.model_cache))
    rows = generate(16, seed=7)
    records, trees = [], []
    for name in ("hostA/models/Qwen3-8B", "hostB/weights/qwen"):
        weights = tmp_path / name
        shutil.copytree(source, weights, ignore=shutil.ignore_patterns("reprotune-source.json"))
        root = tmp_path / f"run-{name.split('/')[0]}"
        write_jsonl(root / "data/prepared/train.jsonl", rows)
        cfg = compose(["model=qwen3_8b", f"model.path={weights}", "model.revision=0123abc", "hardware=cpu",
                       "model.training_chat_template=conf/chat_templates/chatml_training.jinja",
                       *TINY_TRAIN[1:], "train.max_steps=1", f"paths.root={root}"])
        records.append(train(cfg))
        adapter = root / "outputs/adapter"
        trees.append(sha256_tree(adapter))
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert (config["base_model_name_or_path"], config["revision"]) == ("Qwen/Qwen3-8B", "0123abc")
        assert str(tmp_path) not in (adapter / "adapter_config.json").read_text()
        check_adapter(adapter, cfg.model)  # make merge / make eval: the base is found through model.path
    assert trees[0] == trees[1]
    digests = [r["inputs"]["base_model"]["sha256"] for r in records]
    assert digests[0] == digests[1] and digests[0] == tree_digest(sha256_tree(tmp_path / "hostA/models/Qwen3-8B"))


def test_hub_preset_without_a_hub_id_is_refused_for_a_local_dir(tmp_path: Path) -> None:
    from reprotune.models import base_identity

    cfg = compose(["model=qwen3_8b", "model.name=renamed", f"model.path={tmp_path}"])
    with pytest.raises(ReprotuneError, match="model.path: .* is a local directory"):
        base_identity(cfg.model)
