"""Publish stage (opt-in): push the adapter or the merged model to the Hugging Face Hub.

    python -m reprotune.publish export.publish.repo_id=me/my-adapter                    # dry run
    python -m reprotune.publish export.publish.repo_id=me/my-adapter export.publish.push=true

Nothing leaves the machine unless export.publish.push=true, and never for private data: when the dataset
config (data.private) or the training run that made the adapter (outputs/train/manifest.json) marks the
data private, the stage refuses before looking at anything else. The token comes from HF_TOKEN in the
environment and is never written anywhere.
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

log = logging.getLogger("reprotune.publish")


def trained_on_private_data(cfg: DictConfig) -> str | None:
    """Why publishing is refused, or None: the current data config or the adapter's own training record."""
    if cfg.data.private:
        return f"data '{cfg.data.name}' is marked private (data.private=true)"
    manifest = Path(cfg.paths.train_dir) / "manifest.json"
    if manifest.is_file():
        data = json.loads(manifest.read_text()).get("config", {}).get("data", {})
        if data.get("private", False):
            return f"the adapter was trained on private data ({manifest}: data '{data.get('name')}' private=true)"
    return None


def folder_to_publish(cfg: DictConfig) -> Path:
    what = cfg.export.publish.what
    if what not in ("adapter", "merged"):
        raise ReprotuneError(f"publish: export.publish.what must be 'adapter' or 'merged', not {what!r}")
    folder = Path(cfg.paths.adapter if what == "adapter" else cfg.paths.merged)
    if not folder.is_dir():
        raise ReprotuneError(f"publish: {folder} not found; run 'make {'train' if what == 'adapter' else 'merge'}' first")
    return folder


def publish(cfg: DictConfig) -> dict[str, Any]:
    reason = trained_on_private_data(cfg)
    if reason:
        raise ReprotuneError(f"publish: refusing to publish: {reason}. Adapters trained on private data stay local.")
    repo_id = cfg.export.publish.repo_id
    if not repo_id:
        raise ReprotuneError("publish: set export.publish.repo_id=<user-or-org>/<name>")
    folder = folder_to_publish(cfg)
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
        publish(cfg)


if __name__ == "__main__":
    main()
