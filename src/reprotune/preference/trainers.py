"""The preference objectives' TRL trainers and configs, the adapter they start from and their reference model.

    dpo   trl.DPOTrainer / trl.DPOConfig
    kto   trl.KTOTrainer / trl.KTOConfig
    orpo  trl.experimental.orpo.ORPOTrainer / ORPOConfig (TRL 1.16 moved ORPO to trl.experimental)

Config: the train/ group's TrainingArguments keys (its SFT-only keys, the SFTConfig fields the objective's config
lacks, are left out), then the objective/ group's own keys (DPOConfig's beta, loss_type, ...: they win), then
reprotune.trainer_args.guarantee_keys (they win over both).

Reference model (DPO, KTO): TRL builds none when the model is a PEFT model. With a fresh adapter (peft_config
given, objective.init_adapter null) the reference is the base with the adapter disabled; with
objective.init_adapter the adapter is loaded as the trainable "default" adapter and TRL adds a frozen copy named
"ref", which is the reference (trl/trainer/dpo_trainer.py: `model.add_adapter("ref", ...)`, used through
`use_adapter(model, "ref")`). Either way there is no second copy of the base in memory.

Reads the prepared pairs (data/pairs/train.jsonl) and objective.init_adapter (when set); writes nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from reprotune.config import library_keys
from reprotune.errors import ReprotuneError
from reprotune.io import iter_jsonl
from reprotune.objectives import Objective
from reprotune.run import Run
from reprotune.run_settings import RunSettings
from reprotune.schema import OBJECTIVES
from reprotune.trainer_args import guarantee_keys, passthrough_keys


def trl_classes(name: str) -> tuple[type, type]:
    """(trainer class, config class) of a preference objective, from the TRL that is installed."""
    if name == "dpo":
        from trl import DPOConfig, DPOTrainer

        return DPOTrainer, DPOConfig
    if name == "kto":
        from trl import KTOConfig, KTOTrainer

        return KTOTrainer, KTOConfig
    if name == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOTrainer, ORPOConfig
    raise ReprotuneError(f"objective.name: {name!r} is not one of {', '.join(OBJECTIVES)}")


@contextlib.contextmanager
def _checkpointing_as_set(model: Any, gradient_checkpointing_kwargs: dict | None = None) -> Iterator[None]:
    """What the reference forward runs under instead of TRL's disable_gradient_checkpointing: nothing changes."""
    yield


# bench/train_probe.py --trl-host-path sets it: TRL's use_adapter and the Trainer's FLOPs count as they are (the A/B
# of light_use_adapter and the cached count on the GPU)
TRL_HOST_PATH = False


def _tuner_layers(model: Any) -> list[Any]:
    """PEFT's adapter layers and wrappers of `model` (what its disable_adapter walks), found once per model."""
    cached = model.__dict__.get("_reprotune_tuner_layers")
    if cached is None:
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils.other import AuxiliaryTrainingWrapper

        cached = [m for m in model.modules() if isinstance(m, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
        model.__dict__["_reprotune_tuner_layers"] = cached
    return cached


def _switchable(layers: list[Any], adapter_name: str) -> bool:
    """Every layer is a plain adapter layer that holds `adapter_name` (no modules_to_save or token wrappers, whose
    set_adapter does more than choose the adapter)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return all(isinstance(m, BaseTunerLayer) and adapter_name in getattr(m, m.adapter_layer_names[0]) for m in layers)


def light_use_adapter(trl_use_adapter: Any) -> Any:
    """TRL's `use_adapter` (the reference forward's adapter switch) for a forward without gradients, minus PEFT's
    walks. PEFT's disable_adapter first builds the model's status (every module and parameter visited), then sets
    each layer's disabled flag and requires_grad on every adapter tensor, and again on the way back; set_adapter
    (TRL's 'ref' adapter) likewise. Measured on the H200 (8B LoRA DPO, 8 pairs a micro-step, `hardware.profile_steps`):
    ~50 ms of Python a micro-step while the GPU waits. Under no_grad requires_grad changes nothing the forward
    computes, so only what the layers' forwards read is switched (each layer's disabled flag, or its active adapter)
    and put back: the same numbers (tests/test_preference.py). With gradients on, or layers whose set_adapter does
    more, TRL's own."""
    @contextlib.contextmanager
    def use_adapter(model: Any, adapter_name: str | None) -> Iterator[None]:
        import torch

        layers = _tuner_layers(model)
        if torch.is_grad_enabled() or (adapter_name is not None and not _switchable(layers, adapter_name)):
            with trl_use_adapter(model, adapter_name):
                yield
            return
        attr, value = ("_disable_adapters", True) if adapter_name is None else ("_active_adapter", adapter_name)
        # PeftModel's own flag (has_active_enabled_adapter), as its disable_adapter sets it
        switched = [*layers, model] if adapter_name is None and hasattr(model, "_adapters_disabled") else layers
        names = [attr] * len(layers) + ["_adapters_disabled"] * (len(switched) - len(layers))
        before = [getattr(m, a) for m, a in zip(switched, names, strict=True)]
        for m, a in zip(switched, names, strict=True):
            setattr(m, a, value)
        try:
            yield
        finally:
            for m, a, kept in zip(switched, names, before, strict=True):
                setattr(m, a, kept)

    return use_adapter


def reference_keeps_checkpointing(base: type) -> type:
    """`base` (TRL's DPOTrainer or KTOTrainer) with its reference forward run under the checkpointing as set.

    TRL 1.16 turns checkpointing off for each reference forward (`torch.no_grad()` plus
    `disable_gradient_checkpointing`) and back on with `model.gradient_checkpointing_enable(args.
    gradient_checkpointing_kwargs)`. With transformers 5.24 that re-enable is not the setting train chose: it
    checkpoints every layer (`every_n_layers` is lost; with every_n_layers > 1 the key reaches torch's checkpoint
    and the second step fails) and, without `use_reentrant` in the kwargs, torch's reentrant checkpoint. Measured on
    the H200 (8B LoRA DPO, 2 pairs a micro-step): reentrant recompute plus walking every module twice a micro-step
    left the GPU idle two thirds of the time. Under no_grad a checkpointed layer saves nothing and runs as it would
    unchecked, so leaving the setting alone computes the same numbers (tested) and keeps the layers train chose.
    """
    module = sys.modules[base.__module__]
    if not hasattr(module, "disable_gradient_checkpointing"):  # ORPO: no reference forward
        return base

    class KeptCheckpointing(base):
        def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
            trl_toggle, trl_use_adapter = module.disable_gradient_checkpointing, module.use_adapter
            module.disable_gradient_checkpointing = _checkpointing_as_set
            if not TRL_HOST_PATH:
                module.use_adapter = light_use_adapter(trl_use_adapter)
            try:
                return super().compute_loss(*args, **kwargs)
            finally:
                module.disable_gradient_checkpointing, module.use_adapter = trl_toggle, trl_use_adapter

        def floating_point_ops(self, inputs: dict[str, Any]) -> int:
            """The Trainer's count (6 x tokens x parameters without the embeddings), the parameters counted once:
            the Trainer counts them again after every micro-step (~13 ms of Python on an 8B model, with the GPU
            waiting on the step's synchronisations). The count does not change during a run."""
            main = getattr(self.model, "main_input_name", "input_ids")
            if TRL_HOST_PATH or main not in inputs or not hasattr(self.model, "num_parameters"):
                return super().floating_point_ops(inputs)
            if "_reprotune_parameters" not in self.__dict__:
                self._reprotune_parameters = self.model.num_parameters(exclude_embeddings=True)
            return 6 * inputs[main].numel() * self._reprotune_parameters

    KeptCheckpointing.__name__ = KeptCheckpointing.__qualname__ = base.__name__
    return KeptCheckpointing


def sft_only_keys(config_class: type) -> set[str]:
    """SFTConfig's fields the objective's config does not have (packing, assistant_only_loss, ...)."""
    from trl import SFTConfig

    return {f.name for f in fields(SFTConfig)} - {f.name for f in fields(config_class)}


def objective_wins(train_keys: dict[str, Any], objective_keys: dict[str, Any]) -> list[str]:
    """The keys both groups set to different values, as `objective.k=v over train.k=w`: the objective's win
    (docs/configuration.md, "Which key wins"), and the run says so instead of dropping train/'s value silently."""
    return [f"objective.{k}={v} over train.{k}={train_keys[k]}" for k, v in objective_keys.items()
            if k in train_keys and train_keys[k] != v]


def preference_config(cfg: DictConfig, run: RunSettings, has_val: bool, obj: Objective, resolved: Run | None = None):
    """The objective's TRL config: train/ keys, then objective/ keys, then reprotune's guarantees (resolved: the
    stage's Run, guarantee_keys' default: plan's)."""
    _, config_class = trl_classes(obj.name)
    skip = sft_only_keys(config_class)
    keys = {k: v for k, v in passthrough_keys(cfg, "train").items() if k not in skip}
    own = library_keys(cfg, "objective")
    if won := objective_wins(keys, own):
        logging.getLogger("reprotune.train").info("%s: the objective's keys win (docs/configuration.md)", ", ".join(won))
    keys.update(own)
    keys.update(guarantee_keys(cfg, run, keys, has_val, resolved))
    keys["include_num_input_tokens_seen"] = "non_padding"  # padded pairs: counted without the padding
    if run.packing and run.device == "cuda":
        # the collator packs the next micro-batches on the host while the GPU runs this one (packed.packing_collator):
        # their copies from pinned memory must not wait for the GPU, which a blocking copy does
        keys["accelerator_config"] = {**dict(keys.get("accelerator_config") or {}), "non_blocking": True}
    if keys["activation_checkpointing"]:
        # torch's reentrant checkpoint unless train.activation_checkpointing_kwargs.use_reentrant says otherwise:
        # the same numbers, and faster than the non-reentrant one transformers defaults to (its saved-tensor hooks
        # cost host time, and a DPO step is bound by host time at this size; docs/measurements/
        # 2026-12-03-dpo-step-time-h200.md). Kept across the reference forward by
        # reference_keeps_checkpointing.
        keys["activation_checkpointing_kwargs"] = {"use_reentrant": True, **keys["activation_checkpointing_kwargs"]}
    if "activation_offloading" not in skip:  # DPO's and KTO's configs have TRL's offloading switch, ORPO's not
        keys["activation_offloading"] = run.activation_offloading
    elif run.activation_offloading:
        raise ReprotuneError(f"hardware.activation_offloading=true: TRL's {config_class.__name__} has no "
                             f"activation offloading (objective={obj.name}); leave it auto or false")
    return config_class(**keys)


# ------------------------------------------------------------------------------------- the starting adapter
def init_adapter_dir(cfg: DictConfig, resolved: Run) -> Path | None:
    """objective.init_adapter checked: an adapter directory of this base, not the one this run writes."""
    value = cfg.objective.get("init_adapter")
    if not value:
        return None
    path = Path(str(value))
    config = path / "adapter_config.json"
    if not config.is_file():
        raise ReprotuneError(f"{config}:0: objective.init_adapter: no adapter here (a directory written by "
                             "'make train', e.g. a copy of outputs/adapter)")
    if path.resolve() == resolved.path("adapter").resolve():
        raise ReprotuneError(f"{path}:0: objective.init_adapter: is this run's own output ({resolved.paths['adapter']}: a "
                             f"rerun would start from it); name the SFT adapter (outputs/adapter) or a copy of this one")
    from reprotune.models import base_identity

    recorded = json.loads(config.read_text()).get("base_model_name_or_path")
    expected = base_identity(cfg.model)[0]
    if recorded != expected:
        raise ReprotuneError(f"{config}:0: base_model_name_or_path: the adapter was trained on {recorded!r}, "
                             f"this run's base is {expected!r} (model={cfg.model.name})")
    return path


def with_init_adapter(model: Any, path: Path | None) -> Any:
    """The base model with the starting adapter loaded trainable (PEFT), or the base as it is."""
    if path is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(path), is_trainable=True)


def reference(cfg: DictConfig, obj: Objective) -> str:
    """What the implicit reward (GRPO: the KL term) is measured against, in words for the manifest and the log."""
    if obj.rl:  # TRL's GRPOTrainer adds the frozen "ref" copy of a loaded adapter only when beta != 0
        if not cfg.objective.get("beta"):
            return "none (beta 0: no KL term)"
        return "init_adapter (a frozen copy of it, TRL's 'ref' adapter)" if cfg.objective.get("init_adapter") \
            else "base (the adapter disabled)"
    if not obj.reference:
        return f"none ({obj.name.upper()} has no reference model)"
    if cfg.objective.get("init_adapter"):
        return "init_adapter (a frozen copy of it, TRL's 'ref' adapter)"
    return "base (the adapter disabled)"


def objective_record(cfg: DictConfig, resolved: Run) -> dict[str, Any]:
    """The manifest's objective: name, reference, beta, loss, the starting adapter by sha256 (relative to the
    Run's paths.root)."""
    from reprotune import manifest as mf

    obj, root = resolved.objective, resolved.path("root")
    init = init_adapter_dir(cfg, resolved)
    loss = cfg.objective.get("loss_type")
    return {"name": obj.name, "reference": reference(cfg, obj), "beta": cfg.objective.get("beta"),
            "loss_type": OmegaConf.to_container(loss) if OmegaConf.is_config(loss) else loss,
            "init_adapter": mf.path_record(init, root) if init else None}


# ------------------------------------------------------------------------------------------- token counts
def completion_tokens(dataset: Any) -> int:
    """Tokens the loss is computed on (chosen + rejected, or the KTO completion) in a tokenized dataset."""
    columns = [c for c in ("chosen_ids", "rejected_ids", "completion_ids", "chosen_labels", "rejected_labels")
               if c in dataset.column_names]
    return sum(sum(1 for t in ids if t != -100) for c in columns for ids in dataset[c])


def sequence_tokens(dataset: Any) -> int:
    """Tokens run through the policy: each pair is two sequences (prompt + chosen, prompt + rejected)."""
    names = dataset.column_names
    if "prompt_ids" in names and "chosen_ids" in names:
        return sum(2 * len(p) + len(c) + len(r) for p, c, r in
                   zip(dataset["prompt_ids"], dataset["chosen_ids"], dataset["rejected_ids"], strict=True))
    if "prompt_ids" in names and "completion_ids" in names:
        return sum(len(p) + len(c) for p, c in zip(dataset["prompt_ids"], dataset["completion_ids"], strict=True))
    return sum(len(ids) for c in ("chosen_input_ids", "rejected_input_ids") if c in names for ids in dataset[c])


# ------------------------------------------------------------------------------------------------- the rows
def read_pairs(path: Path, objective: str) -> list[dict[str, Any]]:
    """The prepared rows a preference trainer reads; one line when the file holds the wrong kind."""
    rows = []
    for line, row in iter_jsonl(path, f"run 'make prepare ARGS=\"objective={objective}\"' first"):
        if not isinstance(row, dict) or "prompt" not in row:
            kind = "SFT conversations" if isinstance(row, dict) and "messages" in row else "no preference row"
            raise ReprotuneError(f"{path}:{line}: prompt: holds {kind}; prepare preference data with "
                                 f"'make prepare ARGS=\"objective={objective} data.path=...\"'")
        if objective != "kto" and "chosen" not in row:
            raise ReprotuneError(f"{path}:{line}: chosen: unpaired (KTO) data; objective={objective} needs pairs "
                                 "(prompt, chosen, rejected); use objective=kto")
        rows.append(row)
    if not rows:
        raise ReprotuneError(f"{path}:1: file: holds no pairs")
    if any("tools" in row for row in rows):  # Dataset.from_list takes its columns from the first row
        rows = [{**row, "tools": row.get("tools")} for row in rows]
    return rows
