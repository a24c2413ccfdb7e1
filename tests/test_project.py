"""A project's own settings named once (make init -> conf/project/current.yaml, #50), the guard that no target
rebuilds another run's prepared data or adapter as a side effect, and the runner's one-line reasons (a missing
data.path, DVC's own reason, its git hints and empty-output warnings left out)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from reprotune.config import compose, name_from_path, params_values, sanitise_name
from reprotune.errors import ReprotuneError
from reprotune.project import check_outputs, project_config, protected
from reprotune.runner import Relay, dvc_reason, failure_lines

from .conftest import REPO

DATES = ('{"messages": [{"role": "system", "content": "Convert the date to ISO 8601."}, '
         '{"role": "user", "content": "9 August 2025"}, {"role": "assistant", "content": "2025-08-09"}]}\n')


def test_names_from_a_file_are_sanitised() -> None:
    assert name_from_path("/tmp/My Dates v2.jsonl") == "my-dates-v2"
    assert name_from_path("exports/chats/") == "chats"
    assert sanitise_name("???") == "data"


def test_project_config_turns_group_choices_into_defaults_overrides() -> None:
    config = project_config(["model=qwen3_8b", "data.path=/x/dates.jsonl", "train.max_steps=6",
                             "data.task.type=text"])
    assert config == {"defaults": [{"override /model": "qwen3_8b"}],
                      "data": {"path": "/x/dates.jsonl", "task": {"type": "text"}}, "train": {"max_steps": 6}}


def _conf_copy(tmp_path: Path) -> dict:
    shutil.copytree(REPO / "conf", tmp_path / "conf", ignore=shutil.ignore_patterns("project"))
    return {**os.environ, "REPROTUNE_CONF": str(tmp_path / "conf"), "PYTHONPATH": str(REPO / "src")}


def test_make_init_writes_settings_that_every_composition_uses(tmp_path: Path) -> None:
    """The project file is composed by conf/config.yaml itself (Hydra's defaults list): compose() (what every stage,
    params.yaml and dvc exp run use) sees it; an explicit override still wins; params.yaml is written at once."""
    env = _conf_copy(tmp_path)
    data = tmp_path / "My Dates.jsonl"
    data.write_text(DATES)
    proc = subprocess.run([sys.executable, "-m", "reprotune.project", f"data.path={data}", "model=tiny_random",
                           "train.max_steps=6"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    written = yaml.safe_load((tmp_path / "conf/project/current.yaml").read_text())
    assert written["data"] == {"path": str(data), "name": "my-dates"}
    params = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert params["data"]["name"] == "my-dates" and params["model"]["name"] == "tiny_random"
    assert params["train"]["max_steps"] == 6
    code = ("from reprotune.config import compose; a = compose([]); b = compose(['train.max_steps=2', "
            "'model=smollm2_135m']); print(a.data.name, a.model.name, a.train.max_steps, b.train.max_steps, "
            "b.model.name, b.data.name)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["my-dates", "tiny_random", "6", "2", "smollm2_135m", "my-dates"], out.stderr


@pytest.mark.parametrize(("args", "expected"), [
    ([], "make init: DATA=<your file or folder> is missing"),
    (["data.path=/nope/dates.jsonl"], "/nope/dates.jsonl: DATA (data.path): no such file or directory"),
    (["data.path={data}", "data.name=My Dates"], "data.name: 'My Dates' is not a usable name"),
    (["data.path={data}", "train.lerning_rate=1"], "train.lerning_rate: no such setting; did you mean"),
])
def test_make_init_refuses_in_one_line_and_writes_nothing(tmp_path: Path, args: list[str], expected: str) -> None:
    env = _conf_copy(tmp_path)
    data = tmp_path / "dates.jsonl"
    data.write_text(DATES)
    proc = subprocess.run([sys.executable, "-m", "reprotune.project", *(a.format(data=data) for a in args)],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(expected), proc.stderr
    assert not (tmp_path / "conf/project").exists() and not (tmp_path / "params.yaml").exists()


# ------------------------------------------------------------------------------------------------ the guard
def _values(overrides: list[str]) -> dict:
    return yaml.safe_load(yaml.safe_dump(params_values(compose(overrides))))


def _built(root: Path, overrides: list[str]) -> dict:
    """A checkout whose prepare and train ran with these settings: the real dvc.yaml, a dvc.lock recording each
    stage's params as DVC does (the keys dvc.yaml lists), their outputs present."""
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    stages = yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    values = _values(overrides)
    lock = {"schema": "2.0", "stages": {}}
    for name in ("prepare", "train"):
        recorded = {}
        for key in stages[name]["params"]:
            node = values
            for part in key.split("."):
                node = node[part]
            recorded[key] = node
        lock["stages"][name] = {"params": {"params.yaml": recorded}}
        for out in stages[name]["outs"]:
            path = root / next(iter(out))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("x")
    (root / "dvc.lock").write_text(yaml.safe_dump(lock))
    return values


def test_eval_refuses_to_rebuild_another_runs_data_and_adapter(tmp_path: Path) -> None:
    mine = ["model=tiny_random", "data.path=/tmp/dates.jsonl", "data.name=dates", "train.max_steps=6"]
    _built(tmp_path, mine)
    defaults = {"params.yaml": _values(["model=tiny_random"])}
    with pytest.raises(ReprotuneError) as err:
        check_outputs("eval", "eval", [], defaults, tmp_path)
    [line] = err.value.problems
    assert line.startswith("make eval: data/prepared/train.jsonl was built by another run (data.name=dates "
                           "data.path=/tmp/dates.jsonl"), line
    assert "not with these settings (data.name=invoices, data.path=./data/raw/invoices.jsonl" in line
    assert line.endswith("to rebuild it with these: make train; nothing was changed"), line
    # the same settings: nothing to say; the targets that build them (train, prepare, repro): asked for
    check_outputs("eval", "eval", [], {"params.yaml": _values(mine)}, tmp_path)
    for stage in ("train", "prepare", "all"):
        check_outputs(stage, stage, [], defaults, tmp_path)


def test_only_the_adapter_differs_names_train(tmp_path: Path) -> None:
    _built(tmp_path, ["model=tiny_random", "train.max_steps=6"])
    with pytest.raises(ReprotuneError) as err:
        check_outputs("gguf", "gguf", ["eval.max_new_tokens=8"], {"params.yaml": _values(["model=tiny_random"])},
                      tmp_path)
    assert err.value.problems[0].startswith("make gguf: outputs/adapter was built by another run (train.max_steps=6)")
    assert 'make train ARGS="eval.max_new_tokens=8"; nothing was changed' in err.value.problems[0]


def test_which_targets_may_rebuild_which_outputs() -> None:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert protected("train", stages) == [] and protected("prepare", stages) == []
    assert protected("eval", stages) == ["prepare", "train"] == protected("gguf", stages)
    assert protected("train_pref", stages) == ["prepare", "train"]  # the SFT run's, not its own pairs
    assert protected("eval_pref", stages) == ["prepare", "train", "prepare_pairs", "train_pref"]


# ------------------------------------------------------------------------------------- the runner's lines
def test_dvcs_reason_for_a_stage_that_never_ran_is_kept() -> None:
    missing = "ERROR: failed to reproduce 'prepare': [Errno 2] No such file or directory: '/tmp/nope.jsonl'"
    assert dvc_reason([missing]) == "[Errno 2] No such file or directory: '/tmp/nope.jsonl'"
    assert dvc_reason(["ERROR: failed to reproduce 'train': failed to run: python -m x, exited with 1"]) is None
    [line] = failure_lines("prepare", "failed", Path("/nonexistent"), reason=dvc_reason([missing]))
    assert line.startswith("[Errno 2] No such file or directory: '/tmp/nope.jsonl'; make prepare: failed;")


def test_relay_leaves_out_dvcs_git_hints_and_empty_optional_outputs() -> None:
    text = (b"Running stage 'prepare':\nwrote 3 examples\nWARNING: 'data/prepared/rejected.jsonl' is empty.\n"
            b"WARNING: 'outputs/x.json' is empty.\n\nTo track the changes with git, run:\n\n\tgit add dvc.lock\n\n"
            b"To enable auto staging, run:\n\n\tdvc config core.autostage true\nUse `dvc push` to send your updates "
            b"to remote storage.\nERROR: failed to reproduce 'x': boom\n")
    out = io.BytesIO()
    relay = Relay(io.BytesIO(text), out)
    relay()
    assert out.getvalue().decode().splitlines() == ["Running stage 'prepare':", "wrote 3 examples",
                                                    "WARNING: 'outputs/x.json' is empty."]
    assert relay.failed == ["ERROR: failed to reproduce 'x': boom"]


def test_data_path_without_a_name_names_the_data_after_the_file() -> None:
    from reprotune.config import compose_checked

    cfg = compose_checked(["model=tiny_random", "data.path=/tmp/My Dates.jsonl"])
    assert cfg.data.name == "my-dates" and cfg.export.name == "reprotune-my-dates"  # the served model's id, Ollama's
    assert compose_checked(["data.path=/tmp/x.jsonl", "data.name=mine"]).data.name == "mine"
    assert compose_checked([]).data.name == "invoices" and compose_checked([]).data.private is True


class Chunks(io.RawIOBase):
    """A stream that hands its bytes over in the pieces given (a pipe read while the writer is mid-line)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = list(pieces)

    def read1(self, _n: int = -1) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


def test_relay_shows_a_partial_line_at_once_and_ends_it_with_its_own_newline() -> None:
    """A line written in two pieces (the launcher's `+ -m reprotune.train ...`, a progress bar): the first piece
    shows at once, the newline that ends it is no blank line to hold back, and the next line starts on its own."""
    out = io.BytesIO()
    Relay(Chunks([b"+ -m reprotune.train", b"\n", b"next line\n", b"50%|##"]), out)()
    assert out.getvalue() == b"+ -m reprotune.train\nnext line\n50%|##\n"


def _get_data(root: Path, own_data_ok: str, args: str = "") -> subprocess.CompletedProcess:
    """scripts/get_data.sh in a copy of the checkout's layout under root (no DVC: the built-in path fails at it)."""
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "scripts/get_data.sh", root / "scripts/get_data.sh")
    env = {**os.environ, "PY": sys.executable, "DVC": "/bin/false", "OWN_DATA_OK": own_data_ok, "ARGS": args,
           "PYTHONPATH": str(REPO / "src")}
    return subprocess.run(["bash", "scripts/get_data.sh"], cwd=root, env=env, capture_output=True, text=True)


@pytest.mark.parametrize("how", ["project file", "ARGS"])
def test_a_stage_of_an_own_data_project_does_not_generate_the_builtin_invoices(tmp_path: Path, how: str) -> None:
    if how == "project file":
        (tmp_path / "conf/project").mkdir(parents=True)
        (tmp_path / "conf/project/current.yaml").write_text("data:\n  path: /x/dates.jsonl\n  name: dates\n")
    args = "train.max_steps=3 data.path=/x/dates.jsonl" if how == "ARGS" else "train.max_steps=3"
    done = _get_data(tmp_path, "1", args)
    assert done.returncode == 0 and done.stdout == "", (done.stdout, done.stderr)
    assert not (tmp_path / "data/raw").exists()
    # control: the test lanes (OWN_DATA_OK=0) still regenerate the built-in data (then stop at the missing data.dvc)
    _get_data(tmp_path, "0", args)
    assert (tmp_path / "data/raw/invoices.jsonl").is_file()


def test_a_stage_of_the_builtin_project_generates_the_invoices(tmp_path: Path) -> None:
    _get_data(tmp_path, "1", "train.max_steps=3")
    assert (tmp_path / "data/raw/invoices.jsonl").is_file()


def test_a_stage_pointed_back_at_the_builtin_data_still_gets_it(tmp_path: Path) -> None:
    """make eval ARGS="data.path=data/raw/invoices.jsonl" in an own-data project: the built-in data is what it
    names, so it is got (and the runner then refuses the other run's outputs, tests/test_user_data.py)."""
    (tmp_path / "conf/project").mkdir(parents=True)
    (tmp_path / "conf/project/current.yaml").write_text("data:\n  path: /x/dates.jsonl\n")
    _get_data(tmp_path, "1", "data.path=./data/raw/invoices.jsonl")
    assert (tmp_path / "data/raw/invoices.jsonl").is_file()
