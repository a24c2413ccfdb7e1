"""One resolved run per stage (reprotune.run): every stage's main calls resolve(cfg, "<stage>") first, the objective,
device and dtype are decided there only (read from the source, ast), and what resolve returns is right for an SFT
and a preference config."""

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
    with pytest.raises(ReprotuneError, match=r"^resolve: unknown stage 'evaluate'"):
        resolve(compose([]), "evaluate")


def test_a_stages_params_are_what_its_own_resolution_reads() -> None:
    """reprotune.pipeline follows resolve(cfg, "<stage>") into that stage's resolver: eval's device, dtype and batch
    size are its params, and prepare, which places nothing, gets no hardware key from the resolver."""
    prepare, evaluate = reachable_reads("prepare"), reachable_reads("evaluate")
    assert not any(k.startswith("hardware") for k in prepare)
    assert {"hardware.device", "hardware.dtype", "hardware.cpu_kernels", "repro", "eval.batch_size"} <= evaluate
