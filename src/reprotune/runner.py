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
   Then, still before params.yaml changes: the data the stages read exists (check_data), and a target that only
   consumes the prepared data and the adapter (eval, merge, gguf) would not rebuild another run's
   (reprotune.project.check_outputs): one line each, nothing changed.
3. **dvc repro** in its own process group; SIGTERM/SIGINT/SIGHUP to this process (make forwards nothing, so
   this process also asks for SIGTERM when make itself dies) are passed on to the whole group: dvc, the
   stage and its workers stop at once. The stage outputs are `persist: true` in dvc.yaml, so DVC no longer
   deletes them before the command runs; each stage builds its outputs aside and swaps them in (io.py). A
   failed, refused or stopped stage therefore leaves the previous outputs and dvc.lock as they were.
4. **One line about it.** The stage hands its error lines to this runner through a file
   (errors.PROBLEMS_FILE_ENV) instead of printing them, and the runner prints the reason and what it kept as
   one line (failure_lines); DVC's own "failed to reproduce" line is left out (its reason kept when the stage never
   ran), and so are its git hints and its warning about an empty rejected.jsonl (REPROTUNE_DEBUG=1 shows them).
   Exit status 2 when the failure has such a reason, 1 for a crash (its traceback above).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from reprotune.errors import (
    EXIT_USER_ERROR,
    KEPT,
    PROBLEMS_FILE_ENV,
    ReprotuneError,
    debug,
    die_with_parent,
    user_errors,
)
from reprotune.run_lock import LOCK, checkout_lock, holder_line  # noqa: F401 - the lock's home; re-exported

# where the stage's user_errors hands over its lines (errors.PROBLEMS_FILE_ENV), written under the run lock
PROBLEMS = Path(".dvc/tmp/reprotune-problems.json")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# after SIGTERM a stage gets this long to stop before its group is killed
GRACE_S = 20.0
# the stage outputs, for the closing line (dvc.yaml's outs, metrics and plots of each stage)
DVC_YAML = Path("dvc.yaml")


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


def failure_lines(stage: str, how: str, handoff: Path = PROBLEMS, reason: str | None = None) -> list[str]:
    """What the user reads when the stage failed: its problems and what was kept, the last problem and the kept
    note joined, so one problem is one line (several: one each, then the count with the kept note). reason: DVC's,
    when the stage never ran (dvc_reason)."""
    try:
        told = json.loads(handoff.read_text(encoding="utf-8"))
        problems = [p.removesuffix(KEPT) for p in told["problems"]]
        total = int(told["total"])
    except (OSError, ValueError, KeyError, TypeError):
        # the stage said nothing through the file: DVC's reason if the stage never ran, else a crash or a signal
        return [f"{reason}; {kept_line(stage, how)}" if reason else kept_line(stage, how)]
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
# DVC's hints after a stage ran, for a user of git and dvc by hand; make's user reads them after every target
# (make push is the kit's way). REPROTUNE_DEBUG=1 shows them again.
DVC_HINTS = (b"To track the changes with git, run:", b"\tgit add ", b"To enable auto staging, run:",
             b"\tdvc config core.autostage true", b"Use `dvc push` to send your updates to remote storage.")
# an output that is empty when all is well (no record rejected): DVC's "'<path>' is empty." warning says nothing
EMPTY_OPTIONAL = re.compile(rb"^WARNING: '[^']*rejected\.jsonl' is empty\.$")


class Relay:
    """Copy a stream of dvc's through, minus the lines `drop` names: DVC's own "failed to reproduce" line (kept as
    `failed`: its reason is the user's when the stage never ran, a missing dependency), its git hints and its
    empty-output warnings. Blank lines before a dropped line go with it; a progress bar without a newline yet is
    shown at once."""

    def __init__(self, stream: IO[bytes], out: IO[bytes]) -> None:
        self.stream, self.out = stream, out
        self.failed: list[str] = []
        self.blank = 0
        self.partial = False  # the start of the current line is already shown (a progress bar)

    def drop(self, line: bytes) -> bool:
        if line.startswith(DVC_FAILED):
            self.failed.append(line.decode("utf-8", "replace"))
            return True
        return not debug() and (line.startswith(DVC_HINTS) or bool(EMPTY_OPTIONAL.match(line.rstrip(b"\r"))))

    def line(self, line: bytes) -> None:
        if self.partial:  # the rest of a line shown in part: its end, newline included, as it comes
            self.partial = False
            self.out.write(line + b"\n")
            return
        if not line.strip():
            self.blank += 1
            return
        if not self.drop(line):
            self.out.write(b"\n" * self.blank + line + b"\n")
        self.blank = 0

    def __call__(self) -> None:
        pending = b""
        read = self.stream.read1 if hasattr(self.stream, "read1") else self.stream.read
        while chunk := read(65536):
            pending += chunk
            lines = pending.split(b"\n")
            pending = lines.pop()
            for line in lines:
                self.line(line)
            if pending and not any(h.startswith(pending[: len(h)]) for h in (DVC_FAILED, *DVC_HINTS, b"WARNING")):
                self.out.write(b"\n" * self.blank + pending)  # a progress bar without a newline yet: show it now
                self.blank, pending, self.partial = 0, b"", True
            self.out.flush()
        if pending:
            self.line(pending)
        if self.partial:
            self.out.write(b"\n")  # the stream ended inside a line: end it, so the next line starts on its own
        self.out.flush()


def dvc_reason(failed: list[str]) -> str | None:
    """DVC's own reason for a stage that never ran (`[Errno 2] No such file or directory: 'x.jsonl'`), or None when
    the stage's command ran and failed (its own lines, or its traceback, said why)."""
    for line in failed:
        reason = re.sub(r"^ERROR: failed to reproduce '[^']*':\s*", "", line).strip()
        if reason and not reason.startswith("failed to run:") and not line.startswith(reason):
            return reason
    return None


def dvc_repro(stage: str) -> tuple[int, int | None, list[str]]:
    """Run `dvc repro [stage]` guarded; (exit status, the signal that stopped it or None, DVC's failure lines)."""
    import threading

    bindir = str(Path(sys.executable).parent)
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""),
           PROBLEMS_FILE_ENV: str(PROBLEMS.resolve())}
    cmd = [str(Path(bindir) / "dvc"), "repro", *([] if stage == "all" else [stage])]
    child = subprocess.Popen(cmd, env=env, preexec_fn=_dvc_in_group, stderr=subprocess.PIPE,  # noqa: PLW1509
                             stdout=subprocess.PIPE)
    forward = Forwarder(child)
    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    relays = [Relay(child.stderr, sys.stderr.buffer), Relay(child.stdout, sys.stdout.buffer)]
    threads = [threading.Thread(target=r, daemon=True) for r in relays]
    for thread in threads:
        thread.start()
    try:
        code = forward.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for thread in threads:
            thread.join(timeout=5)
    return code, forward.signum, relays[0].failed


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
    from reprotune.run import resolve

    return (any(is_objective_override(o) for o in overrides)
            and resolve(compose_checked(overrides), "params").objective.preference)


def refuse_without_chain(stage: str, overrides: list[str]) -> None:
    """An objective with no DVC chain yet (objective=grpo, docs/grpo.md): one line before params.yaml changes,
    instead of the SFT chain's stages running it over the SFT chain's outputs."""
    from reprotune.config import compose_checked, is_objective_override
    from reprotune.run import resolve

    if not any(is_objective_override(o) for o in overrides):
        return
    obj = resolve(compose_checked(overrides), "params").objective
    if obj.rl:
        raise ReprotuneError(f"make {stage}: objective={obj.name} has no DVC chain yet (docs/grpo.md); run its stages "
                             f"directly: .venv/bin/python -m reprotune.prepare objective={obj.name}, then "
                             f"-m reprotune.train objective={obj.name}; nothing was changed")


def composed_params(target: str, overrides: list[str], preference: bool) -> dict[str, tuple[list[str], Any]]:
    """params.yaml's (and, for a preference objective or make repro, params_pref.yaml's) overrides and composed
    config, every settings mistake raised before any file changes (reprotune.config)."""
    from reprotune.config import PARAMS_FILE, PREF_PARAMS_FILE, chain_configs, compose_checked

    if preference or target == "all":
        plain, pref_over, pref = chain_configs(overrides)
        return {PREF_PARAMS_FILE: (pref_over, pref), PARAMS_FILE: (plain, compose_checked(plain))}
    return {PARAMS_FILE: (overrides, compose_checked(overrides))}


def check_outputs(stage: str, target: str, overrides: list[str], configs: dict[str, tuple[list[str], Any]]) -> None:
    """reprotune.project.check_outputs on the values these params files would hold (as dvc.lock reads them)."""
    import yaml
    from omegaconf import OmegaConf

    from reprotune.config import params_values
    from reprotune.project import check_outputs as check

    values = {file: yaml.safe_load(OmegaConf.to_yaml(OmegaConf.create(params_values(cfg))))
              for file, (_, cfg) in configs.items()}
    check(stage, target, overrides, values)


def check_data(stage: str, configs: dict[str, tuple[list[str], Any]]) -> None:
    """The data a stage to run reads must exist: else one line naming the setting, before params.yaml changes
    (DVC would stop on the missing dependency with `[Errno 2] ...` and no setting named)."""
    import yaml

    from reprotune.config import PARAMS_FILE, PREF_PARAMS_FILE
    from reprotune.project import upstream

    stages = yaml.safe_load(DVC_YAML.read_text())["stages"]
    chain = set(stages) if stage == "all" else upstream(stage, stages) | {stage}
    for name, key in (("prepare", "data.path"), ("prepare_pairs", "data.preference.path")):
        file = PARAMS_FILE if name == "prepare" else PREF_PARAMS_FILE
        if name not in chain or file not in configs:
            continue
        from omegaconf import OmegaConf

        path = OmegaConf.select(configs[file][1], key)
        if path and not Path(str(path)).exists():
            raise ReprotuneError(f"{path}: {key}: no such file or directory; point {key} at your file or folder "
                                 f'(make init DATA=<path>, or ARGS="{key}=<path>"); nothing was changed')


def write_params(target: str, overrides: list[str], preference: bool,
                 configs: dict[str, tuple[list[str], Any]] | None = None) -> None:
    """params.yaml (SFT) and, for a preference objective or make repro, params_pref.yaml (reprotune.config)."""
    from reprotune.config import dump_params

    configs = configs if configs is not None else composed_params(target, overrides, preference)
    for file, (over, cfg) in configs.items():
        dump_params(over, Path(file), cfg)
    print(f"wrote {', '.join(sorted(configs))}", flush=True)


def run(stage: str, overrides: list[str]) -> int:
    command = " ".join(["make", stage, *([f"ARGS={' '.join(overrides)}"] if overrides else [])])
    with checkout_lock(command):
        refuse_without_chain(stage, overrides)
        preference = names_preference(overrides)
        target = dvc_stage(stage, preference)  # make train ARGS="objective=dpo" -> train_pref; refused before
        configs = composed_params(stage, overrides, preference)  # params.yaml changes
        check_data(target, configs)
        check_outputs(target, stage, overrides, configs)  # another run's data or adapter: refused, in one line
        write_params(stage, overrides, preference, configs)
        stage = target
        PROBLEMS.unlink(missing_ok=True)  # a file left by an earlier run is not this run's
        try:
            code, signum, failed = dvc_repro(stage)
            if signum is not None:
                print(kept_line(stage, f"stopped by {signal.Signals(signum).name}"), file=sys.stderr)
                return 128 + signum
            if code != 0:
                reason = dvc_reason(failed)
                told = PROBLEMS.is_file() or reason is not None
                print("\n".join(failure_lines(stage, "failed", reason=reason)), file=sys.stderr)
                # a reason the user can act on: the documented status 2; a crash (its traceback above): 1
                return EXIT_USER_ERROR if told else 1
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
