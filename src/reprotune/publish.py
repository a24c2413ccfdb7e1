"""Publish stage (opt-in): push the adapter or the merged model to the Hugging Face Hub.

    python -m reprotune.publish export.publish.repo_id=me/my-adapter                    # dry run
    python -m reprotune.publish export.publish.repo_id=me/my-adapter export.publish.push=true

Nothing leaves the machine unless export.publish.push=true, and never for private data: when the dataset
config (data.private) or the training run that made the adapter (outputs/train/manifest.json) marks the
data private, the stage refuses before looking at anything else. A preference run's adapter (objective=dpo|orpo|
kto: outputs/pref/adapter or outputs/pref/merged) carries what its start adapter learnt too, so the training record
of that start adapter (the SFT run's outputs/train/manifest.json, matched by the adapter's sha256) is checked as
well, and a start adapter without one is refused. The token comes from HF_TOKEN in the environment and is never
written anywhere.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from reprotune.config import CONF_DIR
from reprotune.errors import ReprotuneError, user_errors
from reprotune.run import Run, resolve

log = logging.getLogger("reprotune.publish")


def _private_record(manifest: Path, record: dict, what: str) -> str | None:
    """Why a training record (read from manifest) forbids publishing (its data private), or None."""
    data = record.get("config", {}).get("data", {})
    if data.get("private", False):
        return f"{what} was trained on private data ({manifest}: data '{data.get('name')}' private=true)"
    return None


def _start_adapter_record(record: dict, sft_train_dir: Path) -> tuple[dict | None, Path | None]:
    """A preference run's start adapter (objective.init_adapter in its training record: path and sha256) and the
    training record that produced it (the SFT run's, when its adapter has that sha256), else None."""
    start = (record.get("objective") or {}).get("init_adapter")
    if not start:
        return None, None
    sft = sft_train_dir / "manifest.json"
    if sft.is_file():
        made = json.loads(sft.read_text()).get("outputs", {}).get("adapter", {}).get("sha256")
        if made and made == start.get("sha256"):
            return start, sft
    return start, None


def trained_on_private_data(cfg: DictConfig, run: Run, sft_train_dir: Path | None = None) -> str | None:
    """Why publishing is refused, or None: the current data config, the adapter's own training record (in the
    Run's paths.train_dir), and for a preference run the record of the adapter it started from (sft_train_dir: the
    SFT run's train folder)."""
    if cfg.data.private:
        return f"data '{cfg.data.name}' is marked private (data.private=true)"
    manifest = run.path("train_dir") / "manifest.json"
    if not manifest.is_file():
        return None
    own = json.loads(manifest.read_text())
    reason = _private_record(manifest, own, "the adapter")
    if reason or sft_train_dir is None:
        return reason
    start, record = _start_adapter_record(own, sft_train_dir)
    if start is None:
        return None  # a fresh adapter (objective.init_adapter=null): its own record is the whole story
    if record is None:
        return (f"the adapter started from {start.get('path')} (sha256 {str(start.get('sha256'))[:12]}...), and no "
                f"training record of that adapter was found ({sft_train_dir}/manifest.json): its data cannot be "
                "checked")
    return _private_record(record, json.loads(record.read_text()), "the adapter it started from")


def folder_to_publish(cfg: DictConfig, run: Run) -> Path:
    what, obj = cfg.export.publish.what, run.objective
    if what not in ("adapter", "merged"):
        raise ReprotuneError(f"publish: export.publish.what must be 'adapter' or 'merged', not {what!r}")
    folder = run.path("adapter" if what == "adapter" else "merged")
    if not folder.is_dir():
        raise ReprotuneError(f"publish: {folder} not found; run 'make {'train' if what == 'adapter' else 'merge'}"
                             f"{obj.make_args}' first")
    return folder


def publish(cfg: DictConfig, resolved: Run | None = None) -> dict[str, Any]:
    """resolved: the stage's Run (main resolves it first; a caller without one: resolve(cfg, "publish"))."""
    resolved = resolved if resolved is not None else resolve(cfg, "publish")
    # a preference run (its adapter, merged model and training record under outputs/pref) started from the SFT run's
    sft_train_dir = resolved.path("sft_train_dir") if resolved.paths.get("sft_train_dir") else None
    reason = trained_on_private_data(cfg, resolved, sft_train_dir)
    if reason:
        raise ReprotuneError(f"publish: refusing to publish: {reason}. Adapters trained on private data stay local.")
    repo_id = cfg.export.publish.repo_id
    if not repo_id:
        raise ReprotuneError("publish: set export.publish.repo_id=<user-or-org>/<name>")
    folder = folder_to_publish(cfg, resolved)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    plan = {"repo_id": str(repo_id), "folder": folder.as_posix(), "files": files,
            "private_repo": bool(cfg.export.publish.private_repo), "push": bool(cfg.export.publish.push)}
    if not cfg.export.publish.push:
        print(f"publish (dry run): would upload {len(files)} files from {folder} to "
              f"https://huggingface.co/{repo_id} (private={plan['private_repo']}):")
        print("\n".join(f"  {f}" for f in files))
        print("  add export.publish.push=true to upload (HF_TOKEN from the environment)")
        return plan
    if not os.environ.get("HF_TOKEN"):
        raise ReprotuneError("publish: export.publish.push=true needs HF_TOKEN in the environment")
    from huggingface_hub import HfApi

    api = HfApi()  # reads HF_TOKEN itself; we never handle the value
    api.create_repo(str(repo_id), private=plan["private_repo"], exist_ok=True)
    commit = api.upload_folder(repo_id=str(repo_id), folder_path=str(folder),
                               commit_message=f"reprotune: upload {cfg.export.publish.what}")
    log.info("published %s to %s", folder, getattr(commit, "commit_url", repo_id))
    return plan


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run = resolve(cfg, "publish")
        publish(cfg, run)


if __name__ == "__main__":
    main()
