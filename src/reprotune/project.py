"""A project's own settings, named once, and the check that no target builds over another run's outputs.

    make init DATA=path/to/file.jsonl [NAME=dates] [ARGS="model=qwen3_8b model.path=/models/Qwen3-8B"]
    python -m reprotune.project data.path=path/to/file.jsonl [data.name=dates] [overrides...]   # the same

writes conf/project/current.yaml, which conf/config.yaml composes after everything else (`optional project:
current`): every make target, `python -m reprotune.<stage>` and `dvc exp run` use it; ARGS still override it for
one command. It also writes params.yaml (what DVC tracks), so `dvc repro` and `dvc params diff` see it too.

The guard (`check_outputs`, run by reprotune.runner before params.yaml changes): a target that only consumes the
prepared data and the adapter (eval, merge, gguf, their preference twins) refuses to rebuild them when the settings
they were built with (dvc.lock) differ from this command's. One line names the differing settings and the two ways
on; nothing is changed. make prepare, make train and make repro build those outputs: asked for, not silent.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from reprotune.config import CONF_DIR, name_from_path, sanitise_name
from reprotune.errors import ReprotuneError, user_errors
from reprotune.io import atomic_write_text

PROJECT_FILE = CONF_DIR / "project" / "current.yaml"
HEADER = """\
# @package _global_
# This project's settings, written by 'make init' (edit freely; delete it for the built-in invoice task).
# conf/config.yaml composes it after every other file: every make target, python -m reprotune.<stage> and
# dvc exp run use these values; ARGS="..." on one command still override them.
"""


# ------------------------------------------------------------------------------------------------- make init
def _is_group(key: str) -> bool:
    return "." not in key and (CONF_DIR / key).is_dir()


def project_config(overrides: list[str]) -> dict[str, Any]:
    """The overrides as a config file: a group choice (model=qwen3_8b) as a defaults override, a key as a value."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    config: dict[str, Any] = {}
    groups: list[dict[str, str]] = []
    for item in OverridesParser.create().parse_overrides(overrides):
        key = item.key_or_group
        if item.is_delete():
            raise ReprotuneError(f"{item.input_line}: a deletion cannot be a project setting; pass it in ARGS")
        if _is_group(key):
            groups.append({f"override /{key}": str(item.value())})
            continue
        node = config
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = item.value()
    return {**({"defaults": groups} if groups else {}), **config}


def init(overrides: list[str], out: Path = PROJECT_FILE) -> Path:
    """Check the settings (data.path must exist), then write the project file and params.yaml(s)."""
    from reprotune.config import compose_checked, dump_chain_params, override_key

    keys = {override_key(o): o.partition("=")[2] for o in overrides}
    if not keys.get("data.path"):
        raise ReprotuneError("make init: DATA=<your file or folder> is missing (make init DATA=path/to/file.jsonl)")
    data = keys["data.path"]
    if not Path(data).exists():
        raise ReprotuneError(f"{data}: DATA (data.path): no such file or directory")
    if "data.name" not in keys:
        overrides = [*overrides, f"data.name={name_from_path(data)}"]
    elif keys["data.name"] != sanitise_name(keys["data.name"]):
        raise ReprotuneError(f"data.name: {keys['data.name']!r} is not a usable name; use lower-case letters, digits, "
                             f"'.', '_', '-' (e.g. {sanitise_name(keys['data.name'])})")
    compose_checked(overrides)  # every mistake is one line before anything is written
    text = HEADER + yaml.safe_dump(project_config(overrides), sort_keys=False, allow_unicode=True)
    previous = out.read_text(encoding="utf-8") if out.is_file() else None
    atomic_write_text(out, text)
    try:
        dump_chain_params([])  # params.yaml, params_pref.yaml: conf/ + the project file, what dvc repro runs
    except ReprotuneError:
        if previous is None:
            out.unlink()
        else:
            atomic_write_text(out, previous)
        raise
    return out


# ------------------------------------------------------------------------------------------ the output guard
# the stages whose outputs are a run's expensive, user-specific results, and the targets that may rebuild them
TRAINING = ("prepare", "train", "prepare_pairs", "train_pref")
BUILDS = {"prepare": ("prepare",), "train": ("prepare", "train"), "prepare_pairs": ("prepare_pairs",),
          "train_pref": ("prepare_pairs", "train_pref")}


def _outs(entry: dict) -> list[str]:
    return [next(iter(o)) if isinstance(o, dict) else o for kind in ("outs", "metrics", "plots")
            for o in entry.get(kind, [])]


def _deps(entry: dict) -> list[str]:
    return [d if isinstance(d, str) else next(iter(d)) for d in entry.get("deps", [])]


def upstream(stage: str, stages: dict[str, dict]) -> set[str]:
    """The stages whose outputs `stage` reads, directly or through others (dvc.yaml's deps and outs)."""
    found: set[str] = set()
    todo = [stage]
    while todo:
        deps = _deps(stages[todo.pop()])
        for name, entry in stages.items():
            if name not in found and any(d == o or d.startswith(o.rstrip("/") + "/") for d in deps for o in _outs(entry)):
                found.add(name)
                todo.append(name)
    return found


def protected(stage: str, stages: dict[str, dict]) -> list[str]:
    """The training stages `make <stage's target>` must not rebuild: upstream of it, and not its own to build."""
    if stage == "all" or stage not in stages:
        return []
    before = upstream(stage, stages) | {stage}
    return [s for s in TRAINING if s in before and s not in BUILDS.get(stage, ())]


def _flat(node: Any, prefix: str) -> dict[str, Any]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flat(value, f"{prefix}.{key}").items()}
    return {prefix: node}


def _lookup(config: dict, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, current value) for each setting dvc.lock recorded that differs now."""
    found = []
    for key, value in recorded.items():
        was, now = _flat(value, key), _flat(_lookup(current, key), key)
        found += [(k, was.get(k), now.get(k)) for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    return found


def _show(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_outputs(stage: str, target: str, overrides: list[str], params: dict[str, dict],
                  root: Path = Path(".")) -> None:
    """Refuse, in one line and before anything changes, to rebuild another run's prepared data or adapter as a
    side effect of `make <target>`. params: the settings this command would write, per params file."""
    dvc_yaml, lock_file = root / "dvc.yaml", root / "dvc.lock"
    if not lock_file.is_file():
        return
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    locked = (yaml.safe_load(lock_file.read_text()) or {}).get("stages", {})
    for name in protected(stage, stages):
        entry = locked.get(name)
        outs = [o for o in _outs(stages[name]) if (root / o).exists()]
        if not entry or not outs:
            continue  # never built here: nothing to keep
        diff = [d for file, recorded in (entry.get("params") or {}).items() if file in params
                for d in differences(recorded, params[file])]
        if not diff:
            continue
        shown = diff[:4]
        was = " ".join(f"{k}={_show(v)}" for k, v, _ in shown)
        now = ", ".join(f"{k}={_show(v)}" for k, _, v in shown) + (f" and {len(diff) - 4} more" if len(diff) > 4 else "")
        args = f' ARGS="{shlex.join(overrides)}"' if overrides else ""  # make train: prepare, then train
        raise ReprotuneError(
            f"make {target}: {outs[0]} was built by another run ({was}), not with these settings ({now}); to use "
            f'it, give its settings (make {target} ARGS="{was}", or make init to keep them); to rebuild it with '
            f"these: make train{args}; nothing was changed")


def main(argv: list[str]) -> int:
    from reprotune.run_lock import checkout_lock

    with user_errors(), checkout_lock("make init " + shlex.join(argv)):
        out = init(argv)
        print(f"wrote {out.relative_to(CONF_DIR.parent) if out.is_relative_to(CONF_DIR.parent) else out}, "
              "params.yaml, params_pref.yaml:\n" + out.read_text(encoding="utf-8").split("\n", 4)[-1].rstrip())
        print("every target now uses these settings: make train, make eval, make gguf, make serve (ARGS still win)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
