"""dvc.yaml is derived from the code (reprotune.pipeline): fresh, complete code deps, exactly the params read."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import yaml

from reprotune import pipeline
from reprotune.config import compose

from .conftest import REPO


@pytest.mark.slow  # full lane: imports every stage module in its own process to derive the deps; make dvc-yaml regenerates dvc.yaml and CI checks it
def test_dvc_yaml_is_fresh() -> None:
    """Editing a stage's imports or config reads without 'make dvc-yaml' fails here."""
    assert (REPO / "dvc.yaml").read_text() == pipeline.render(*pipeline.default_configs()), \
        "dvc.yaml is stale: run 'make dvc-yaml' and commit it"


def test_code_deps_cover_every_imported_project_module() -> None:
    """The modules the issue found missing are deps now, found through lazy and transitive imports."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    deps = {name: set(st["deps"]) for name, st in stages.items()}
    src = "src/reprotune/"
    assert {f"{src}{m}.py" for m in ("models", "manifest", "config", "llamacpp", "modelfile")} <= deps["gguf"]
    assert {f"{src}manifest.py", f"{src}config.py", f"{src}models.py"} <= deps["eval"]  # eval loads through models
    for name, st in pipeline.DVC_STAGES.items():
        for module in pipeline.import_closure(st.command or st.module):
            assert pipeline.module_file(module).relative_to(REPO).as_posix() in deps[name], (name, module)
    assert f"{src}pipeline.py" not in set().union(*deps.values())  # imported by no stage


def test_every_dependency_a_stage_names_exists() -> None:
    """A dep is a file of the checkout or another stage's output: a renamed script left in pipeline.py made every
    make gguf fail with DVC's 'No such file' (the fresh-clone CI of e325fd8)."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    outs = {str(o if isinstance(o, str) else next(iter(o))) for st in stages.values() for o in st.get("outs", [])}
    ignored = {"data/raw"}  # data.dvc's output: pulled or regenerated (make data), not tracked by git
    for name, st in stages.items():
        for dep in st.get("deps", []):
            if dep in outs or dep in ignored or "${" in dep:
                continue
            assert (REPO / dep).exists(), f"{name}: dep {dep} does not exist"


def test_import_closure_follows_lazy_imports(tmp_path, monkeypatch) -> None:
    pkg = tmp_path / "reprotune"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def main():\n    from reprotune import b\n    return b.f()\n")
    (pkg / "b.py").write_text("from reprotune.c import g\n\ndef f():\n    return g()\n")
    (pkg / "c.py").write_text("def g():\n    return 1\n")
    (pkg / "d.py").write_text("")  # imported by nobody
    monkeypatch.setattr(pipeline, "SRC", pkg)
    assert pipeline.import_closure("a") == ["reprotune", "reprotune.a", "reprotune.b", "reprotune.c"]


def test_config_reads_are_found_through_attributes_get_and_aliases() -> None:
    code = """
def f(cfg):
    a = cfg.train.max_steps
    b = cfg.export.get("threads") or cfg.export.parity["n_ctx"]
    t = cfg.eval
    helper(cfg.model)
    record(cfg)               # bare: passed on or recorded, not a read
    return cfg.data.items()   # a method: data is read whole
"""
    tree = ast.parse(code)
    reads = pipeline.cfg_reads(tree, pipeline._parents(tree))
    assert reads == {"train.max_steps", "export.threads", "export.parity.n_ctx", "eval", "model", "data"}


def test_params_are_exactly_what_each_stage_reads() -> None:
    """Reads follow calls: gguf imports merge for two helpers, not merge's params; eval reads no train.* key."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    files = {name: next(iter(st["params"][0])) if isinstance(st["params"][0], dict) else "params.yaml"
             for name, st in stages.items()}
    params = {name: st["params"][0][files[name]] if files[name] != "params.yaml" else st["params"]
              for name, st in stages.items()}
    assert {n for n, f in files.items() if f == "params_pref.yaml"} == {"prepare_pairs", "train_pref", "eval_pref",
                                                                        "merge_pref", "gguf_pref"}
    assert "export.merge.prompts" in params["merge"] and not any(p.startswith("export.merge") for p in params["gguf"])
    # the preference chain's export reads what the SFT chain's does, from params_pref.yaml
    assert {p for p in params["merge_pref"] if p != "objective"} == set(params["merge"])
    assert {p for p in params["gguf_pref"] if p != "objective"} == set(params["gguf"])
    assert "train" in params["train"] and not any(p.startswith("train") for p in params["eval"])
    # the gguf stage reads all of export.parity (the gate thresholds with the greedy settings)
    assert "export.parity" in params["gguf"] and "eval.max_new_tokens" in params["eval"]
    assert not any(p.startswith("paths") for ps in params.values() for p in ps)
    # the SFT stages refuse a preference objective at start (check_chain): objective is none of their params
    assert not any(p.startswith("objective") for n, ps in params.items() if files[n] == "params.yaml" for p in ps)
    assert "objective" in params["train_pref"] and "objective" in params["eval_pref"] and "train" in params["train_pref"]
    # every listed param exists in its composed config (DVC refuses a stage whose param is missing)
    sft, pref = pipeline.default_configs()
    for name, keys in params.items():
        for key in keys:
            node = pref if files[name] == "params_pref.yaml" else sft
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, (name, key)
                node = node[part]


def test_the_preference_chain_has_its_own_outputs_after_sfts() -> None:
    """prepare_pairs -> train_pref -> eval_pref, merge_pref -> gguf_pref: data/pairs and outputs/pref, never an SFT
    output; train_pref starts from the SFT adapter (a dep, so dvc repro builds SFT first), eval_pref compares
    against it, and the export stages read the preference adapter and pairs only."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    outs = {name: {next(iter(o)) for kind in ("outs", "metrics", "plots") for o in st.get(kind, [])}
            for name, st in stages.items()}
    sft_outs = set().union(*(outs[n] for n in ("prepare", "train", "eval", "merge", "gguf")))
    for name in ("prepare_pairs", "train_pref", "eval_pref", "merge_pref", "gguf_pref"):
        assert outs[name] and not outs[name] & sft_outs, name
        assert all(o.startswith(("data/pairs/", "outputs/pref/")) for o in outs[name]), name
        assert "--config-name params_pref " in stages[name]["cmd"]
    assert {"data/pairs/train.jsonl", "outputs/adapter"} <= set(stages["train_pref"]["deps"])
    assert {"data/pairs/holdout.jsonl", "outputs/pref/adapter", "outputs/adapter"} <= set(stages["eval_pref"]["deps"])
    assert "${data.preference.path}" in stages["prepare_pairs"]["deps"]
    data_deps = lambda name: [d for d in stages[name]["deps"] if d.startswith(("data/", "outputs/"))]  # noqa: E731
    assert data_deps("merge_pref") == ["outputs/pref/adapter", "data/pairs/holdout.jsonl"]
    assert data_deps("gguf_pref") == ["outputs/pref/merged", "data/pairs/holdout.jsonl", "data/pairs/train.jsonl"]
    assert [d for d in stages["gguf"]["deps"] if not d.startswith(("data/", "outputs/"))] == \
        [d for d in stages["gguf_pref"]["deps"] if not d.startswith(("data/", "outputs/"))]  # code, locks, llama.cpp
    assert all("--config-name params " in stages[n]["cmd"] for n in ("prepare", "train", "eval", "merge", "gguf"))


def test_prepare_depends_on_the_users_data_path(tmp_path) -> None:
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    assert "${data.path}" in stages["prepare"]["deps"]
    # params.yaml holds data.path resolved, so DVC's template sees the user's file or folder
    from reprotune.config import dump_params

    assert compose(["data.path=/srv/mine.jsonl"]).data.path == "/srv/mine.jsonl"
    out = tmp_path / "params.yaml"
    dump_params(["data.path=/srv/mine.jsonl"], out)
    assert yaml.safe_load(out.read_text())["data"]["path"] == "/srv/mine.jsonl"
    dump_params([], out)
    params = yaml.safe_load(out.read_text())
    assert params["data"]["path"] == "./data/raw/invoices.jsonl"
    assert params["train"]["max_length"] == params["data"]["max_length"]  # resolved: DVC sees the value
    assert params["paths"]["model_cache"].startswith("${oc.env:REPROTUNE_CACHE")  # where is no param


def test_make_help_prints_the_stage_registry() -> None:
    """make help lists the stages from reprotune.pipeline.STAGES, the registry dvc.yaml and the structure test read."""
    import os
    import subprocess

    venv = Path(sys.executable).parent.parent
    out = subprocess.run(["make", "-s", "help", f"VENV={venv}"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO / "src")}, timeout=120)
    assert out.returncode == 0, out.stderr
    listed = out.stdout.split("stages (reprotune.pipeline.STAGES):", 1)[1]
    for name, st in pipeline.STAGES.items():
        assert f"  {name:<14} {st.desc}" in listed, name
    dvc_stages = set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    assert dvc_stages == set(pipeline.DVC_STAGES) and "plan" in set(pipeline.STAGES) - dvc_stages
