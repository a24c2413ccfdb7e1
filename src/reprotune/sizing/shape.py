"""Shapes the sizing models read: the model's (from its preset or config.json, no weights loaded), its parameter
counts, and the prepared data's token lengths. No torch."""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from reprotune.config import CONF_DIR, plain
from reprotune.run import Run

PLAN_DIR = CONF_DIR / "plan"


# The SmolLM2 tokenizer that random_init presets take from the built-in model (len(tokenizer))
BUILTIN_TOKENIZER_VOCAB = 49152


# model_type (config.json / a preset's model_type) -> what its decoder layers add to a Llama layer: per-head q/k
# RMSNorm (qk_norm) and norms per layer (Gemma 3's sandwich norms: 4)
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text", "olmo2")


NORMS_PER_LAYER = {"gemma3": 4, "gemma3_text": 4, "gemma2": 4}


LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class PlanError(ValueError):
    """The configuration cannot be planned (e.g. a hub model without a known architecture)."""


def load_table(name: str) -> dict[str, Any]:
    """A conf/plan table, parsed; a fresh copy each call (callers may adjust theirs)."""
    return copy.deepcopy(_parsed((PLAN_DIR / name).read_text()))


@functools.lru_cache(maxsize=16)
def _parsed(text: str) -> Any:
    # keyed by the file's text, so an edited table is parsed again: one `make plan` reads the tables ~70 times
    # (every card's fit, every candidate), and parsing was 90% of its time
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def load_tables() -> dict[str, Any]:
    return {"memory": load_table("memory.yaml"), "throughput": load_table("throughput.yaml"),
            "prices": load_table("prices.yaml")}


# ------------------------------------------------------------------------------------------------ model


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    source: str
    model_type: str = "llama"
    qk_norm: bool = False       # Qwen3, Gemma 3: q_norm/k_norm over each head (weights and saved activations)
    norms_per_layer: int = 2

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def module_dims(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear module of a decoder layer."""
        h, i, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def shape_from_config(conf: dict[str, Any], source: str, model_type: str | None = None) -> Shape:
    """From a config.json-like mapping (Llama/Qwen/Mistral/Gemma keys); model_type from the mapping or given."""
    conf = conf.get("text_config", conf)
    model_type = str(conf.get("model_type") or model_type or "llama")
    try:
        hidden, heads = int(conf["hidden_size"]), int(conf["num_attention_heads"])
        return Shape(hidden=hidden, intermediate=int(conf["intermediate_size"]),
                     layers=int(conf["num_hidden_layers"]), heads=heads,
                     kv_heads=int(conf.get("num_key_value_heads") or heads),
                     head_dim=int(conf.get("head_dim") or hidden // heads),
                     vocab=int(conf.get("vocab_size") or BUILTIN_TOKENIZER_VOCAB),
                     tied=bool(conf.get("tie_word_embeddings", False)), source=source, model_type=model_type,
                     qk_norm=model_type in QK_NORM_TYPES, norms_per_layer=NORMS_PER_LAYER.get(model_type, 2))
    except KeyError as err:
        raise PlanError(f"{source}: architecture: missing {err.args[0]}") from None


def model_shape(model_cfg: Any) -> Shape:
    """The shape of the configured model, without loading it."""
    model = plain(model_cfg)
    path = model.get("path")
    if path and (Path(path) / "config.json").is_file():
        return shape_from_config(json.loads((Path(path) / "config.json").read_text()), f"{path}/config.json")
    if model.get("source") == "random_init":
        spec = dict(model["random_init"])
        if spec.get("architecture") is not None:  # what reprotune.models.random_init_config builds
            arch = dict(spec["architecture"])
            arch["vocab_size"] = arch.get("vocab_size") or BUILTIN_TOKENIZER_VOCAB  # null: the tokenizer's ids
            return shape_from_config(arch, f"conf/model/{model['name']}.yaml: random_init.architecture",
                                     spec.get("model_type"))
        spec.setdefault("tie_word_embeddings", True)  # the flat form: a tied Llama with the tokenizer's vocabulary
        spec["vocab_size"] = BUILTIN_TOKENIZER_VOCAB
        return shape_from_config(spec, f"conf/model/{model['name']}.yaml: random_init", "llama")
    if model.get("architecture"):
        return shape_from_config(dict(model["architecture"]), f"conf/model/{model['name']}.yaml: architecture",
                                 model.get("model_type"))
    raise PlanError(f"conf/model/{model.get('name')}.yaml: architecture: missing; add the model's config.json numbers "
                    "(hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, "
                    "vocab_size, tie_word_embeddings) or set model.path to a local directory with a config.json")


@dataclass(frozen=True)
class Params:
    total: int          # base model
    layer_linear: int   # the decoder layers' linear weights (what NF4 quantises)
    embeddings: int     # input embedding + untied LM head
    largest_linear: int
    trainable: int      # LoRA A/B (+ DoRA magnitudes)
    input_embedding: int = 0  # the input embedding alone (what hardware.embedding_on_host keeps on the host)


def count_params(shape: Shape, targets: list[str], r: int, dora: bool) -> Params:
    dims = shape.module_dims()
    per_layer_linear = sum(i * o for i, o in dims.values())
    norms = shape.norms_per_layer * shape.hidden + (2 * shape.head_dim if shape.qk_norm else 0)
    embeddings = shape.vocab * shape.hidden * (1 if shape.tied else 2)
    total = shape.layers * (per_layer_linear + norms) + embeddings + shape.hidden
    chosen = [m for m in LINEAR_MODULES if m in targets] if targets != ["all-linear"] else list(LINEAR_MODULES)
    trainable = shape.layers * sum(r * (dims[m][0] + dims[m][1]) + (dims[m][1] if dora else 0) for m in chosen)
    return Params(total=total, layer_linear=shape.layers * per_layer_linear, embeddings=embeddings,
                  largest_linear=max(i * o for i, o in dims.values()), trainable=trainable,
                  input_embedding=shape.vocab * shape.hidden)


# ------------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class DataShape:
    examples: int
    max_tokens: int
    mean_tokens: float
    total_tokens: int
    assistant_share: float    # assistant characters / all message characters (the loss positions)
    prepared_max_length: int | None
    tokenizer_model: str | None
    overlong: int
    source: str
    # packed pairs: ((B, the largest micro-batch's tokens), ...) of the micro-batches the run will draw
    # (reprotune.sizing.draws); empty: a micro-batch is bounded by B copies of the longest pair
    drawn_batch_tokens: tuple[tuple[int, int], ...] = ()


def data_shape_from_prepared(prepared: Path | str) -> dict[str, Any]:
    """Token lengths (prepare's report, counted with the model's tokenizer and chat template) and the assistant
    share of the training examples; a dict so bench/plan_calibrate.py can store it next to a measurement."""
    prepared = Path(prepared)
    report = json.loads((prepared / "report.json").read_text())
    train = report["tokens"]["train"]
    chars = assistant = 0
    with open(prepared / "train.jsonl", encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                for msg in json.loads(line)["messages"]:
                    n = len(msg.get("content") or "")
                    chars += n
                    assistant += n if msg.get("role") == "assistant" else 0
    return {"examples": int(train["n"]), "max_tokens": int(train["max"]), "mean_tokens": float(train["mean"]),
            "total_tokens": int(train["total"]), "assistant_share": round(assistant / chars, 4) if chars else 1.0,
            "prepared_max_length": report.get("max_length"), "tokenizer_model": report["tokens"].get("model"),
            "overlong": int(report["examples"]["overlong"]["count"]), "source": str(prepared)}


def pair_shape_from_prepared(prepared: Path | str) -> dict[str, Any] | None:
    """Prepared DPO pairs as the packed micro-batch sees them (reprotune.preference.packed): a pair is one row of
    its prompt once and both answers; the loss positions are the answers'. None: pairs prepared before the report
    counted them (prepare them again)."""
    prepared = Path(prepared)
    report = json.loads((prepared / "report.json").read_text())
    packed = report["tokens"].get("packed_pair_train")
    if not packed or not packed.get("n"):
        return None
    return {"examples": int(packed["n"]), "max_tokens": int(packed["max"]), "mean_tokens": float(packed["mean"]),
            "total_tokens": int(packed["total"]), "assistant_share": float(report["tokens"]["answer_share_train"]),
            "prepared_max_length": report.get("max_length"), "tokenizer_model": report["tokens"].get("model"),
            "overlong": int(report["pairs"]["overlong"]["dropped"]), "source": str(prepared)}


def padded_shape_from_prepared(prepared: Path | str, objective: str) -> dict[str, Any] | None:
    """Prepared preference rows as TRL 1.16's padded batches see them (ORPO, KTO, DPO unpacked): every sequence a
    row (a pair: prompt + chosen and prompt + rejected), padded to the longest of its micro-batch. From prepare's
    report: the longest sequence of each pair (tokens.train). examples: what the trainer iterates (KTO unpairs a
    pair into two examples); total_tokens: every sequence counted as long as its pair's longest (a bound, as the
    loss positions' share is: the answers over the packed pair's tokens). None: no counts (prepare them again)."""
    prepared = Path(prepared)
    report = json.loads((prepared / "report.json").read_text())
    tokens = report["tokens"]
    seqs = tokens.get("train")
    if not seqs or not seqs.get("n") or not tokens.get("longest_sequence_of_pair"):
        return None
    paired = (report.get("pairs") or {}).get("paired")
    if paired is None:  # reports written before prepare recorded it: the rows say
        with open(prepared / "train.jsonl", encoding="utf-8") as fh:
            paired = "chosen" in json.loads(fh.readline())
    per_row = 2 if paired else 1  # sequences of a prepared row
    return {"examples": int(seqs["n"]) * (per_row if objective == "kto" else 1), "max_tokens": int(seqs["max"]),
            "mean_tokens": float(seqs["mean"]), "total_tokens": per_row * int(seqs["total"]),
            "assistant_share": float(tokens.get("answer_share_train", 1.0)),
            "prepared_max_length": report.get("max_length"), "tokenizer_model": tokens.get("model"),
            "overlong": int(((report.get("pairs") or {}).get("overlong") or {}).get("dropped", 0)),
            "source": str(prepared)}


def load_data_shape(cfg: DictConfig, padded: bool | None = None, world_size: int = 1,
                    resolved: Run | None = None, global_batch: int | None = None) -> DataShape | None:
    """The prepared training data's shape: conversations, or (a preference objective) packed pairs, or with
    `padded` the padded rows of TRL's preference trainers (None: DPO and ORPO with train.packing other than false
    are packed pairs, as on the GPU; KTO and unpacked pairs are padded; KTO's rows are the same packed or padded).
    Packed pairs carry the largest micro-batch the run will draw on `world_size` processes, where that is known
    (global_batch: the configured rows x accumulation, reprotune.sizing.decide.configured_batch; None: not drawn).
    resolved: the stage's reprotune.run.Run, its objective and paths.prepared (default: resolve(cfg, "plan")'s)."""
    if resolved is None:
        from reprotune.run import resolve

        resolved = resolve(cfg, "plan")
    # a preference run's paths.prepared is its pairs' folder (conf/objective/paths/preference.yaml)
    obj, prepared = resolved.objective, resolved.path("prepared")
    if obj.rl:  # prompts alone: the completions' lengths are sampled (the generation is not modelled yet: #47)
        return None
    if not (prepared / "report.json").is_file() or not (prepared / "train.jsonl").is_file():
        return None
    if obj.preference:
        paired = obj.paired
        if padded is None:
            padded = not paired or cfg.train.get("packing") is False
        # KTO's rows are the same sequences packed or padded: only packed pairs are counted another way
        found = (pair_shape_from_prepared(prepared) if paired and not padded
                 else padded_shape_from_prepared(prepared, obj.name))
        if found and paired and not padded and global_batch:
            from reprotune.sizing.draws import drawn_batch_tokens

            found["drawn_batch_tokens"] = drawn_batch_tokens(cfg, prepared, found["prepared_max_length"],
                                                             global_batch, world_size)
        return DataShape(**found) if found else None
    return DataShape(**data_shape_from_prepared(prepared))
