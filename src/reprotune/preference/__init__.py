"""Preference tuning (DPO, ORPO, KTO): the objectives' trainers and configs (`trainers`), the preference data
formats (`formats`), their preparation into train/holdout pairs (`pairs`) and the built-in task's pairs
(reprotune.invoices.wrong_extraction). docs/preference.md says how to use it.

A preference run has its own inputs and outputs, so that it and the SFT run it starts from are both versioned
(dvc.yaml's stages prepare_pairs, train_pref, eval_pref, merge_pref, gguf_pref): `route_paths` points
paths.prepared at paths.pairs and the adapter, train, eval, checkpoint and export folders (merged, gguf, export)
under paths.pref, once, at the start of each stage."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reprotune.config import PARAMS_FILE, PREF_PARAMS_FILE
from reprotune.objectives import OBJECTIVES, objective

# the registry's sets, by name (reprotune.objectives says what each property means)
WITH_REFERENCE = tuple(n for n, o in OBJECTIVES.items() if o.reference)
PACKED_OBJECTIVES = tuple(n for n, o in OBJECTIVES.items() if o.packs)
PAIRED_OBJECTIVES = tuple(n for n, o in OBJECTIVES.items() if o.paired)
# next to the prepared pairs' train.jsonl: each training pair's packed tokens in its order (make prepare writes it,
# the plan reads it: reprotune.sizing.draws)
PAIR_LENGTHS_FILE = "train_lengths.json"
# the two composed configs DVC's stages run with (reprotune.config.dump_chain_params writes both)
SFT_PARAMS, PREF_PARAMS = PARAMS_FILE.removesuffix(".yaml"), PREF_PARAMS_FILE.removesuffix(".yaml")  # Hydra names


def objective_name(cfg: Any) -> str:
    """The configured objective's name (reprotune.objectives.objective(cfg) for what it is)."""
    return objective(cfg).name


def is_preference(cfg: Any) -> bool:
    return objective(cfg).preference


def _line_of(path: Path, key: str) -> int:
    """The line of a top-level key in a YAML file (0 when it is not there)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return 0
    return next((i for i, line in enumerate(lines, 1) if line.startswith(f"{key}:")), 0)


def check_chain(cfg: Any, config_name: str | None) -> None:
    """A DVC stage runs with the params file of its chain: the SFT stages (prepare, train, eval, merge, gguf:
    params.yaml) with objective=sft, the preference stages (prepare_pairs, train_pref, eval_pref, merge_pref,
    gguf_pref: params_pref.yaml) with dpo, orpo or kto; the other way round they would write the other chain's
    outputs. One line, exit 2."""
    from reprotune.errors import ReprotuneError

    if config_name not in (SFT_PARAMS, PREF_PARAMS):
        return  # a direct run (python -m reprotune.train ...) or make verify's re-run: no chain to check
    name = objective_name(cfg)
    where = f"{config_name}.yaml:{_line_of(Path(f'{config_name}.yaml'), 'objective')}: objective.name"
    if config_name == PREF_PARAMS and not is_preference(cfg):
        raise ReprotuneError(f"{where}: {name!r}, but the preference stages (prepare_pairs, train_pref, eval_pref, "
                             f"merge_pref, gguf_pref) run dpo, orpo or kto; write it with make train "
                             f"ARGS=\"objective=dpo\" (or python -m reprotune.config objective=dpo)")
    if config_name == SFT_PARAMS and is_preference(cfg):
        raise ReprotuneError(f"{where}: {name!r}, but the SFT stages (prepare, train, eval, merge, gguf) run "
                             f"objective=sft; a preference objective goes to params_pref.yaml: make train "
                             f"ARGS=\"objective={name}\"")


def route_paths(cfg: Any) -> Any:
    """A preference run's own paths, in place: it reads the pairs in paths.pairs and writes its adapter, train
    record, eval, checkpoints and exports (merged model, GGUF, export manifests) under paths.pref, never over the
    SFT run's data/prepared, outputs/adapter, outputs/merged or outputs/gguf.
    objective.init_adapter is resolved first (its default ${paths.adapter} is the SFT adapter). Checks the
    chain (check_chain) when the stage runs under Hydra. Idempotent; an SFT config is returned as it is."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        check_chain(cfg, HydraConfig.get().job.config_name)
    if not is_preference(cfg):
        return cfg
    init = cfg.objective.get("init_adapter")
    cfg.objective.init_adapter = None if init is None else str(init)
    paths, pref = cfg.paths, str(cfg.paths.pref)
    paths.prepared = str(paths.pairs)
    paths.adapter, paths.train_dir = f"{pref}/adapter", f"{pref}/train"
    paths.eval_dir, paths.checkpoints = f"{pref}/eval", f"{pref}/checkpoints"
    paths.merged, paths.gguf, paths.export_dir = f"{pref}/merged", f"{pref}/gguf", f"{pref}/export"
    return cfg

