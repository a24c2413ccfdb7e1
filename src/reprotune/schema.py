"""The settings whose values are a fixed set, in one table, checked at the door.

`CHOICES` names every enumerated key of conf/ and the values it takes; `problems(cfg)` returns one line per key
whose value is not one of them ("hardware.norm_kernel: 'ligr' is not one of auto, liger, torch"). It runs before a
stage or `make plan` reads the config: from `config.compose_checked` (every `make <stage>`, before params.yaml
changes) and from the Hydra callback `config.CheckSettings` that conf/config.yaml and every params file declare
(every `python -m reprotune.<stage>`, DVC's runs included). The modules that act on a key take its values from
here (runtime.REPRO_MODES, kernels.MODES, ...), so a new value is added in one place.

A pure module: no reprotune import, and nothing at all imported until `problems` runs (reprotune.kernels, which
runs before torch loads, reads its lists); the package's lowest layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from omegaconf import DictConfig


@dataclass(frozen=True)
class Choice:
    """The values a key takes: `values`, and where `number` is set, any number of that type >= `minimum`.
    `null` (YAML's null) is taken as auto where the code has always read it so."""
    values: tuple[Any, ...]
    number: type | None = None
    minimum: float = 0
    null: bool = False

    def allows(self, value: Any) -> bool:
        if value is None:
            return self.null
        if isinstance(value, bool):  # True == 1: a bool is one of the values, never a number
            return any(v is value for v in self.values)
        if any(type(v) is type(value) and v == value for v in self.values):
            return True
        if self.number is int:
            return isinstance(value, int) and value >= self.minimum
        if self.number is float:
            return isinstance(value, int | float) and value > self.minimum
        return False

    def describe(self) -> str:
        names = [str(v).lower() if isinstance(v, bool) else str(v) for v in self.values]
        if self.number is int:
            names.append(f"an integer >= {int(self.minimum)}")
        elif self.number is float:
            names.append(f"a number > {self.minimum:g}")
        return ", ".join(names)


AUTO_ON_OFF = Choice(("auto", True, False), null=True)
REPRO_MODES = ("default", "strict", "fast")
CPU_KERNEL_MODES = ("pinned", "native")
NORM_KERNELS = ("liger", "torch")
DISTRIBUTED = ("ddp", "fsdp2")
METHODS = ("lora", "qlora", "dora")
# the objectives (conf/objective/*.yaml): SFT, then the preference ones (reprotune.preference), then online RL
# (reprotune.rl)
SFT = "sft"
PREFERENCE_OBJECTIVES = ("dpo", "orpo", "kto")
RL_OBJECTIVES = ("grpo",)
OBJECTIVES = (SFT, *PREFERENCE_OBJECTIVES, *RL_OBJECTIVES)
# transformers' own attention implementations, and reprotune's registered kernels (runtime.attention)
ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "varlen_attention",
             "pair_varlen", "pair_dense")
DATA_FORMATS = ("chat", "chat_json", "sharegpt", "alpaca", "prompt_completion")
TASK_TYPES = ("auto", "json", "text")

CHOICES: dict[str, Choice] = {
    "repro": Choice(REPRO_MODES),
    "hardware.device": Choice(("auto", "cpu", "cuda")),
    "hardware.dtype": Choice(("auto", "float32", "bfloat16", "float16")),
    "hardware.gradient_checkpointing": AUTO_ON_OFF,
    "hardware.memory_budget_gib": Choice(("auto",), number=float, null=True),
    "hardware.fast_path": AUTO_ON_OFF,
    "hardware.attn_implementation": Choice(("auto", *ATTENTION), null=True),
    "hardware.liger_kernel": AUTO_ON_OFF,
    "hardware.norm_kernel": Choice(("auto", *NORM_KERNELS), null=True),
    "hardware.fused_lora": AUTO_ON_OFF,
    "hardware.activation_offloading": AUTO_ON_OFF,
    "hardware.offload_layers": Choice(("auto",), number=int, minimum=1, null=True),
    "hardware.host_memory_budget_gib": Choice(("auto",), number=float, null=True),
    "hardware.tiled_mlp": AUTO_ON_OFF,
    "hardware.embedding_on_host": AUTO_ON_OFF,
    "hardware.dataloader_workers": Choice(("auto",), number=int, null=True),
    "hardware.cpu_kernels": Choice(CPU_KERNEL_MODES),
    "hardware.distributed": Choice(("auto", *DISTRIBUTED), null=True),
    "method.name": Choice(METHODS),
    "objective.name": Choice(OBJECTIVES),
    "model.source": Choice(("builtin", "random_init", "hub", "local")),
    "train.packing": AUTO_ON_OFF,
    "train.run.resume": Choice(("auto", "never")),
    "data.format": Choice(("auto", *DATA_FORMATS)),
    "data.extra_keys": Choice(("drop", "error")),
    "data.on_invalid": Choice(("error", "skip")),
    "data.overlong": Choice(("drop", "truncate")),
    "data.preference.ties": Choice(("drop", "keep")),
    "data.task.type": Choice(TASK_TYPES),
    "eval.batch_size": Choice(("auto",), number=int, minimum=1),
    "eval.max_new_tokens": Choice(("auto",), number=int, minimum=1),
    "export.dtype": Choice(("auto", "bfloat16", "float16", "float32")),
    "export.outtype": Choice(("f16", "bf16", "f32")),
    "export.publish.what": Choice(("adapter", "merged")),
}
_ABSENT = object()


def problems(cfg: DictConfig) -> list[str]:
    """One line per enumerated key whose value is not one it takes (a key the config lacks is not checked: a
    user's data has no data.task, say)."""
    from omegaconf import OmegaConf  # here: reprotune.kernels reads the lists above before anything loads

    found = []
    for key, choice in CHOICES.items():
        value = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_resolution_failure=False)
        if value is _ABSENT or choice.allows(value):
            continue
        found.append(f"{key}: {value!r} is not one of {choice.describe()}")
    return found
