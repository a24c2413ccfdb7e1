"""One resolved run per stage (reprotune.run): every stage's main calls resolve(cfg, "<stage>") first, the objective,
device and dtype are decided there only, `paths` and `repro` are read from the config there only (both read from the
source, ast), and what resolve returns is right for an SFT and a preference config."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from reprotune.config import compose
from reprotune.errors import ReprotuneError
from reprotune.pipeline import STAGES as REGISTRY
from reprotune.pipeline import reachable_reads
from reprotune.run import STAGES, Run, resolve

SRC = Path(__file__).resolve().parents[1] / "src/reprotune"
# the Hydra stages (reprotune.pipeline.STAGES' modules; verify re-runs the others, which resolve their own) and make
# pii-review, with the stage name each resolves
STAGE_OF = {st.module: ("eval" if st.module == "evaluate" else st.module) for st in REGISTRY.values()
            if st.module != "verify"} | {"pii_review": "pii_review"}
# what only the resolver decides: the objective (objective_of), the device and the dtype
DECIDERS = {"objective", "objective_of", "resolve_device", "resolve_dtype", "_device"}
# the dtype rule: applied by the resolver to a stage's device and by the planner to the card it describes
DTYPE_RULE_USERS = {"run.py", "sizing/decide.py"}
# what the Run holds for the code below a stage's main: read from the config by the resolver only
RUN_KEYS = {"paths", "repro"}
# a config by name: the stages' `cfg` (reprotune.pipeline reads params from it by that name), a composed or recorded
# `config`, and an object's config attribute (gguf's Export.cfg: `run.cfg.paths` is a read of the config too)
CONFIG_NAMES = {"cfg", "config", "composed", "conf"}
# the modules that read them from a config, and why
RUN_KEY_READERS = {
    "run.py": "the resolver: every stage's Run takes its paths and its repro mode from the config here",
    "config.py": "composes params.yaml: it copies the composed paths into it unresolved (no stage's params: "
                 "REPROTUNE_CACHE is where things live)",
    "verify.py": "make verify re-runs a stage from the config a manifest recorded (a JSON dict, not this run's "
                 "config): it re-roots that record's paths into a temporary folder",
}


def called_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of every call of a plain name or an attribute (`f(...)`, `mod.f(...)`)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name:
                out.append((node.lineno, name))
    return out


def decisions_outside_the_resolver(files: dict[str, str]) -> list[str]:
    """`file:line name` of each call that decides the objective, device or dtype outside reprotune.run (and of the
    dtype rule outside the resolver and the planner)."""
    found = []
    for rel, text in files.items():
        for line, name in called_names(ast.parse(text)):
            if (name in DECIDERS and rel != "run.py") or (name == "dtype_for" and rel not in DTYPE_RULE_USERS):
                found.append(f"{rel}:{line} {name}")
    return found


def first_statement(body: list[ast.stmt]) -> ast.stmt:
    """The first statement a function runs, inside `with` blocks (main's body runs under errors.user_errors)."""
    stmt = body[0]
    while isinstance(stmt, ast.With):
        stmt = stmt.body[0]
    return stmt


def resolves_first(tree: ast.Module, stage: str) -> bool:
    """main's first statement is resolve(cfg, "<stage>") (assigned or not)."""
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    stmt = first_statement(main.body)
    call = stmt.value if isinstance(stmt, ast.Assign | ast.Expr) else None
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "resolve"
            and len(call.args) == 2 and isinstance(call.args[1], ast.Constant) and call.args[1].value == stage)


def _config_like(node: ast.AST) -> bool:
    """`cfg`, `config`, ... or `<anything>.cfg`."""
    return ((isinstance(node, ast.Name) and node.id in CONFIG_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in CONFIG_NAMES))


def _run_key_read(node: ast.AST) -> str | None:
    """The key when `node` reads paths or repro from a config: cfg.paths, cfg["paths"], cfg.get("paths")."""
    if isinstance(node, ast.Attribute) and node.attr in RUN_KEYS and _config_like(node.value):
        return node.attr
    if (isinstance(node, ast.Subscript) and _config_like(node.value) and isinstance(node.slice, ast.Constant)
            and node.slice.value in RUN_KEYS):
        return str(node.slice.value)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
            and _config_like(node.func.value) and node.args and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in RUN_KEYS):
        return str(node.args[0].value)
    return None


def run_keys_read_outside_the_resolver(files: dict[str, str]) -> list[str]:
    """`file:line key` of each read of paths or repro from a config outside RUN_KEY_READERS."""
    found = []
    for rel, text in files.items():
        if rel in RUN_KEY_READERS:
            continue
        found += sorted(f"{rel}:{node.lineno} {key}" for node in ast.walk(ast.parse(text))
                        if (key := _run_key_read(node)))
    return found


def src_files() -> dict[str, str]:
    return {p.relative_to(SRC).as_posix(): p.read_text() for p in sorted(SRC.rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(STAGE_OF))
def test_every_stage_main_resolves_its_run_first(module: str) -> None:
    assert STAGE_OF[module] in STAGES
    assert resolves_first(ast.parse((SRC / f"{module}.py").read_text()), STAGE_OF[module])


def test_the_objective_device_and_dtype_are_decided_in_the_resolver_only() -> None:
    assert decisions_outside_the_resolver(src_files()) == []


def test_the_checks_catch_a_second_decision_and_a_late_resolve() -> None:
    """Controls: a stage that decides its device itself, or resolves after doing something else, fails."""
    planted = {"evaluate.py": "def f(cfg):\n    device = resolve_device(cfg)\n",
               "gguf.py": "def g(cfg):\n    return run_mod.objective_of(cfg).preference\n",
               "merge.py": "def h(cfg):\n    return dtype_for('auto', 'cpu')\n",
               "sizing/decide.py": "def k(cfg, hw):\n    return dtype_for('auto', hw.device)\n"}
    assert decisions_outside_the_resolver(planted) == ["evaluate.py:2 resolve_device", "gguf.py:2 objective_of",
                                                       "merge.py:2 dtype_for"]
    late = ast.parse("def main(cfg):\n    with user_errors():\n        x = 1\n        run = resolve(cfg, 'gguf')\n")
    wrong = ast.parse("def main(cfg):\n    with user_errors():\n        run = resolve(cfg, 'merge')\n")
    good = ast.parse("def main(cfg):\n    with user_errors():\n        run = resolve(cfg, 'gguf')\n")
    assert (resolves_first(late, "gguf"), resolves_first(wrong, "gguf"), resolves_first(good, "gguf")) == (
        False, False, True)


def test_paths_and_repro_are_read_from_the_config_in_the_resolver_only() -> None:
    """Below each stage's main they come from the Run (run.path("adapter"), run.repro)."""
    files = src_files()
    assert run_keys_read_outside_the_resolver(files) == []
    # each allowed reader still reads them (an entry that no longer does is taken off)
    assert {rel for rel in RUN_KEY_READERS
            if any(_run_key_read(n) for n in ast.walk(ast.parse(files[rel])))} == set(RUN_KEY_READERS)


def test_the_check_catches_a_planted_read_of_paths_or_repro() -> None:
    """Control: the attribute, subscript and get forms, and the config an object carries, are caught; the Run's
    own fields and the resolver's reads are not."""
    planted = {"gguf.py": "def f(run):\n    return run.cfg.paths.gguf\n",
               "serve.py": "def g(cfg):\n    return cfg['paths']['gguf']\n",
               "merge.py": "def h(cfg):\n    return cfg.get('repro')\n",
               "sizing/decide.py": "def k(cfg):\n    return str(cfg.repro)\n",
               "train.py": "def m(resolved):\n    return resolved.paths['adapter'], resolved.path('adapter'), resolved.repro\n",
               "run.py": "def _plain(cfg, stage):\n    return cfg.paths, cfg.repro\n"}
    assert run_keys_read_outside_the_resolver(planted) == ["gguf.py:2 paths", "serve.py:2 paths", "merge.py:2 repro",
                                                           "sizing/decide.py:2 repro"]


def test_resolve_gives_each_chain_its_objective_paths_and_device() -> None:
    sft = resolve(compose(["hardware=cpu"]), "train")
    dpo = resolve(compose(["hardware=cpu", "objective=dpo"]), "train")
    assert (sft.objective.name, sft.objective.preference, dpo.objective.name, dpo.objective.reference) == (
        "sft", False, "dpo", True)
    assert (sft.device, sft.dtype, sft.repro, dpo.device, dpo.dtype) == ("cpu", "float32", "default", "cpu", "float32")
    # each chain's own paths, from conf/ (conf/objective/paths/preference.yaml for dpo)
    assert Path(sft.paths["adapter"]).parts[-2:] == ("outputs", "adapter")
    assert Path(dpo.paths["adapter"]).parts[-3:] == ("outputs", "pref", "adapter")
    assert dpo.paths["prepared"] == dpo.paths["pairs"] != sft.paths["prepared"]
    assert sft.path("adapter") == Path(sft.paths["adapter"]) and dpo.path("prepared") == Path(dpo.paths["pairs"])
    # the repro mode: every Run's but prepare's and gguf's (their outputs do not depend on it: no DVC param of theirs)
    modes = {stage: resolve(compose(["repro=strict"]), stage).repro for stage in ("prepare", "gguf", "merge", "plan")}
    assert modes == {"prepare": None, "gguf": None, "merge": "strict", "plan": "strict"}
    # a stage that runs nothing in torch places nothing; eval adds its batch size (auto: 8 on a CPU)
    assert (resolve(compose([]), "prepare").device, resolve(compose([]), "plan").dtype) == (None, None)
    assert resolve(compose(["hardware=cpu"]), "eval").eval_batch_size == 8
    assert resolve(compose(["hardware=cpu", "eval.batch_size=3", "hardware.dtype=bfloat16"]), "eval") == Run(
        stage="eval", objective=sft.objective, paths=sft.paths, device="cpu", dtype="bfloat16", repro="default",
        cpu_kernels=sft.cpu_kernels, eval_batch_size=3)


def test_the_run_is_frozen_and_bad_values_are_one_line() -> None:
    run = resolve(compose(["hardware=cpu"]), "train")
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.device = "cuda"  # type: ignore[misc]
    with pytest.raises(TypeError):
        run.paths["adapter"] = "elsewhere"  # type: ignore[index]
    with pytest.raises(ReprotuneError, match=r"^eval.batch_size: must be a positive integer or 'auto', not 0$"):
        resolve(compose(["hardware=cpu", "eval.batch_size=0"]), "eval")
    with pytest.raises(ReprotuneError, match=r"^paths.nowhere: not in the config of this train run$"):
        run.path("nowhere")
    # a path set to null is not configured (publish then checks no SFT record), never the string 'None'
    assert "sft_train_dir" not in resolve(compose(["objective=dpo", "paths.sft_train_dir=null"]), "publish").paths
    with pytest.raises(ReprotuneError, match=r"^resolve: unknown stage 'evaluate'"):
        resolve(compose([]), "evaluate")


def test_a_stages_params_are_what_its_own_resolution_reads() -> None:
    """reprotune.pipeline follows resolve(cfg, "<stage>") into that stage's resolver: eval's device, dtype and batch
    size are its params, and prepare, which places nothing, gets no hardware key from the resolver."""
    prepare, evaluate = reachable_reads("prepare"), reachable_reads("evaluate")
    assert not any(k.startswith("hardware") for k in prepare) and "repro" not in prepare | reachable_reads("gguf")
    assert "repro" in reachable_reads("merge")  # its manifest's seeds record the Run's mode
    assert {"hardware.device", "hardware.dtype", "hardware.cpu_kernels", "repro", "eval.batch_size"} <= evaluate
