"""dvc.yaml, derived from the code: each stage's code deps are the project modules its command imports
(transitively, lazy imports inside functions included) and its params are the config keys that code reads.

    python -m reprotune.pipeline            # == make dvc-yaml: rewrite dvc.yaml
    python -m reprotune.pipeline --check    # exit 1 when dvc.yaml is stale (tests/test_pipeline.py runs it)

Hand-kept here (STAGES, the one stage registry: dvc.yaml, `make help` and tests/test_structure.py read it):
each stage's module, its make target, its data deps and outs, and the non-Python files it reads; the stages run by
make alone (plan, serve, publish, verify) are in it too, marked dvc=False.
Derived: everything else. Params follow the calls from the stage's main() through the project's functions
(a module imported for one helper does not add the params of the rest of it). A config read is an attribute chain on a variable named `cfg` (`cfg.train.max_steps`,
`cfg.export.get("threads")`); a chain that stops early (`t = cfg.train`, `f(cfg.model)`) counts as reading that
whole subtree; `resolve(cfg, "<stage>")` (reprotune.run) reads what that stage's resolver reads. `paths.*` is
never a param: it says where files are, and dvc.yaml's deps and outs name them.
Two reads are deliberately not params: the whole config copied into a stage's manifest (a record of the run,
not an input of its outputs), and train's resume fingerprint (it only decides whether a checkpoint is reused,
and a resumed run gives the same bytes as an uninterrupted one).
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PACKAGE = "reprotune"
SRC = Path(__file__).resolve().parent
REPO = SRC.parents[1]
DVC_YAML = REPO / "dvc.yaml"
HYDRA_ARGS = "--config-dir . --config-name {name} hydra.run.dir=. hydra.output_subdir=null hydra/job_logging=stdout"
NOT_PARAMS = ("paths",)
# The SFT stages run with params.yaml, the preference stages with params_pref.yaml (the same settings plus a
# preference objective; reprotune.config.dump_chain_params). An SFT stage refuses a preference objective at start
# (reprotune.config.check_chain), so `objective` is no param of it: its only value there is sft.
SFT_ONLY_NOT_PARAMS = ("objective",)


# metrics files hold numbers only (what 'dvc metrics show/diff' print); reports and provenance are outs
@dataclass
class Stage:
    module: str                         # python -m reprotune.<module> does the stage's work
    desc: str
    deps: list[str] = field(default_factory=list)  # data and non-Python files it reads (code deps are derived)
    outs: list[str] = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    command: str | None = None          # the module DVC runs when not `module` (train: the torchrun launcher)
    dvc: bool = True                    # a stage of dvc.yaml; False: run by its make target only
    preference: bool = False            # a stage of the preference chain: params_pref.yaml, objective=dpo|orpo|kto
    target: str | None = None           # the make target that runs it, when not its name (train_pref: make train)

    @property
    def params_file(self) -> str:
        from reprotune.config import PARAMS_FILE, PREF_PARAMS_FILE

        return PREF_PARAMS_FILE if self.preference else PARAMS_FILE




LOCKS = ["lockfiles/cpu.txt", "lockfiles/cuda.txt"]
LLAMA_CPP = ["lockfiles/llama-cpp.txt", "lockfiles/llama-cpp-build.txt", "scripts/build_llama_cpp.sh",
             "scripts/llama_cpp_project.cmake"]
# manifests carry timings, so they differ run to run: cached (not in git) so 'make verify RUN=<rev>' finds them
STAGES: dict[str, Stage] = {
    "prepare": Stage("prepare", "Validate, convert, scrub PII, split: data.path -> data/prepared",
                     ["${data.path}", *LOCKS],
                     ["data/prepared/train.jsonl", "data/prepared/holdout.jsonl",
                      "data/prepared/rejected.jsonl",  # data.on_invalid=skip: file, line, reason per skipped record
                      "data/prepared/manifest.json",
                      # the reports (names, policies, package versions): outputs, not metrics
                      "data/prepared/report.json", "data/prepared/pii_report.json"],
                     ["data/prepared/metrics.json"],
                     ["data/prepared/lengths.png"]),
    # the launcher (torchrun for NPROC>1) runs reprotune.train in each process: NPROC etc. come from the environment
    "train": Stage("train", "Fine-tune (LoRA/QLoRA/DoRA) -> outputs/adapter",
                   ["data/prepared/train.jsonl", "conf/chat_templates", *LOCKS],
                   ["outputs/adapter", "outputs/train/manifest.json", "outputs/train/loss_curves.json",
                    "outputs/train/plan.json"],  # the preflight's decision (on a GPU with its memory plan)
                   ["outputs/train/metrics.json"], ["outputs/train/loss.png"], command="distributed"),
    "eval": Stage("evaluate", "Base vs fine-tuned on the holdout -> outputs/eval",
                  # train.jsonl: eval.max_new_tokens auto is the longest training answer's length
                  ["data/prepared/holdout.jsonl", "data/prepared/train.jsonl", "outputs/adapter", *LOCKS],
                  ["outputs/eval/predictions.jsonl", "outputs/eval/report.md", "outputs/eval/manifest.json"],
                  ["outputs/eval/metrics.json"], ["outputs/eval/comparison.png"]),
    "merge": Stage("merge", "Merge the adapter into the full-precision base -> outputs/merged",
                   ["outputs/adapter", "data/prepared/holdout.jsonl", *LOCKS],
                   ["outputs/merged", "outputs/export/merge_manifest.json"]),
    "gguf": Stage("gguf", "Convert to GGUF, quantize, check parity with the HF model -> outputs/gguf",
                  ["outputs/merged", "data/prepared/holdout.jsonl", "data/prepared/train.jsonl", *LOCKS, *LLAMA_CPP],
                  ["outputs/gguf", "outputs/export/gguf_manifest.json"],
                  # each quant tried: size, tokens/s, parity, task metric, pass/fail (and the plot of them)
                  ["outputs/export/gguf_metrics.json"], ["outputs/export/quant_ladder.png"]),
    # the preference chain (objective=dpo|orpo|kto, params_pref.yaml): its own pairs and outputs, after SFT's
    "prepare_pairs": Stage("prepare", "Preference pairs: data.preference.path -> data/pairs (make prepare ARGS=objective=dpo)",
                           ["${data.preference.path}", *LOCKS],
                           ["data/pairs/train.jsonl", "data/pairs/holdout.jsonl", "data/pairs/rejected.jsonl",
                            "data/pairs/manifest.json", "data/pairs/report.json", "data/pairs/pii_report.json",
                            "data/pairs/train_lengths.json"],
                           ["data/pairs/metrics.json"], ["data/pairs/lengths.png"], preference=True, target="prepare"),
    # objective.init_adapter defaults to the SFT adapter: trained further, its frozen copy the reference
    "train_pref": Stage("train", "DPO/ORPO/KTO from the SFT adapter -> outputs/pref/adapter (make train ARGS=objective=dpo)",
                        ["data/pairs/train.jsonl", "outputs/adapter", "conf/chat_templates", *LOCKS],
                        ["outputs/pref/adapter", "outputs/pref/train/manifest.json", "outputs/pref/train/loss_curves.json",
                         "outputs/pref/train/plan.json"],
                        ["outputs/pref/train/metrics.json"], ["outputs/pref/train/loss.png"], command="distributed",
                        preference=True, target="train"),
    "eval_pref": Stage("evaluate", "Base vs SFT vs preference adapter on the holdout pairs -> outputs/pref/eval "
                       "(make eval ARGS=objective=dpo)",
                       ["data/pairs/holdout.jsonl", "data/pairs/train.jsonl", "outputs/pref/adapter", "outputs/adapter",
                        *LOCKS],
                       ["outputs/pref/eval/predictions.jsonl", "outputs/pref/eval/report.md",
                        "outputs/pref/eval/manifest.json"],
                       ["outputs/pref/eval/metrics.json"], ["outputs/pref/eval/comparison.png"], preference=True,
                       target="eval"),
    # the preference adapter's export: one whole adapter (the SFT weights trained further), merged into the base
    "merge_pref": Stage("merge", "Merge the preference adapter into the base -> outputs/pref/merged "
                        "(make merge ARGS=objective=dpo)",
                        ["outputs/pref/adapter", "data/pairs/holdout.jsonl", *LOCKS],
                        ["outputs/pref/merged", "outputs/pref/export/merge_manifest.json"], preference=True,
                        target="merge"),
    "gguf_pref": Stage("gguf", "GGUF of the preference model, parity checked -> outputs/pref/gguf "
                       "(make gguf ARGS=objective=dpo)",
                       ["outputs/pref/merged", "data/pairs/holdout.jsonl", "data/pairs/train.jsonl", *LOCKS,
                        *LLAMA_CPP],
                       ["outputs/pref/gguf", "outputs/pref/export/gguf_manifest.json"],
                       ["outputs/pref/export/gguf_metrics.json"], ["outputs/pref/export/quant_ladder.png"],
                       preference=True, target="gguf"),
    # run by make alone: a what-if before renting a GPU, a server, an upload, a re-run that compares bytes
    "plan": Stage("plan", "Memory, time and cost of a train run before renting a GPU -> outputs/plan.json",
                  outs=["outputs/plan.json"], dvc=False),
    "serve": Stage("serve", "OpenAI-compatible server on the GGUF (llama.cpp)", dvc=False),
    "publish": Stage("publish", "Opt-in: push adapter/merged to the HF Hub (dry run by default)", dvc=False),
    "verify": Stage("verify", "Re-run a recorded run in a temp dir and compare bytes", dvc=False),
}
DVC_STAGES = {name: st for name, st in STAGES.items() if st.dvc}


# ------------------------------------------------------------------------------------------ import graph
def module_file(module: str) -> Path:
    rel = module.removeprefix(PACKAGE).lstrip(".").replace(".", "/")
    path = SRC / rel
    return path / "__init__.py" if path.is_dir() or not rel else path.with_suffix(".py")


def launched(node: ast.AST) -> set[str]:
    """Project modules run as `python -m reprotune.x` from here (a string that names a module exactly)."""
    return {sub.value for sub in ast.walk(node) if isinstance(sub, ast.Constant) and isinstance(sub.value, str)
            and sub.value.startswith(PACKAGE + ".") and sub.value.replace(".", "").replace("_", "").isalnum()
            and module_file(sub.value).is_file()}


def direct_imports(module: str) -> set[str]:
    """Project modules a module imports anywhere in its body (top level and inside functions), or launches."""
    tree = ast.parse(module_file(module).read_text())
    found: set[str] = launched(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == PACKAGE}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            found.add(node.module)
            # `from reprotune import manifest` imports a submodule, `from reprotune.x import f` does not
            found |= {f"{node.module}.{a.name}" for a in node.names
                      if module_file(f"{node.module}.{a.name}").is_file()}
    return {m for m in found if module_file(m).is_file()}


def import_closure(module: str) -> list[str]:
    """The module, every project module it imports transitively, and their packages' __init__."""
    seen: set[str] = set()
    todo = [f"{PACKAGE}.{module}"]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        parts = current.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # packages run their __init__
        todo += sorted(direct_imports(current))
    return sorted(seen)


def code_deps(module: str) -> list[str]:
    return sorted(module_file(m).relative_to(REPO).as_posix() for m in import_closure(module))


# ----------------------------------------------------------------------------------------- config reads
def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _chain(name: ast.Name, parents: dict[ast.AST, ast.AST]) -> list[str]:
    """Keys read through one use of `cfg`: cfg.a.b, cfg.a.get("b"), cfg.a["b"] -> [a, b]."""
    keys: list[str] = []
    node: ast.AST = name
    while True:
        parent = parents.get(node)
        if isinstance(parent, ast.Attribute) and parent.value is node:
            call = parents.get(parent)
            if parent.attr == "get" and isinstance(call, ast.Call) and call.func is parent:
                if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
                    keys.append(call.args[0].value)
                    node = call
                    continue
                return keys
            if isinstance(call, ast.Call) and call.func is parent:
                return keys  # a method of the config object (items(), keys()): the object is read whole
            keys.append(parent.attr)
            node = parent
        elif (isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.slice, ast.Constant)
              and isinstance(parent.slice.value, str)):
            keys.append(parent.slice.value)
            node = parent
        else:
            return keys


def cfg_reads(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> set[str]:
    """Dotted config keys read from a variable named cfg inside one function (see the module docstring)."""
    reads = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "cfg" and isinstance(sub.ctx, ast.Load):
            keys = _chain(sub, parents)
            if keys:  # bare cfg: passed on (its reads are found where it is used) or recorded in a manifest
                reads.add(".".join(keys))
    return reads


@dataclass
class ModuleIndex:
    functions: dict[str, ast.AST]
    parents: dict[ast.AST, ast.AST]
    modules: dict[str, str]                 # local alias -> project module
    names: dict[str, tuple[str, str]]       # local alias -> (project module, function)


def index_module(module: str) -> ModuleIndex:
    tree = ast.parse(module_file(module).read_text())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    modules: dict[str, str] = {}
    names: dict[str, tuple[str, str]] = {}
    for node in ast.walk(tree):  # lazy imports inside functions count too
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            for a in node.names:
                if module_file(f"{node.module}.{a.name}").is_file():
                    modules[a.asname or a.name] = f"{node.module}.{a.name}"
                else:
                    names[a.asname or a.name] = (node.module, a.name)
        elif isinstance(node, ast.Import):
            modules |= {a.asname: a.name for a in node.names if a.asname and a.name.split(".")[0] == PACKAGE}
    return ModuleIndex(functions, _parents(tree), modules, names)


RUN_MODULE = f"{PACKAGE}.run"


def stage_resolvers(func: ast.AST, index: ModuleIndex) -> list[str]:
    """The resolvers a function's `resolve(cfg, "<stage>")` calls run (reprotune.run.resolver_of): a stage's params
    are what its own resolution reads (train's device and dtype are no params of prepare); a stage that is not a
    literal: every resolver."""
    from reprotune import run

    found = []
    for call in ast.walk(func):
        if not isinstance(call, ast.Call):
            continue
        callee = call.func
        named = (isinstance(callee, ast.Name) and index.names.get(callee.id) == (RUN_MODULE, "resolve")) or (
            isinstance(callee, ast.Attribute) and callee.attr == "resolve" and isinstance(callee.value, ast.Name)
            and index.modules.get(callee.value.id) == RUN_MODULE)
        if not named:
            continue
        stage = call.args[1] if len(call.args) > 1 else None
        if isinstance(stage, ast.Constant) and isinstance(stage.value, str):
            found.append(run.resolver_of(stage.value))
        else:
            found += sorted({run.resolver_of(s) for s in run.STAGES})
    return found


def reachable_reads(module: str, entry: str = "main") -> set[str]:
    """Config keys read by every project function reachable from module.entry (calls and references)."""
    indexes: dict[str, ModuleIndex] = {}
    seen: set[tuple[str, str]] = set()
    todo = [(f"{PACKAGE}.{module}", entry)]
    reads: set[str] = set()
    while todo:
        mod, name = todo.pop()
        if (mod, name) in seen:
            continue
        seen.add((mod, name))
        index = indexes.setdefault(mod, index_module(mod))
        func = index.functions.get(name)
        if func is None:
            continue  # a class or constant: no config reads of its own
        reads |= cfg_reads(func, index.parents)
        todo += [(launched_module, "main") for launched_module in launched(func)]
        todo += [(RUN_MODULE, resolver) for resolver in stage_resolvers(func, index)]
        for sub in ast.walk(func):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
                if sub.id in index.functions:
                    todo.append((mod, sub.id))
                elif sub.id in index.names:
                    todo.append(index.names[sub.id])
            elif (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                  and sub.value.id in index.modules):
                todo.append((index.modules[sub.value.id], sub.attr))
    return reads


def _existing_prefix(key: str, config: dict) -> str | None:
    """The longest prefix of key present in the composed config (an optional key -> its group)."""
    parts, node, kept = key.split("."), config, []
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            break
        kept.append(part)
        node = node[part]
    return ".".join(kept) or None


def minimal_keys(keys: set[str]) -> list[str]:
    """Drop keys covered by a read of their parent (reading `train` covers `train.max_steps`)."""
    return sorted(k for k in keys if not any(k.startswith(other + ".") for other in keys if other != k))


def stage_params(module: str, config: dict, preference: bool = False) -> list[str]:
    reads = reachable_reads(module)
    skip = NOT_PARAMS if preference else (*NOT_PARAMS, *SFT_ONLY_NOT_PARAMS)
    kept = {p for k in reads if (p := _existing_prefix(k, config)) and p.split(".")[0] not in skip}
    return minimal_keys(kept)


# ---------------------------------------------------------------------------------------------- dvc.yaml
HEADER = """\
# GENERATED by 'make dvc-yaml' (python -m reprotune.pipeline) from src/reprotune/pipeline.py: do not edit.
# Code deps are the project modules each stage's command imports (transitively); params are the config keys
# its code reads (params.yaml, composed from conf/ + ARGS by every 'make <stage>'). tests/test_pipeline.py
# fails when this file is stale. Run a stage and what it needs: make train | eval | merge | gguf.
# Every output is persist: true (the stage swaps it in atomically; a failed run keeps the previous one).
"""


def persisted(paths: list[str]) -> list[dict[str, dict[str, bool]]]:
    """Every output `persist: true`: DVC then leaves it in place while the command runs instead of deleting it
    first, and the stage swaps its new outputs in only once they are complete (reprotune.io), so a failed,
    refused or killed stage leaves the previous outputs as dvc.lock describes them. DVC's run cache skips
    stages with persistent outputs, so it can never record outputs under another run's params either."""
    return [{path: {"persist": True}} for path in paths]


def build(config: dict, pref_config: dict | None = None) -> dict[str, Any]:
    stages: dict[str, Any] = {}
    for name, st in DVC_STAGES.items():
        run = st.command or st.module
        params = stage_params(run, pref_config or config, True) if st.preference else stage_params(run, config)
        entry: dict[str, Any] = {
            "desc": st.desc,
            "cmd": f"python -m {PACKAGE}.{run} {HYDRA_ARGS.format(name=Path(st.params_file).stem)}",
            "deps": [*st.deps, *code_deps(run)],
            # DVC's default file needs no name; the preference stages' is named
            "params": [{st.params_file: params}] if st.preference else params,
            "outs": persisted(st.outs),
        }
        if st.metrics:
            entry["metrics"] = persisted(st.metrics)
        if st.plots:
            entry["plots"] = persisted(st.plots)
        stages[name] = entry
    return {"stages": stages}


def render(config: dict, pref_config: dict | None = None) -> str:
    return HEADER + yaml.safe_dump(build(config, pref_config), sort_keys=False, width=120)


def default_config(overrides: list[str] | None = None) -> dict:
    from omegaconf import OmegaConf

    from reprotune.config import compose

    return OmegaConf.to_container(compose(overrides or []), resolve=False)


def default_configs() -> tuple[dict, dict]:
    """The composed defaults of the SFT chain (params.yaml) and of the preference chain (params_pref.yaml)."""
    from reprotune.config import DEFAULT_PREFERENCE

    return default_config(), default_config([DEFAULT_PREFERENCE])


def stage_lines() -> list[str]:
    """The registry as `make help` prints it: make target, what it does, whether DVC runs it."""
    return [f"  {name:<14} {st.desc}{'' if st.dvc else '  (make only, not in dvc.yaml)'}" for name, st in STAGES.items()]


def main(argv: list[str]) -> int:
    if "--stages" in argv:
        print("stages (reprotune.pipeline.STAGES):\n" + "\n".join(stage_lines()))
        return 0
    text = render(*default_configs())
    if "--check" in argv:
        if DVC_YAML.read_text() != text:
            print("dvc.yaml is stale: run 'make dvc-yaml' and commit it", file=sys.stderr)
            return 1
        return 0
    tmp = DVC_YAML.with_name("dvc.yaml.tmp")
    tmp.write_text(text)
    tmp.replace(DVC_YAML)
    print(f"wrote {DVC_YAML.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
