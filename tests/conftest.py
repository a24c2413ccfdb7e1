"""Shared fixtures: a temporary workspace (paths.root) with a small prepared invoice dataset, and one short
training run of the built-in SmolLM2 that the slow tests on the real model share.

The suite runs on every core (make test / make test-all: pytest-xdist, --dist loadgroup). Two rules keep that safe:
a module's tests stay on one worker (pytest_xdist_make_scheduler below), so module-scoped fixtures (an sshd, a
Docker image, a DVC repository) are built once and never raced; and a run shared across modules (built_once) is
built by the first worker that needs it, under a file lock, in the session's common temporary folder, and read by
the others. The longest modules are handed out first (LONGEST_FIRST)."""

from __future__ import annotations

import fcntl
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Two workers of two OpenMP threads share the two cores: with libgomp's default (active) waiting, a thread that
# finishes its share spins on its core while the other process's threads wait for it. Measured with a training run
# beside it: two greedy SmolLM2 generations of 40 tokens took 31-53 s spinning and 6-8 s passive. The wait policy
# changes how idle threads wait, not how work is split, so the bytes do not move (tests/test_repro_golden.py). It
# must be set before libgomp loads (the first torch import, here or in a stage's subprocess).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# before anything imports torch: importing reprotune pins the CPU kernels (reprotune/kernels.py) for the tests
# run in this process; the stages the tests start as subprocesses pin themselves
import reprotune  # noqa: F401

if os.environ.get("REPROTUNE_CPU_KERNELS") not in ("pinned", "native"):
    raise RuntimeError("torch was imported before tests/conftest.py: the CPU kernels could not be pinned")

REPO = Path(__file__).resolve().parents[1]
os.chdir(REPO)  # stages resolve the model cache and chat templates relative to the repository
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def small_invoices(root: Path) -> None:
    """32 train and 8 holdout invoices in root/data/prepared (and all 40 in root/data/raw)."""
    from reprotune.invoices import generate

    rows = generate(40, seed=7)
    write_jsonl(root / "data/prepared/train.jsonl", rows[:32])
    write_jsonl(root / "data/prepared/holdout.jsonl", rows[32:])
    write_jsonl(root / "data/raw/invoices.jsonl", rows)


# The modules that take longest on 2 cores, longest first (ranked from the --durations=0 of a fresh-clone CI run on
# the 2-core CI machine, 2026-12-05: seconds of one worker in the comments); the others follow in collection order.
# With --dist loadgroup each module is one unit of work (ModuleScheduling below), handed to whichever worker is
# free: started first, a long module runs beside the many short ones instead of being handed to one worker at the
# end while the other idles (test_repro_any_cpu, 337 s, missing here, ran last: one worker finished 347 s after the
# other). test_eval carries the shared SmolLM2 run's build (~175 s), whichever of its three users asks first.
LONGEST_FIRST = ("test_make_pipeline",  # 481
                 "test_docker",  # 414
                 "test_eval",  # 353
                 "test_failures",  # 273
                 "test_repro_any_cpu",  # 337 at four rows a batch (two since: 303 beside test_make_pipeline)
                 "test_preference_packed",  # 168
                 "test_dvc",  # 162
                 "test_user_data",  # 127 (issue #50, measured on the loaded box, one process)
                 "test_repro_golden", "test_distributed",  # 135, 134
                 "test_families_export",  # 116
                 "test_preference",  # 95
                 "test_export_smollm2", "test_packing", "test_hub_local", "test_repro",  # 81, 80, ~80 (#50), 74
                 "test_export_pref", "test_resume", "test_run_settings",  # 60, 58, 50
                 "test_train", "test_export_gguf", "test_plan",  # 49, 49, 41
                 "test_long_context", "test_families", "test_draws", "test_e2e_smollm2")  # 28, 28, 26, 12 (+ its wait)


def module_of(nodeid: str) -> str:
    """tests/test_x.py::test_y[p] (and any '@group' suffix after it) -> test_x."""
    return Path(nodeid.split("::", 1)[0]).stem


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first (LONGEST_FIRST); a stable sort, so each module's tests keep their order."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(module_of(item.nodeid), len(rank)))


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: absent under -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """--dist loadgroup, one module per unit of work, in collection order (longest first, above).

    xdist's own loadgroup reads the group from an "@group" suffix its workers append to each nodeid, and with
    pytest 9.2 that assignment no longer changes the nodeid (pytest-dev/pytest-xdist#1386): every test was
    scheduled alone, so a module's fixtures (a Docker image, torchrun runs, a DVC repository, a trained clone) were
    built again on each worker that got one of its tests, at the same time. This scheduler groups by the module
    from the nodeid itself."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def __init__(self, config: pytest.Config, log: object = None) -> None:
            super().__init__(config, log)
            # keep the collection order; xdist's default puts the modules with the most tests first
            self.config.option.loadscopereorder = False

        def _split_scope(self, nodeid: str) -> str:
            return nodeid.split("::", 1)[0]

    return ModuleScheduling(config, log)


# CPU seconds per test phase (this process and the children it waited for: the stages, torchrun, QEMU, llama.cpp),
# beside pytest's wall seconds: on two cores a test's wall time depends on what the other worker runs, its CPU time
# much less (docs/testing-time.md). Printed at the end of the run, summed per module.
CPU_KEY = "cpu_seconds"
_PHASE_CPU = pytest.StashKey[float]()


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _timed_phase(item: pytest.Item) -> Iterator[None]:
    start = cpu_seconds()
    try:
        return (yield)
    finally:
        item.stash[_PHASE_CPU] = cpu_seconds() - start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _timed_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _timed_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    return (yield from _timed_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    if _PHASE_CPU in item.stash:
        report.user_properties.append((CPU_KEY, item.stash[_PHASE_CPU]))
        del item.stash[_PHASE_CPU]
    return report


# Each xdist worker's busy seconds (its tests' durations) and when its last report reached the controller: the
# idle tail of a worker that finished early is what a better order of LONGEST_FIRST can win back.
_WORKERS: dict[str, dict[str, float | str]] = {}
_SESSION_START = time.time()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)  # set by xdist
    if worker:
        seen = _WORKERS.setdefault(worker, {"busy": 0.0, "last": 0.0, "module": ""})
        seen["busy"] = float(seen["busy"]) + report.duration
        seen["last"], seen["module"] = time.time() - _SESSION_START, module_of(report.nodeid)


def pytest_terminal_summary(terminalreporter: object, config: pytest.Config) -> None:
    """Each worker's busy and finishing time, and the modules that used most CPU (the reports reach the controller
    with their user_properties)."""
    if _WORKERS:
        terminalreporter.write_sep("=", "xdist workers: busy seconds, last report at (s after start), last module")  # type: ignore[attr-defined]
        for worker, seen in sorted(_WORKERS.items()):
            terminalreporter.write_line(f"{worker}: busy {seen['busy']:7.1f}  last at {seen['last']:7.1f}  {seen['module']}")  # type: ignore[attr-defined]
    cpu: dict[str, float] = {}
    per_test: dict[str, float] = {}
    for reports in terminalreporter.stats.values():  # type: ignore[attr-defined]
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == CPU_KEY:
                    module = module_of(report.nodeid)
                    cpu[module] = cpu.get(module, 0.0) + value
                    per_test[report.nodeid] = per_test.get(report.nodeid, 0.0) + value
    if cpu:
        top = sorted(cpu.items(), key=lambda kv: -kv[1])[:25]
        terminalreporter.write_sep("=", f"CPU seconds per module (top {len(top)}; all: {sum(cpu.values()):.0f})")  # type: ignore[attr-defined]
        for module, seconds in top:
            terminalreporter.write_line(f"{seconds:8.1f}  {module}")  # type: ignore[attr-defined]
        # per test (setup + call + teardown): what to move to the full lane when the fast one grows (docs/testing-time.md)
        tests = sorted(per_test.items(), key=lambda kv: -kv[1])[:30]
        terminalreporter.write_sep("=", f"CPU seconds per test (top {len(tests)})")  # type: ignore[attr-defined]
        for nodeid, seconds in tests:
            terminalreporter.write_line(f"{seconds:8.1f}  {nodeid}")  # type: ignore[attr-defined]


def session_dir(factory: pytest.TempPathFactory) -> Path:
    """The temporary folder every xdist worker of this pytest session shares (each worker's basetemp is a child)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file closes, also if the worker dies
        yield


def built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """session_dir/name, built by build(root) once per session whichever worker asks first; the others wait for
    it. A build that failed leaves no marker, so the next worker to ask builds it again (and fails the same way)."""
    root = session_dir(factory) / name
    with file_lock(root.with_name(f"{name}.lock")):
        if not (root / ".built").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir(parents=True)
            build(root)
            (root / ".built").touch()
    return root


@pytest.fixture
def workspace(tmp_path: Path) -> tuple[Path, list[str]]:
    """tmp_path as paths.root, holding 32 train and 8 holdout invoices; returns (root, overrides)."""
    small_invoices(tmp_path)
    return tmp_path, [f"paths.root={tmp_path}"]


# 12 steps of 2 rows: enough for the loss to fall clearly and for greedy replies to look like the JSON answers
SMOLLM2_TRAIN = ["train.max_steps=12", "train.logging_steps=1", "train.per_device_train_batch_size=2",
                 "train.save_steps=6"]


@pytest.fixture(scope="session")
def smollm2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """One short run of the built-in SmolLM2 as 'make train' runs it (the CLI, in its own process) on the workspace
    invoices, trained once per session (whichever xdist worker asks first) for the slow tests on the real model (test_e2e_smollm2, test_eval,
    test_export_smollm2). Read-only: a test that writes under paths.root works on copy_run(...)."""
    def build(root: Path) -> None:
        small_invoices(root)
        cmd = [sys.executable, "-m", "reprotune.train", f"paths.root={root}", *SMOLLM2_TRAIN]
        subprocess.run(cmd, check=True, timeout=1800)

    root = built_once(tmp_path_factory, "smollm2-run", build)
    return root, [f"paths.root={root}"]


def copy_run(run: tuple[Path, list[str]], dest: Path) -> tuple[Path, list[str]]:
    """A private copy of a shared run (data and outputs), with paths.root pointing at it."""
    root, _ = run
    shutil.copytree(root, dest)
    return dest, [f"paths.root={dest}"]


TINY_TRAIN = ["model=tiny_random", "train.max_steps=3", "train.save_steps=2", "train.logging_steps=1",
              "train.per_device_train_batch_size=2"]
# a higher learning rate than the train tests use, so 3 steps visibly change the tiny model's replies (eval) and
# move its logits (merge parity has teeth)
TINY_ADAPTER_TRAIN = [*TINY_TRAIN, "train.learning_rate=1e-2"]


def tiny_adapter_run(factory: pytest.TempPathFactory) -> Path:
    """session_dir/tiny-adapter: small_invoices and a TINY_ADAPTER_TRAIN adapter in outputs/ (adapter, train),
    trained once per session for the eval and the export tests (whichever xdist worker asks first). Its data/ and
    outputs/ are read-only; a test may add a folder of its own under it (an eval_dir), or copy what it changes."""
    def build(root: Path) -> None:
        from reprotune.config import compose
        from reprotune.train import train

        small_invoices(root)
        train(compose([*TINY_ADAPTER_TRAIN, f"paths.root={root}"]))

    return built_once(factory, "tiny-adapter", build)
