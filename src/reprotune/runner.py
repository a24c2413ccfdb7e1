"""What every stage target runs: `make <stage> ARGS=...` == `python -m reprotune.runner <stage> ARGS...`.

    python -m reprotune.runner train model=tiny_random   # lock, compose params.yaml, dvc repro train
    python -m reprotune.runner train objective=dpo       # params.yaml + params_pref.yaml, dvc repro train_pref
    python -m reprotune.runner all ...                   # make repro: every stage of both chains

In this order, so that nothing is lost or mis-recorded:
1. **One run per checkout.** An exclusive flock on `.dvc/tmp/reprotune-run.lock`, taken before anything is
   written: a second run stops at once with one line naming the holder (pid, command, since when). The kernel
   drops the lock when the holder exits in any way, SIGKILL included, so a lock file left behind is stale by
   construction (its text is only the last holder's description).
2. **Settings checked, then params.yaml.** `config.compose_checked`: a credential, an unknown key or preset, a
   value of the wrong type is one line, and params.yaml is left as it was. With a preference objective in the
   ARGS (and for make repro) params_pref.yaml too, and params.yaml from the same ARGS without the objective ones
   (`config.dump_chain_params`); the target's stage is then the preference one (make train -> train_pref).
3. **dvc repro** in its own process group; SIGTERM/SIGINT/SIGHUP to this process (make forwards nothing, so
   this process also asks for SIGTERM when make itself dies) are passed on to the whole group: dvc, the
   stage and its workers stop at once. The stage outputs are `persist: true` in dvc.yaml, so DVC no longer
   deletes them before the command runs; each stage builds its outputs aside and swaps them in (io.py). A
   failed, refused or stopped stage therefore leaves the previous outputs and dvc.lock as they were.
4. **One line about it.** The stage hands its error lines to this runner through a file
   (errors.PROBLEMS_FILE_ENV) instead of printing them, and the runner prints the reason and what it kept as
   one line (failure_lines); DVC's own "failed to reproduce" line is left out.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from reprotune.errors import (
    EXIT_USER_ERROR,
    KEPT,
    PROBLEMS_FILE_ENV,
    ReprotuneError,
    die_with_parent,
    user_errors,
)

LOCK = Path(".dvc/tmp/reprotune-run.lock")
# where the stage's user_errors hands over its lines (errors.PROBLEMS_FILE_ENV), written under the run lock
PROBLEMS = Path(".dvc/tmp/reprotune-problems.json")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# after SIGTERM a stage gets this long to stop before its group is killed
GRACE_S = 20.0
# the stage outputs, for the closing line (dvc.yaml's outs, metrics and plots of each stage)
DVC_YAML = Path("dvc.yaml")


# ------------------------------------------------------------------------------------------------ the lock
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


# --------------------------------------------------------------------------------------------- the outputs
def stage_outputs(stage: str) -> list[str]:
    """Outputs of <stage> ('all': of every stage), as dvc.yaml lists them."""
    import yaml

    stages = yaml.safe_load(DVC_YAML.read_text())["stages"]
    found = []
    for name in stages if stage == "all" else [stage]:
        for kind in ("outs", "metrics", "plots"):
            for item in stages[name].get(kind, []):
                found.append(next(iter(item)) if isinstance(item, dict) else item)
    return found


def kept_line(stage: str, how: str) -> str:
    from reprotune.pipeline import STAGES

    present = [p for p in stage_outputs(stage) if Path(p).exists()]
    whose = "every stage" if stage == "all" else f"{stage} and the stages before it"
    kept = f" ({', '.join(present)})" if present else " (none existed yet)"
    target = (STAGES[stage].target or stage) if stage in STAGES else stage  # train_pref: make train
    return f"make {target}: {how}; the previous outputs of {whose} are kept as they were{kept}, as dvc.lock records them"


def failure_lines(stage: str, how: str, handoff: Path = PROBLEMS) -> list[str]:
    """What the user reads when the stage failed: its problems and what was kept, the last problem and the kept
    note joined, so one problem is one line (several: one each, then the count with the kept note)."""
    try:
        told = json.loads(handoff.read_text(encoding="utf-8"))
        problems = [p.removesuffix(KEPT) for p in told["problems"]]
        total = int(told["total"])
    except (OSError, ValueError, KeyError, TypeError):
        return [kept_line(stage, how)]  # the stage said nothing through the file (a crash, a signal)
    if len(problems) == 1:
        return [f"{problems[0]}; {kept_line(stage, how)}"]
    return [*problems, kept_line(stage, f"{how} ({total} problems)")]


# ------------------------------------------------------------------------------------------- dvc, guarded
def group_members(pgid: int) -> list[int]:
    """Processes of a process group (Linux /proc; elsewhere just the group leader)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return [pgid]
    for entry in filter(str.isdigit, entries):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
        if len(fields) > 2 and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


class Forwarder:
    """Signals to this process go to dvc's process group; the first one also starts the grace timer."""

    def __init__(self, child: subprocess.Popen) -> None:
        self.child = child
        self.signum: int | None = None
        self.deadline: float | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum
        self.deadline = self.deadline or time.monotonic() + GRACE_S
        # the stage (and its workers) first: dvc then sees its command fail and exits the normal way, releasing
        # its own locks and leaving dvc.lock as it was; dvc itself only when no command of it runs right now
        members = [pid for pid in group_members(self.child.pid) if pid != self.child.pid]
        for pid in members or [self.child.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)

    def wait(self) -> int:
        while True:
            try:
                return self.child.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                if self.deadline is not None and time.monotonic() > self.deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(self.child.pid, signal.SIGKILL)


def _dvc_in_group() -> None:
    """In the dvc child, before exec: its own process group (signals reach the stage through it), and
    SIGTERM when this runner dies (even by SIGKILL)."""
    os.setpgid(0, 0)
    die_with_parent()


DVC_FAILED = b"ERROR: failed to reproduce"


def _relay(stream: IO[bytes], out: IO[bytes]) -> None:
    """Copy dvc's stderr through, minus DVC's own 'ERROR: failed to reproduce ...' line: the stage printed
    the reason and this runner prints what was kept, so the user reads one line about the failure."""
    pending = b""
    while chunk := stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536):
        pending += chunk
        lines = pending.split(b"\n")
        pending = lines.pop()
        for line in lines:
            if not line.startswith(DVC_FAILED):
                out.write(line + b"\n")
        if pending and not DVC_FAILED.startswith(pending[: len(DVC_FAILED)]):
            out.write(pending)  # a progress bar without a newline yet: show it now
            pending = b""
        out.flush()
    if pending and not pending.startswith(DVC_FAILED):
        out.write(pending)
        out.flush()


def dvc_repro(stage: str) -> tuple[int, int | None]:
    """Run `dvc repro [stage]` guarded; (exit status, the signal that stopped it or None)."""
    import threading

    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
           PROBLEMS_FILE_ENV: str(PROBLEMS.resolve())}
    cmd = [str(Path(bindir) / "dvc"), "repro", *([] if stage == "all" else [stage])]
    child = subprocess.Popen(cmd, env=env, preexec_fn=_dvc_in_group, stderr=subprocess.PIPE)  # noqa: PLW1509
    forward = Forwarder(child)
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    relay = threading.Thread(target=_relay, args=(child.stderr, sys.stderr.buffer), daemon=True)
    relay.start()
    try:
        code = forward.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        relay.join(timeout=5)
    return code, forward.signum


def dvc_stage(target: str, preference: bool) -> str:
    """The DVC stage a make target runs: with a preference objective, the registry's preference stage of that
    target (make train -> train_pref); one line for a target that has none."""
    from reprotune.pipeline import DVC_STAGES

    if target == "all":
        return target
    found = [name for name, st in DVC_STAGES.items() if (st.target or name) == target and st.preference == preference]
    if not found:
        chain = [n for n, st in DVC_STAGES.items() if st.preference == preference]
        which = "the preference chain (objective=dpo|orpo|kto)" if preference else "the SFT chain"
        raise ReprotuneError(f"make {target}: no stage of {which}: its stages are {', '.join(chain)} (make "
                             f"{', '.join(dict.fromkeys(DVC_STAGES[n].target or n for n in chain))})")
    return found[0]


def names_preference(overrides: list[str]) -> bool:
    """The overrides pick a preference objective (objective=dpo, ...): composed to know (one line if they are bad)."""
    from reprotune.config import compose_checked, is_objective_override
    from reprotune.preference import is_preference

    return any(is_objective_override(o) for o in overrides) and is_preference(compose_checked(overrides))


def write_params(target: str, overrides: list[str], preference: bool) -> None:
    """params.yaml (SFT) and, for a preference objective or make repro, params_pref.yaml (reprotune.config)."""
    from reprotune.config import PARAMS_FILE, dump_chain_params, dump_params

    if preference or target == "all":
        dump_chain_params(overrides)
        print("wrote params.yaml, params_pref.yaml", flush=True)
    else:
        dump_params(overrides, Path(PARAMS_FILE))
        print("wrote params.yaml", flush=True)


def run(stage: str, overrides: list[str]) -> int:
    command = " ".join(["make", stage, *([f"ARGS={' '.join(overrides)}"] if overrides else [])])
    with checkout_lock(command):
        preference = names_preference(overrides)
        target = dvc_stage(stage, preference)  # make train ARGS="objective=dpo" -> train_pref; refused before
        write_params(stage, overrides, preference)  # params.yaml changes
        stage = target
        PROBLEMS.unlink(missing_ok=True)  # a file left by an earlier run is not this run's
        try:
            code, signum = dvc_repro(stage)
            if signum is not None:
                print(kept_line(stage, f"stopped by {signal.Signals(signum).name}"), file=sys.stderr)
                return 128 + signum
            if code != 0:
                print("\n".join(failure_lines(stage, "failed")), file=sys.stderr)
            return code
        finally:
            PROBLEMS.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m reprotune.runner <stage|all> [overrides...]", file=sys.stderr)
        return EXIT_USER_ERROR
    die_with_parent()  # make forwards no signal: when make dies, so does this run (and, through it, the stage)
    with user_errors():
        return run(argv[0], argv[1:])
    return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
