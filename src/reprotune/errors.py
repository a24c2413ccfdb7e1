"""The one user-facing error, and the one place that turns it into what the user sees.

A stage raises ReprotuneError for anything the user can fix (bad input, a missing earlier output, a check
that refused to ship): one line per problem, `file:line: field: what` where there is a file. Each stage's
command-line entry point runs under `user_errors()`, which prints those lines to stderr, no traceback, and
exits with status 2. Anything else is a bug in reprotune and keeps its traceback.

Two failures that are the machine's, not the code's, are one line too: the disk filling up (the path and the
bytes it needed) and input nested too deep to parse (RecursionError). REPROTUNE_DEBUG=1 re-raises every one of
them with its traceback. `user_errors()` also ties the stage to the process that launched it (Linux
PR_SET_PDEATHSIG): when `make`/dvc dies, even by SIGKILL, the stage gets SIGTERM and writes nothing more.

Under `make` the stage runs inside `dvc repro`, started by reprotune.runner, which names a file in
REPROTUNE_PROBLEMS_FILE: the lines go there instead of stderr, and the runner prints them joined with what it
kept, so a single problem reads as one line through make too (runner.failure_lines).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

EXIT_USER_ERROR = 2
# set by reprotune.runner for the stage it runs through dvc: where user_errors hands its lines over
PROBLEMS_FILE_ENV = "REPROTUNE_PROBLEMS_FILE"
# the disk-full line's closing words; the runner, which names what was kept itself, leaves them out
KEPT = " (the previous outputs are kept)"


class ReprotuneError(Exception):
    """Something the user can fix; `problems` holds one line each (the message is them joined)."""

    def __init__(self, problems: str | list[str], total: int | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        # `total` counts problems past a cap too (a line "... N more problems" stands for the rest)
        self.total = total if total is not None else sum(not p.endswith(" more problems") for p in self.problems)
        super().__init__("\n".join(self.problems))


def debug() -> bool:
    """REPROTUNE_DEBUG=1: every error keeps its traceback (the documented switch, docs/reproducibility.md)."""
    return os.environ.get("REPROTUNE_DEBUG", "") not in ("", "0")


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux; elsewhere a no-op): a stage orphaned by a killed
    make/dvc would otherwise keep running and write its outputs after the user stopped it."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The parent died between the two reads: the request came too late, so act on it now. A parent that is PID 1
    # is not taken as "already orphaned": in a container the stage's launcher (the shell the image runs) is PID 1.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def _free_bytes(path: str) -> int:
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and probe != os.path.dirname(probe):
        probe = os.path.dirname(probe)
    try:
        st = os.statvfs(probe)
    except OSError:
        return -1
    return st.f_bavail * st.f_frsize


def _paths_in_traceback(err: BaseException) -> list[str]:
    """File paths the failing frames held (a library's Rust error, safetensors' 'os error 28', names none)."""
    found = []
    tb = err.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            if isinstance(value, os.PathLike) or (isinstance(value, str) and value.startswith("/")
                                                  and len(value) < 4096 and "\n" not in value):
                found.append(os.fspath(value))
        tb = tb.tb_next
    return found


def _size(nbytes: int) -> str:
    if nbytes >= 10**9:
        return f"{nbytes / 10**9:,.1f} GB"
    if nbytes >= 10**6:
        return f"{nbytes / 10**6:,.1f} MB"
    return f"{nbytes:,} bytes"


def disk_full_line(err: BaseException) -> str:
    """ENOSPC as one line: which path (the one on the fullest filesystem among those the write touched), the
    bytes left there, and the bytes the write needed where the caller knew them (`needs_bytes`)."""
    candidates = [str(err.filename)] if isinstance(err, OSError) and err.filename else []
    candidates += _paths_in_traceback(err) or ["."]
    where = min(reversed(candidates), key=_free_bytes)  # the innermost of the fullest
    needed = _needed_bytes(err)
    space = (f"needs ~{_size(needed)}, {_size(max(0, _free_bytes(where)))} free there" if needed
             else f"{_free_bytes(where):,} bytes free there")
    return f"{where}: disk full (os error 28): {space}; free some space and run again{KEPT}"


def _needed_bytes(err: BaseException | None) -> int | None:
    """The size `needs_bytes` put on the error, or on one it was raised from (a library may wrap it)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if getattr(err, "reprotune_bytes", None):
            return int(err.reprotune_bytes)
        err = err.__cause__ or err.__context__
    return None


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes a set of tensors takes in a safetensors file (their raw data; storage shared by tied weights counted
    once). Duck-typed, so this module needs no torch."""
    sizes: dict[int, int] = {}
    for t in tensors:
        nbytes = int(t.numel()) * int(t.element_size())
        ptr = int(t.data_ptr()) or id(t)  # 0 for tensors without storage (meta): count each
        sizes[ptr] = max(sizes.get(ptr, 0), nbytes)
    return sum(sizes.values())


@contextmanager
def needs_bytes(nbytes: int) -> Iterator[None]:
    """A write whose size is known beforehand: if it fills the disk, the one line (`user_errors`) says how much it
    needed next to how much was free; a library's error (safetensors' Rust 'os error 28') names neither."""
    try:
        yield
    except Exception as err:
        if nbytes and _is_disk_full(err) and _needed_bytes(err) is None:
            with suppress(AttributeError):  # an exception type with __slots__: the line goes without the size
                err.reprotune_bytes = nbytes  # type: ignore[attr-defined]
        raise


def _is_disk_full(err: BaseException) -> bool:
    """ENOSPC, also where a library wraps it (safetensors' Rust error says 'os error 28')."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "os error 28" in str(err) or "No space left on device" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _tell(problems: list[str], summary: str | None = None, total: int | None = None) -> None:
    """The lines of a user error: to the runner's file when a runner asked for them, else to stderr."""
    handoff = os.environ.get(PROBLEMS_FILE_ENV)
    if handoff:
        try:
            with open(handoff, "w", encoding="utf-8") as fh:
                json.dump({"problems": problems, "total": total or len(problems)}, fh)
            return
        except OSError:
            pass  # the runner's folder went away (or the disk is full): say it here instead
    print("\n".join([*problems, *([summary] if summary else [])]), file=sys.stderr)


@contextmanager
def user_errors(summary: str | None = None) -> Iterator[None]:
    """Run a stage's body: a ReprotuneError becomes its lines on stderr (+ `summary`) and exit status 2;
    a full disk and too-deep input become one line each (exit 2); REPROTUNE_DEBUG=1 keeps the tracebacks."""
    die_with_parent()
    try:
        yield
    except ReprotuneError as err:
        if debug():
            raise
        _tell(err.problems, summary.format(count=err.total) if summary else None, err.total)
        sys.exit(EXIT_USER_ERROR)
    except RecursionError:
        if debug():
            raise
        _tell(["input: nested too deeply to process (RecursionError); flatten the record "
               "(REPROTUNE_DEBUG=1 shows where)"])
        sys.exit(EXIT_USER_ERROR)
    except Exception as err:
        if debug() or not _is_disk_full(err):
            raise
        _tell([disk_full_line(err)])
        sys.exit(EXIT_USER_ERROR)
