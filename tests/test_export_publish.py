"""make publish is opt-in and refuses private data; without network we test up to the refusal and the dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.publish import publish

from .conftest import REPO


def fake_adapter(root: Path, private: bool | None) -> None:
    adapter = root / "outputs/adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    if private is not None:
        (root / "outputs/train").mkdir(parents=True)
        (root / "outputs/train/manifest.json").write_text(
            json.dumps({"config": {"data": {"name": "invoices", "private": private}}}))


def test_refuses_private_dataset_config_even_when_asked_to_push(tmp_path: Path) -> None:
    fake_adapter(tmp_path, None)
    cfg = compose([f"paths.root={tmp_path}", "export.publish.repo_id=me/x", "export.publish.push=true"])
    assert cfg.data.private is True  # the built-in invoices are marked private
    with pytest.raises(ReprotuneError, match=r"refusing to publish: data 'invoices' is marked private"):
        publish(cfg)


def test_refuses_adapter_whose_training_run_used_private_data(tmp_path: Path) -> None:
    fake_adapter(tmp_path, private=True)
    cfg = compose([f"paths.root={tmp_path}", "data.private=false", "export.publish.repo_id=me/x"])
    with pytest.raises(ReprotuneError, match=r"the adapter was trained on private data"):
        publish(cfg)


def test_dry_run_lists_files_and_uploads_nothing(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    fake_adapter(tmp_path, private=False)
    plan = publish(compose([f"paths.root={tmp_path}", "data.private=false", "export.publish.repo_id=me/x"]))
    assert plan["push"] is False and plan["files"] == ["adapter_config.json", "adapter_model.safetensors"]
    out = capsys.readouterr().out
    assert "publish (dry run): would upload 2 files" in out and "https://huggingface.co/me/x" in out


def test_push_needs_repo_id_and_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_adapter(tmp_path, private=False)
    base = [f"paths.root={tmp_path}", "data.private=false"]
    with pytest.raises(ReprotuneError, match="set export.publish.repo_id"):
        publish(compose(base))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(ReprotuneError, match="needs HF_TOKEN"):
        publish(compose([*base, "export.publish.repo_id=me/x", "export.publish.push=true"]))


def test_make_publish_exits_nonzero_without_traceback(tmp_path: Path) -> None:
    fake_adapter(tmp_path, None)
    proc = subprocess.run([sys.executable, "-m", "reprotune.publish", f"paths.root={tmp_path}",
                           "export.publish.repo_id=me/x", "export.publish.push=true"],
                          capture_output=True, text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO / "src")))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "publish: refusing to publish: data 'invoices' is marked private (data.private=true). "
        "Adapters trained on private data stay local."]


def fake_preference_adapter(root: Path, sft_private: bool | None, start_sha: str = "abc123") -> None:
    """outputs/pref/adapter trained (not on private data) from the SFT adapter of sha256 start_sha; the SFT run's
    record (outputs/train/manifest.json) made an adapter of sha256 abc123 on data private or not (None: no record)."""
    adapter = root / "outputs/pref/adapter"
    adapter.mkdir(parents=True)
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    (root / "outputs/pref/train").mkdir(parents=True)
    (root / "outputs/pref/train/manifest.json").write_text(json.dumps(
        {"config": {"data": {"name": "invoices", "private": False}},
         "objective": {"name": "dpo", "init_adapter": {"path": "outputs/adapter", "sha256": start_sha}}}))
    if sft_private is not None:
        (root / "outputs/train").mkdir(parents=True)
        (root / "outputs/train/manifest.json").write_text(json.dumps(
            {"config": {"data": {"name": "invoices", "private": sft_private}},
             "outputs": {"adapter": {"sha256": "abc123"}}}))


def test_a_preference_adapter_is_refused_when_its_start_adapter_learnt_private_data(tmp_path: Path) -> None:
    fake_preference_adapter(tmp_path, sft_private=True)
    cfg = compose([f"paths.root={tmp_path}", "objective=dpo", "data.private=false", "export.publish.repo_id=me/x"])
    with pytest.raises(ReprotuneError, match=r"the adapter it started from was trained on private data "
                                             r"\(.*outputs/train/manifest.json: data 'invoices' private=true\)"):
        publish(cfg)


@pytest.mark.parametrize("case", ["no SFT record", "another adapter's record"])
def test_a_preference_adapter_whose_start_adapter_has_no_record_is_refused(tmp_path: Path, case: str) -> None:
    if case == "no SFT record":
        fake_preference_adapter(tmp_path, sft_private=None)
    else:
        fake_preference_adapter(tmp_path, sft_private=False, start_sha="def456")
    cfg = compose([f"paths.root={tmp_path}", "objective=dpo", "data.private=false", "export.publish.repo_id=me/x"])
    with pytest.raises(ReprotuneError, match=r"started from outputs/adapter .*no training record of that adapter"):
        publish(cfg)


def test_a_preference_adapter_from_a_public_sft_adapter_publishes_its_own_folder(tmp_path: Path) -> None:
    fake_preference_adapter(tmp_path, sft_private=False)
    plan = publish(compose([f"paths.root={tmp_path}", "objective=dpo", "data.private=false",
                            "export.publish.repo_id=me/x"]))
    assert plan["folder"] == f"{tmp_path}/outputs/pref/adapter" and plan["files"] == ["adapter_model.safetensors"]
    with pytest.raises(ReprotuneError, match=r'outputs/pref/merged not found; run \'make merge ARGS="objective=dpo"'):
        publish(compose([f"paths.root={tmp_path}", "objective=dpo", "data.private=false",
                         "export.publish.repo_id=me/x", "export.publish.what=merged"]))
