"""The code's shape, read from the source (ast): stages stand alone, shared modules own their concern."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from reprotune.pipeline import STAGES as REGISTRY

SRC = Path(__file__).resolve().parents[1] / "src/reprotune"
STAGES = {st.module for st in REGISTRY.values()}  # the one stage registry (reprotune.pipeline.STAGES)
# the only module that may call transformers' Auto* loaders (every base model and tokenizer load)
LOADERS = {"AutoTokenizer", "AutoModelForCausalLM"}


def modules() -> dict[str, ast.Module]:
    """Every module of the package; a subpackage (pii/, sizing/) as one node, its files' code together."""
    found = {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in sorted(SRC.glob("*.py"))}
    for pkg in sorted(p.parent for p in SRC.glob("*/__init__.py")):
        trees = [ast.parse(f.read_text(), filename=str(f)) for f in sorted(pkg.glob("*.py"))]
        found[pkg.name] = ast.Module(body=[node for tree in trees for node in tree.body], type_ignores=[])
    return found


def reprotune_imports(tree: ast.Module) -> set[str]:
    """Every reprotune module a module imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "reprotune":
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("reprotune."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("reprotune.")}
    return found


def subprocess_modules(tree: ast.Module) -> set[str]:
    """reprotune modules a module runs as `python -m reprotune.<name>` (a string constant naming one)."""
    return {node.value.split(".")[1] for node in ast.walk(tree) if isinstance(node, ast.Constant)
            and isinstance(node.value, str) and node.value.startswith("reprotune.") and node.value.count(".") == 1}


def code_of(module: str) -> set[str]:
    """The modules whose source decides what `python -m reprotune.<module>` does: what it imports or runs,
    transitively."""
    trees = modules()
    seen, todo = {module}, [module]
    while todo:
        tree = trees[todo.pop()]
        for dep in (reprotune_imports(tree) | subprocess_modules(tree)) & set(trees) - seen - {"__init__"}:
            seen.add(dep)
            todo.append(dep)
    return seen


def import_graph() -> dict[str, set[str]]:
    graph = {name: reprotune_imports(tree) for name, tree in modules().items()}
    return {name: deps & set(graph) for name, deps in graph.items()}


def test_every_stage_is_a_module() -> None:
    assert set(modules()) >= STAGES >= {"prepare", "train", "evaluate", "merge", "gguf", "plan", "serve", "publish",
                                        "verify"}


def test_no_stage_imports_a_stage() -> None:
    arrows = sorted(f"{a} -> {b}" for a, deps in import_graph().items() if a in STAGES
                    for b in deps if b in STAGES)
    assert arrows == []


def test_shared_modules_import_no_stage() -> None:
    arrows = sorted(f"{a} -> {b}" for a, deps in import_graph().items() if a not in STAGES
                    for b in deps if b in STAGES)
    assert arrows == []


def test_the_graph_reader_sees_imports_inside_functions() -> None:
    tree = ast.parse("def f():\n    from reprotune.train import x\n    from reprotune import merge as m\n")
    assert reprotune_imports(tree) == {"train", "merge"}


def test_models_are_loaded_in_models_py_only() -> None:
    users = sorted(name for name, tree in modules().items() if name != "models"
                   for node in ast.walk(tree)
                   if isinstance(node, ast.Name | ast.alias) and (getattr(node, "id", None) or getattr(node, "name", None)) in LOADERS)
    assert users == []


@pytest.mark.parametrize("name", sorted(STAGES - {"verify"}))
def test_stage_entry_point_turns_user_errors_into_exit_2(name: str) -> None:
    """Each Hydra stage's main() runs its body under errors.user_errors() (one line, exit status 2)."""
    main = next(n for n in modules()[name].body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert "user_errors" in ast.unparse(main)
