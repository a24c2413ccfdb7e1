"""Checkpoints of the train stage: sealed when written, resumed only when whole and of the same configuration.

HF Trainer writes checkpoint-N/ file by file; a kill -9 (or a pod eviction) mid-write leaves a torn folder that
get_last_checkpoint would happily resume from. Each checkpoint is sealed once the Trainer has written it: fsync
every file, then atomically write a marker listing every file's sha256. Only sealed checkpoints whose files still
match their marker are resumed; anything else is removed. Rotation (train.save_total_limit) is done here too, and
runs only after the new checkpoint is sealed, so a crash at any moment leaves at least the previous good
checkpoint on disk.

Reads and writes paths.checkpoints (checkpoint-N/, reprotune-run.json: the configuration's fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from reprotune import distributed
from reprotune.run import Run

log = logging.getLogger("reprotune.train")
CHECKPOINT_SEAL = "reprotune-sealed.json"
RUN_STAMP = "reprotune-run.json"


def config_fingerprint(cfg: DictConfig, run: Run) -> str:
    """What a checkpoint must match to be resumed: everything that shapes training (not paths; the repro mode is
    the stage Run's)."""
    keep = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("model", "method", "data", "train")}
    keep["seed"] = cfg.seed
    keep["repro"] = run.repro
    if cfg.get("objective") and cfg.objective.name != "sft":  # SFT's fingerprint as before the objective group
        keep["objective"] = OmegaConf.to_container(cfg.objective, resolve=True)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()




def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_checkpoint(folder: Path, step: int) -> None:
    """Make a fully written checkpoint folder resumable (atomic: the seal appears last, all at once)."""
    from reprotune.manifest import sha256_tree

    files = sha256_tree(folder, exclude=[CHECKPOINT_SEAL])
    for rel in files:
        _fsync(folder / rel)
    tmp = folder / (CHECKPOINT_SEAL + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1, sort_keys=True))
    _fsync(tmp)
    os.replace(tmp, folder / CHECKPOINT_SEAL)
    _fsync(folder)


def is_sealed(folder: Path) -> bool:
    """True when the folder holds a seal and every file it lists is present with the same sha256."""
    from reprotune.manifest import sha256_file

    seal = folder / CHECKPOINT_SEAL
    try:
        files = json.loads(seal.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return False
    return bool(files) and all((folder / rel).is_file() and sha256_file(folder / rel) == digest
                               for rel, digest in files.items())


def _checkpoint_step(folder: Path) -> int:
    return int(folder.name.rsplit("-", 1)[1]) if folder.name.rsplit("-", 1)[-1].isdigit() else -1


def good_checkpoints(ckpt_root: Path, remove_torn: bool = True) -> list[Path]:
    """Sealed checkpoints, oldest first; torn ones (no seal, or files that changed) are removed."""
    good = []
    for folder in sorted(ckpt_root.glob("checkpoint-*"), key=_checkpoint_step):
        if folder.is_dir() and _checkpoint_step(folder) >= 0 and is_sealed(folder):
            good.append(folder)
        elif remove_torn:
            log.warning("removing torn checkpoint %s (interrupted while being written)", folder)
            shutil.rmtree(folder, ignore_errors=True)
    return good


def sealing_trainer_class(base: type) -> type:
    """`base` (a transformers Trainer: TRL's SFTTrainer, or a preference trainer) whose checkpoints are sealed
    (see above) and rotated only after sealing."""

    class SealedCheckpointTrainer(base):
        keep_checkpoints: int | None = None

        def _save_checkpoint(self, model, trial) -> None:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every rank has written its RNG state before rank 0 seals
            if not self.args.should_save:
                return
            ckpt_root = Path(self.args.output_dir)
            seal_checkpoint(ckpt_root / f"checkpoint-{self.state.global_step}", self.state.global_step)
            if self.keep_checkpoints:
                for old in good_checkpoints(ckpt_root)[:-self.keep_checkpoints]:
                    shutil.rmtree(old, ignore_errors=True)

    return SealedCheckpointTrainer


def checkpoint_to_resume(cfg: DictConfig, run: Run, fingerprint: str, modify: bool = True) -> str | None:
    """The last sealed checkpoint of this same configuration, or None (stale or torn ones are removed, by the
    process that may modify the folder: rank 0 when several train together)."""
    ckpt_root = run.path("checkpoints")
    stamp = ckpt_root / RUN_STAMP
    if cfg.train.run.resume == "never" or not ckpt_root.is_dir():
        if modify:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        return None
    recorded = json.loads(stamp.read_text()).get("fingerprint") if stamp.is_file() else None
    if recorded != fingerprint:
        log.info("discarding checkpoints of a different configuration in %s", ckpt_root)
        if modify:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        return None
    good = good_checkpoints(ckpt_root, remove_torn=modify)
    if good:
        log.info("resuming from %s", good[-1])
        return str(good[-1])
    return None


def prepare_resume(cfg: DictConfig, run: Run, world: distributed.World) -> str | None:
    """The checkpoint to resume from (None: start afresh), after rank 0 has removed stale or torn ones and stamped
    the folder with this configuration's fingerprint."""
    from reprotune.manifest import write_json

    fingerprint = config_fingerprint(cfg, run)
    with distributed.main_process_first():
        resume_from = checkpoint_to_resume(cfg, run, fingerprint, modify=world.is_main)
        if world.is_main:
            run.path("checkpoints").mkdir(parents=True, exist_ok=True)
            write_json(run.path("checkpoints") / RUN_STAMP, {"fingerprint": fingerprint})
    return resume_from


def tokens_seen_before(resume_from: str | None) -> int:
    """Tokens the resumed checkpoint had trained on (tokens/s covers what this process trained)."""
    state = Path(resume_from) / "trainer_state.json" if resume_from else None
    if state is None or not state.is_file():
        return 0
    return int(json.loads(state.read_text()).get("num_input_tokens_seen", 0))
