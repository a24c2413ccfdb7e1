"""The training objectives as values: what each one is, in one registry, so that code asks the objective
(`run.objective.paired`: the one reprotune.run.resolve picked) instead of branching on its name. Adding an
objective is a conf/objective/<name>.yaml, an entry here (its properties) and its TRL classes
(reprotune.preference.trainers.trl_classes; GRPO's: reprotune.rl.trainer).

Pure: imports only reprotune.schema (the names)."""

from __future__ import annotations

from dataclasses import dataclass

from reprotune import schema


@dataclass(frozen=True)
class Objective:
    name: str
    preference: bool = False    # trains on preference data: the preference chain (params_pref.yaml, data/pairs)
    paired: bool = False        # an example is a prompt and two answers (chosen, rejected); else one sequence
    reference: bool = False     # a reference model's forward (the implicit reward is log pi/pi_ref)
    kl_batch: bool = False      # KTO's KL batch: mismatched (prompt, completion) rows without gradients
    full_logits: bool = False   # TRL's padded trainer returns the logits of every position (no fused LM head)
    packs_on_cpu: bool = False  # train.packing=auto packs it off the GPU too (the same result, measured faster)
    packed_reason: str = ""     # the run's reason line when its examples are packed (reprotune.preference.packed)
    rl: bool = False            # online RL (reprotune.rl): samples completions of prepared prompts, rewards score them

    @property
    def from_adapter(self) -> bool:
        """Starts from objective.init_adapter (the SFT adapter by default): the preference and RL objectives."""
        return self.preference or self.rl

    @property
    def packs(self) -> bool:
        """reprotune.preference.packed runs it on packed rows (DPO's and ORPO's pairs with the prompt once, KTO's
        rows each a document)."""
        return self.preference

    @property
    def unit(self) -> str:
        return "pairs" if self.paired else "rows"

    @property
    def make_args(self) -> str:
        """What a `make <stage>` hint adds to rerun this objective's chain (the SFT chain's is the default)."""
        return f' ARGS="objective={self.name}"' if self.from_adapter else ""


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("sft"),
    Objective("dpo", preference=True, paired=True, reference=True, packs_on_cpu=True,
              packed_reason="pairs packed: no padding, each prompt computed once (reprotune.preference.packed)"),
    Objective("orpo", preference=True, paired=True, full_logits=True,
              packed_reason="orpo pairs packed: no padding, each prompt computed once, the chosen sequence scored "
                            "whole through TRL's fused LM head (reprotune.preference.packed)"),
    Objective("kto", preference=True, reference=True, kl_batch=True,
              packed_reason="kto rows packed: no padding, each row one document (reprotune.preference.packed)"),
    Objective("grpo", rl=True),
)}
assert tuple(OBJECTIVES) == schema.OBJECTIVES, "reprotune.schema.OBJECTIVES names these"
