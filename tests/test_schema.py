"""Settings checked at the door (reprotune.schema): every enumerated key against one table, one line naming the
key and its values, exit 2, from make's compose_checked, from `python -m reprotune.<stage>` and from a params file
(DVC's runs)."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from reprotune import schema
from reprotune.config import CONF_DIR, compose, compose_checked, dump_params
from reprotune.errors import ReprotuneError

ROOT = Path(__file__).resolve().parents[1]
OBJECTIVES = sorted(p.stem for p in (CONF_DIR / "objective").glob("*.yaml"))
OBJECTIVES_IN_CONF = OBJECTIVES


def test_every_key_of_the_table_is_a_setting() -> None:
    cfg = compose(["objective=dpo"])
    missing = [k for k in schema.CHOICES if OmegaConf.select(cfg, k, default="<absent>") == "<absent>"]
    assert missing == []


@pytest.mark.parametrize(("hardware", "objective", "method"),
                         list(itertools.product(("auto", "cpu", "gpu"), OBJECTIVES, ("lora", "qlora", "dora"))))
def test_every_preset_passes(hardware: str, objective: str, method: str) -> None:
    cfg = compose([f"hardware={hardware}", f"objective={objective}", f"method={method}"])
    assert schema.problems(cfg) == []
    assert cfg.objective.name in schema.OBJECTIVES and cfg.method.name in schema.METHODS


@pytest.mark.parametrize("key", sorted(schema.CHOICES))
def test_an_unknown_value_is_one_line_naming_key_and_values(key: str) -> None:
    choice = schema.CHOICES[key]
    overrides = ["objective=dpo", f"{key}=nope"]
    with pytest.raises(ReprotuneError) as err:
        compose_checked(overrides)
    assert err.value.problems == [f"{key}: 'nope' is not one of {choice.describe()}"]


def test_the_check_reads_values_not_spellings() -> None:
    allowed = {"hardware.fast_path": [True, False, "auto", None], "hardware.dataloader_workers": [0, 3, "auto"],
               "hardware.memory_budget_gib": [22, 23.5, "auto"], "eval.batch_size": [1, 32, "auto"]}
    refused = {"hardware.fast_path": [1, "yes"], "hardware.dataloader_workers": [-1, 1.5, True],
               "hardware.memory_budget_gib": [0, -1.0, True], "eval.batch_size": [0, True, 2.0], "repro": [None]}
    for key, values in allowed.items():
        assert all(schema.CHOICES[key].allows(v) for v in values), key
    for key, values in refused.items():
        assert not any(schema.CHOICES[key].allows(v) for v in values), key


def test_the_hardware_presets_hold_only_what_differs_from_auto() -> None:
    auto = yaml.safe_load((CONF_DIR / "hardware/auto.yaml").read_text())
    for name in ("cpu", "gpu"):
        own = yaml.safe_load((CONF_DIR / f"hardware/{name}.yaml").read_text())
        assert own.pop("defaults") == ["auto", "_self_"]
        assert own and all(auto[k] != v for k, v in own.items()), name
        assert OmegaConf.to_container(compose([f"hardware={name}"]).hardware).keys() == auto.keys()


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("REPROTUNE_PROBLEMS_FILE", None)
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_make_plan_refuses_an_unknown_mode(tmp_path: Path) -> None:
    """The issue's case: `make plan ARGS="repro=strcit"` planned a default run."""
    proc = _run(["reprotune.plan", "repro=strcit", f"paths.root={tmp_path}"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["repro: 'strcit' is not one of default, strict, fast"]
    assert not (tmp_path / "outputs").exists()


def test_a_stage_run_from_a_params_file_is_checked_first(tmp_path: Path) -> None:
    """DVC's form (`--config-dir . --config-name params`): the params file declares the check; an edited value
    (params.yaml by hand, `dvc exp run -S`) stops the stage before it reads anything."""
    dump_params([], tmp_path / "params.yaml")
    text = (tmp_path / "params.yaml").read_text().replace("norm_kernel: auto", "norm_kernel: ligr")
    (tmp_path / "params.yaml").write_text(text)
    proc = _run(["reprotune.prepare", "--config-dir", ".", "--config-name", "params", "hardware.device=cpu"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["hardware.norm_kernel: 'ligr' is not one of auto, liger, torch"]


@pytest.mark.parametrize("stage", ["merge", "train"])
def test_a_stage_run_with_the_other_chains_file_stops_at_the_door(stage: str, tmp_path: Path) -> None:
    """The params file's chain is checked by the settings callback (reprotune.config.check_chain), before the
    stage's main: params_pref.yaml edited to objective sft, params.yaml to dpo; one line each, exit 2, nothing
    written (the chain's paths are the file's own, conf/objective/paths/preference.yaml; no code reroutes them)."""
    from reprotune.config import dump_chain_params

    dump_chain_params([], tmp_path)
    pref = tmp_path / "params_pref.yaml"
    pref.write_text(pref.read_text().replace("objective:\n  name: dpo", "objective:\n  name: sft"))
    proc = _run([f"reprotune.{stage}", "--config-dir", ".", "--config-name", "params_pref"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("params_pref.yaml:"), proc.stderr
    assert "objective.name: 'sft', but the preference stages (prepare_pairs, train_pref" in proc.stderr
    sft = tmp_path / "params.yaml"
    sft.write_text(sft.read_text().replace("objective:\n  name: sft", "objective:\n  name: dpo"))
    proc = _run([f"reprotune.{stage}", "--config-dir", ".", "--config-name", "params"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "objective.name: 'dpo', but the SFT stages (prepare, train, eval, merge, gguf) run objective=sft" in proc.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "data").exists()


def test_the_objective_registry_is_the_one_list() -> None:
    """reprotune.objectives: one entry per conf/objective/*.yaml and per schema name; the sets the code used to
    spell out by name (reference, packed, paired) are the registry's properties."""
    from reprotune.objectives import OBJECTIVES
    from reprotune.preference import PACKED_OBJECTIVES, PAIRED_OBJECTIVES, WITH_REFERENCE
    from reprotune.run import objective_of as objective

    assert tuple(OBJECTIVES) == schema.OBJECTIVES and set(OBJECTIVES) == set(OBJECTIVES_IN_CONF)
    assert (set(WITH_REFERENCE), set(PACKED_OBJECTIVES), set(PAIRED_OBJECTIVES)) == (
        {"dpo", "kto"}, {"dpo", "kto", "orpo"}, {"dpo", "orpo"})
    for name in OBJECTIVES_IN_CONF:
        cfg = compose([f"objective={name}"])
        assert objective(cfg).name == name and objective(cfg).preference == (name in schema.PREFERENCE_OBJECTIVES)
        assert objective(cfg).rl == (name in schema.RL_OBJECTIVES) and objective(cfg).from_adapter == (name != "sft")
    with pytest.raises(ReprotuneError, match=r"^objective.name: 'ppo' is not one of sft, dpo, orpo, kto, grpo$"):
        objective(OmegaConf.create({"objective": {"name": "ppo"}}))
