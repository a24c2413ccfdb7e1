"""The checkout's run lock: one `make <stage>` (reprotune.runner) or `make init` (reprotune.project) at a time.

An exclusive flock on `.dvc/tmp/reprotune-run.lock`, taken before anything is written: a second run stops at once
with one line naming the holder (pid, command, since when). The kernel drops the lock when the holder exits in any
way, SIGKILL included, so a lock file left behind is stale by construction (its text is only the last holder's
description)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from reprotune.errors import ReprotuneError

LOCK = Path(".dvc/tmp/reprotune-run.lock")


def holder_line(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text() or "{}")
    except (OSError, json.JSONDecodeError):
        info = {}
    if not info:
        return f"another run holds this checkout ({lock})"
    return (f"another run holds this checkout: pid {info.get('pid')} ({info.get('command')}) since "
            f"{info.get('since')}; wait for it or stop it (kill {info.get('pid')}); nothing was changed")


@contextlib.contextmanager
def checkout_lock(command: str, lock: Path = LOCK) -> Iterator[IO[str]]:
    """Hold the checkout's run lock for the block, or raise ReprotuneError at once naming who holds it."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    handle = open(lock, "a+", encoding="utf-8")  # noqa: SIM115 - held for the whole block
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ReprotuneError(holder_line(lock)) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "command": command,
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n")
        handle.flush()
        yield handle
    finally:
        handle.close()  # closing the descriptor releases the flock (so does any exit, SIGKILL included)
