"""Hydra config location and composition helpers shared by every stage and by the tests."""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from reprotune import schema
from reprotune.errors import ReprotuneError, user_errors
from reprotune.io import atomic_write_text

# conf/ lives at the repository root (the project runs from its source tree, in the venv and in the image)
CONF_DIR = Path(os.environ.get("REPROTUNE_CONF", Path(__file__).resolve().parents[2] / "conf")).resolve()


def compose(overrides: list[str] | None = None, config_name: str = "config",
            config_dir: str | Path = CONF_DIR) -> DictConfig:
    """Compose the config exactly as `python -m reprotune.<stage> <overrides>` would (for tests and tools)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(version_base=None, config_dir=str(Path(config_dir).resolve())):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def compose_argv(argv: list[str]) -> DictConfig:
    """The config a stage started with these command-line arguments composes: conf/ + overrides, or, with
    --config-dir/--config-name (DVC's stages: `--config-dir . --config-name params`, make verify's), that file +
    overrides. Hydra's own keys (hydra.*, hydra/...) change where the run logs, not the config: left out."""
    from reprotune.kernels import config_file

    config_dir, config_name, rest = config_file(argv)
    overrides = [a for a in rest if "=" in a and not a.lstrip("+~").startswith("hydra")]
    if config_name:
        return compose(overrides, config_name=config_name.removesuffix(".yaml"), config_dir=config_dir or ".")
    return compose(overrides)


# reprotune's own keys in the groups handed whole to a library (train/: SFTConfig or the objective's TRL config;
# method/: peft.LoraConfig; objective/: DPOConfig, ORPOConfig, KTOConfig, GRPOConfig): every other key is the
# library's. objective.rewards: GRPO's reward functions (reprotune.rl.rewards), TRL's reward_funcs argument.
OWN_KEYS: dict[str, tuple[str, ...]] = {"train": ("run",), "method": ("name", "quantization"),
                                        "objective": ("name", "init_adapter", "rewards")}


def library_keys(cfg: DictConfig, group: str) -> dict[str, Any]:
    """A config group as keyword arguments for the library it configures: every key but reprotune's own
    (OWN_KEYS), resolved, passed through unchanged."""
    return {k: v for k, v in OmegaConf.to_container(cfg[group], resolve=True).items() if k not in OWN_KEYS[group]}


def quantization(cfg: DictConfig) -> dict[str, Any] | None:
    """method.quantization as BitsAndBytesConfig keyword arguments, or None when the base is not quantised."""
    node = cfg.method.get("quantization")
    return OmegaConf.to_container(node, resolve=True) if node else None


PARAMS_HEADER = """\
# GENERATED from conf/ (+ ARGS overrides) by every 'make <stage>' (python -m reprotune.config): the resolved
# Hydra config that DVC tracks. dvc.yaml stages run with '--config-dir . --config-name params', so
# 'make <stage>' (dvc repro) and 'dvc exp run -S' use exactly these values. Edit conf/, not this file.
"""


# ------------------------------------------------------------------------- overrides checked, in one line
# A setting named like a credential: its value would land in params.yaml (git), dvc.lock and the run cache.
# Matched on the words of the last key (`hub_token`, `api_key`, `db_password`), not on substrings, so
# `max_new_tokens`, `num_key_value_heads`, `extra_keys` and `api_key_env` (the *name* of a variable) pass.
SECRET_WORDS = {"token", "secret", "password", "passwd", "credential", "credentials", "apikey"}
SECRET_VALUE = re.compile(r"\b(hf_[A-Za-z0-9]{30,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{30,})\b")


def looks_like_secret(key: str) -> bool:
    words = re.split(r"[_\-]", key.rsplit(".", 1)[-1].lower())
    return bool(SECRET_WORDS & set(words)) or words[-1] == "key"


def secret_problems(overrides: list[str]) -> list[str]:
    """One line per override that would write a credential into tracked files."""
    problems = []
    for item in overrides:
        key, _, value = item.lstrip("+~").partition("=")
        if looks_like_secret(key):
            problems.append(f"{key}: looks like a credential; settings land in params.yaml (tracked by git), "
                            f"dvc.lock and the run cache: set it in the environment instead (e.g. HF_TOKEN)")
        elif SECRET_VALUE.search(value):
            problems.append(f"{key}: the value looks like an access token; set it in the environment instead "
                            f"(e.g. HF_TOKEN), never as a setting")
    return problems


def _keys(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix]
    return [prefix] * bool(prefix) + [k for key, v in node.items() for k in _keys(v, f"{prefix}{key}." if
                                                                               prefix else f"{key}.")]


def _closest(wanted: str, config: dict) -> str:
    names = [k.rstrip(".") for k in _keys(config)]
    match = difflib.get_close_matches(wanted, names, n=1, cutoff=0.6)
    return f"did you mean {match[0]}? " if match else ""


def hydra_problem(err: Exception, overrides: list[str]) -> str:
    """Hydra's composition error (several lines, a traceback through make) as one line naming the setting."""
    from hydra.errors import MissingConfigException, OverrideParseException

    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, name = str(err.missing_cfg_file).rpartition("/")
        return f"{group}={name}: no such preset; choose one of: {', '.join(err.options)}"
    if isinstance(err, OverrideParseException):
        return f"settings: cannot parse {' '.join(overrides)!r} ({str(err).splitlines()[0]})"
    first = str(err).splitlines()[0]
    unknown = re.match(r"Could not override '([^']+)'", first)
    if unknown:
        key = unknown.group(1)
        base = OmegaConf.to_container(compose([]), resolve=False)
        return (f"{key}: no such setting; {_closest(key, base)}"
                f"(to add a new key on purpose write +{key}=...)")
    return "settings: " + " ".join(line.strip() for line in str(err).splitlines() if line.strip())


TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number"}


def _lookup(config: dict, key: str) -> tuple[bool, Any]:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def type_problems(overrides: list[str], base: dict, composed: dict) -> list[str]:
    """An override whose value has another type than the key's default (train.max_steps=abc): named with the
    expected type here, instead of a TypeError deep inside the stage."""
    problems = []
    last = dict(item.partition("=")[::2] for item in overrides if "=" in item and not item.startswith(("+", "~")))
    for key, raw in last.items():  # a key set twice: Hydra keeps the last value, and so is it checked
        found, default = _lookup(base, key)
        found_new, value = _lookup(composed, key)
        if not (found and found_new) or default is None or value is None or type(default) not in TYPE_NAMES:
            continue
        ok = isinstance(value, type(default)) and not (type(default) is int and isinstance(value, bool))
        ok = ok or (type(default) is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            problems.append(f"{key}: expected {TYPE_NAMES[type(default)]}, got {raw!r}")
    return problems


def check_settings(cfg: DictConfig) -> None:
    """Every enumerated key's value one of those it takes (reprotune.schema.CHOICES), else one line each naming
    the key and the allowed values."""
    if problems := schema.problems(cfg):
        raise ReprotuneError(problems)


# conf/config.yaml's and every params file's hydra.callbacks: the check runs before any stage's main reads cfg
SETTINGS_CALLBACK = {"check_settings": {"_target_": "reprotune.config.CheckSettings"}}


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
    from reprotune.run import resolve

    sft_params, pref_params = PARAMS_FILE.removesuffix(".yaml"), PREF_PARAMS_FILE.removesuffix(".yaml")
    if config_name not in (sft_params, pref_params):
        return  # a direct run (python -m reprotune.train ...) or make verify's re-run: no chain to check
    obj = resolve(cfg, "params").objective
    where = f"{config_name}.yaml:{_line_of(Path(f'{config_name}.yaml'), 'objective')}: objective.name"
    if obj.rl:  # no DVC chain of its own yet (docs/grpo.md): neither chain's stages may write its outputs
        raise ReprotuneError(f"{where}: {obj.name!r} has no DVC chain yet; run it directly: python -m "
                             f"reprotune.prepare objective={obj.name}, then python -m reprotune.train "
                             f"objective={obj.name} (docs/grpo.md)")
    if config_name == pref_params and not obj.preference:
        raise ReprotuneError(f"{where}: {obj.name!r}, but the preference stages (prepare_pairs, train_pref, "
                             f"eval_pref, merge_pref, gguf_pref) run dpo, orpo or kto; write it with make train "
                             f"ARGS=\"objective=dpo\" (or python -m reprotune.config objective=dpo)")
    if config_name == sft_params and obj.preference:
        raise ReprotuneError(f"{where}: {obj.name!r}, but the SFT stages (prepare, train, eval, merge, gguf) run "
                             f"objective=sft; a preference objective goes to params_pref.yaml: make train "
                             f"ARGS=\"objective={obj.name}\"")


class CheckSettings(Callback):
    """Hydra's on_job_start hook: check_settings on the composed config, and the params file's chain
    (check_chain), before the stage's main runs; a bad value is its one line and exit status 2
    (errors.user_errors), from every `python -m reprotune.<stage>`."""

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        with user_errors():
            check_settings(config)
            check_chain(config, HydraConfig.get().job.config_name)


def sanitise_name(text: str) -> str:
    """A name fit for a model id, an Ollama tag and a file name: lower case, [a-z0-9._-], no leading dot."""
    name = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    return name or "data"


def name_from_path(path: str) -> str:
    """data.name for a user's file or folder: its stem (`Dates v2.jsonl` -> `dates-v2`)."""
    p = Path(path.rstrip("/"))
    return sanitise_name(p.stem if p.suffix else p.name)


def with_data_name(overrides: list[str]) -> list[str]:
    """data.path given without data.name: the data's name is the file's stem (the adapter card, the eval report, the
    GGUF's Ollama name and the served model id carry it), not the built-in `invoices`."""
    given = {override_key(o): o.partition("=")[2] for o in overrides if "=" in o}
    if given.get("data.path") and "data.name" not in given:
        return [*overrides, f"data.name={name_from_path(given['data.path'])}"]
    return overrides


def compose_checked(overrides: list[str]) -> DictConfig:
    """compose(), with every user mistake in the overrides as a ReprotuneError of one line each: a credential,
    an unknown key (with the closest valid name), an unknown preset (with the list), a value of the wrong type.
    data.path without data.name names the data after the file (with_data_name)."""
    from hydra.errors import HydraException

    if problems := secret_problems(overrides):
        raise ReprotuneError(problems)
    overrides = with_data_name(overrides)
    try:
        composed = compose(overrides)
    except (HydraException, OSError) as err:  # MissingConfigException is an OSError too
        raise ReprotuneError(hydra_problem(err, overrides)) from None
    base = OmegaConf.to_container(compose([]), resolve=False)
    try:
        resolved = OmegaConf.to_container(composed, resolve=True)
    except Exception as err:  # noqa: BLE001 - an interpolation the user broke (${data.nope}): one line
        raise ReprotuneError(f"settings: {str(err).splitlines()[0]}") from None
    if problems := type_problems(overrides, base, resolved):
        raise ReprotuneError(problems)
    check_settings(composed)
    if problems := secret_problems([f"{k}=" for k in _keys(resolved) if not k.startswith("paths.")]):
        raise ReprotuneError(problems)  # a credential written into conf/ itself
    return composed


def params_values(composed: DictConfig) -> dict[str, Any]:
    """The values params.yaml records for a composed config (what dvc.lock then holds per stage)."""
    # Resolved like DVC's own Hydra composition (dvc exp run -S), so both forms track the same values and
    # an interpolated key (train.max_length: ${data.max_length}) changes in params.yaml when its source does;
    # paths stay unresolved: where things live (REPROTUNE_CACHE) is no parameter of any stage.
    cfg = OmegaConf.to_container(composed, resolve=True)
    cfg["paths"] = OmegaConf.to_container(composed.paths, resolve=False)
    return cfg


def dump_params(overrides: list[str], out: Path, composed: DictConfig | None = None) -> None:
    """Write the composed, resolved config as a standalone Hydra primary config (params.yaml)."""
    composed = composed if composed is not None else compose_checked(overrides)
    cfg = params_values(composed)
    cfg = {"defaults": [{"override hydra/job_logging": "stdout"}, "_self_"],
           "hydra": {"run": {"dir": "."}, "output_subdir": None, "job": {"chdir": False},
                     "callbacks": SETTINGS_CALLBACK}, **cfg}
    header = PARAMS_HEADER if out.name != PREF_PARAMS_FILE else PREF_PARAMS_HEADER
    atomic_write_text(out, header + OmegaConf.to_yaml(OmegaConf.create(cfg)))


# ------------------------------------------------------------------ the two chains: params.yaml, params_pref.yaml
PARAMS_FILE, PREF_PARAMS_FILE = "params.yaml", "params_pref.yaml"
PREF_PARAMS_HEADER = """\
# GENERATED like params.yaml (python -m reprotune.config; make train|eval|repro with a preference objective), with
# the objective: the preference stages (prepare_pairs, train_pref, eval_pref) run '--config-name params_pref'.
# Every other setting is params.yaml's, so the preference run starts from the SFT run of the same settings.
"""
PREFERENCE_OBJECTIVES = schema.PREFERENCE_OBJECTIVES
DEFAULT_PREFERENCE = "objective=dpo"  # what make repro (and a fresh clone's dvc repro) runs after SFT


def override_key(item: str) -> str:
    """The key of a Hydra override (`++objective.max_steps=2` -> `objective.max_steps`)."""
    return item.lstrip("+~").partition("=")[0]


def is_objective_override(item: str) -> bool:
    key = override_key(item)
    return key == "objective" or key.startswith("objective.") or key.startswith("objective/")


def chain_configs(overrides: list[str]) -> tuple[list[str], list[str], DictConfig]:
    """(the SFT chain's overrides, the preference chain's overrides, its composed config): dump_chain_params'."""
    plain = [o for o in overrides if not is_objective_override(o)]
    pref = compose_checked(overrides)
    pref_over = overrides
    if OmegaConf.select(pref, "objective.name") not in PREFERENCE_OBJECTIVES:
        keys = [o for o in overrides if override_key(o).startswith("objective.")]
        pref_over = [*plain, DEFAULT_PREFERENCE, *keys]
        pref = compose_checked(pref_over)
    return plain, pref_over, pref


def dump_chain_params(overrides: list[str], root: Path = Path("."), sft: bool = True) -> DictConfig:
    """params_pref.yaml from the overrides (objective=dpo added when they name no preference objective), and,
    with sft, params.yaml from the same overrides without the objective ones: both chains share every setting
    but the objective (a preference run's own steps and learning rate are objective.* keys, DPOConfig's). Every
    problem is raised before either file changes. Returns the preference config. Keys of the objective set without
    naming a preference objective (`++objective.max_steps=2` beside an SFT run's args: make repro, make train) go
    to the default preference objective's file: only a preference run reads them."""
    plain, pref_over, pref = chain_configs(overrides)
    base = compose_checked(plain) if sft else None
    dump_params(pref_over, root / PREF_PARAMS_FILE, pref)
    if base is not None:
        dump_params(plain, root / PARAMS_FILE, base)
    return pref


if __name__ == "__main__":
    import sys

    with user_errors():  # both chains' files (make params)
        dump_chain_params(sys.argv[1:])
    print(f"wrote {PARAMS_FILE}, {PREF_PARAMS_FILE}")


def every_n_layers(cfg: DictConfig) -> int:
    """train.activation_checkpointing_kwargs.every_n_layers (transformers' knob), 1 when unset."""
    return int((cfg.train.get("activation_checkpointing_kwargs") or {}).get("every_n_layers", 1))


def plain(node: Any) -> dict[str, Any]:
    """A config node (or a mapping) as a plain dict, interpolations resolved."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
