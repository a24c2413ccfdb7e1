"""Hydra config location and composition helpers shared by every stage and by the tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

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


def library_keys(node: DictConfig, own: tuple[str, ...]) -> dict[str, Any]:
    """A config group as keyword arguments for the library it configures (SFTConfig, LoraConfig,
    BitsAndBytesConfig): every key but reprotune's own, resolved, passed through unchanged."""
    return {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in own}


def quantization(cfg: DictConfig) -> dict[str, Any] | None:
    """method.quantization as BitsAndBytesConfig keyword arguments, or None when the base is not quantised."""
    node = cfg.method.get("quantization")
    return OmegaConf.to_container(node, resolve=True) if node else None


PARAMS_HEADER = """\
# GENERATED from conf/ (+ ARGS overrides) by every 'make <stage>' (python -m reprotune.config): the resolved
# Hydra config that DVC tracks. dvc.yaml stages run with '--config-dir . --config-name params', so
# 'make <stage>' (dvc repro) and 'dvc exp run -S' use exactly these values. Edit conf/, not this file.
"""


def dump_params(overrides: list[str], out: Path) -> None:
    """Write the composed, resolved config as a standalone Hydra primary config (params.yaml)."""
    composed = compose(overrides)
    # Resolved like DVC's own Hydra composition (dvc exp run -S), so both forms track the same values and
    # an interpolated key (train.max_length: ${data.max_length}) changes in params.yaml when its source does;
    # paths stay unresolved: where things live (REPROTUNE_CACHE) is no parameter of any stage.
    cfg = OmegaConf.to_container(composed, resolve=True)
    cfg["paths"] = OmegaConf.to_container(composed.paths, resolve=False)
    cfg = {"defaults": [{"override hydra/job_logging": "stdout"}, "_self_"],
           "hydra": {"run": {"dir": "."}, "output_subdir": None, "job": {"chdir": False}}, **cfg}
    atomic_write_text(out, PARAMS_HEADER + OmegaConf.to_yaml(OmegaConf.create(cfg)))


if __name__ == "__main__":
    import sys

    dump_params(sys.argv[1:], Path("params.yaml"))
    print("wrote params.yaml")


def every_n_layers(cfg: DictConfig) -> int:
    """train.activation_checkpointing_kwargs.every_n_layers (transformers' knob), 1 when unset."""
    return int((cfg.train.get("activation_checkpointing_kwargs") or {}).get("every_n_layers", 1))
