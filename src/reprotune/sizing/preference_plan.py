"""How a preference objective's micro-batches are modelled by the plan (reprotune.sizing.decide): packed pairs
(DPO, ORPO) and KTO's packed rows as one row each, padded batches as TRL 1.16's trainers build them, and the plan's
line saying which.

Pure: the config, the run's objective (reprotune.run.Run.objective) and the data's shape; no torch."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omegaconf import DictConfig

from reprotune.objectives import Objective
from reprotune.run import Run
from reprotune.run_settings import Settings
from reprotune.sizing.shape import DataShape, load_data_shape


def pair_row_tokens(cfg: DictConfig, obj: Objective, data: DataShape | None | str = "prepared",
                    resolved: Run | None = None) -> int:
    """The longest packed pair (KTO: example): from the prepared pairs (the Run's paths.prepared; default: plan's),
    else its bound (a prompt and two answers, each sequence at most data.max_length: 2 * max_length; a KTO example:
    max_length)."""
    data = load_data_shape(cfg, padded=False, resolved=resolved) if data == "prepared" else data
    paired = obj.paired
    return data.max_tokens if data else (2 if paired else 1) * int(cfg.train.max_length)


def padded_batch(cfg: DictConfig, obj: Objective) -> dict[str, Any]:
    """What a micro-batch of a padded preference objective runs, from TRL 1.16's trainers (trl/trainer/dpo_trainer.py
    DataCollatorForPreference and _compute_loss, trl/experimental/orpo/orpo_trainer.py concatenated_forward,
    trl/trainer/kto_trainer.py _compute_loss and _compute_kl_logps), as the memory model's Settings fields:
    - DPO: 2B rows (prompt + chosen, prompt + rejected) padded to the longest, the policy's forward with gradients,
      then the reference's over the same rows under torch.no_grad (none with precompute_ref_log_probs);
    - ORPO: the same 2B rows, no reference; the model returns the logits of every position (no fused LM head);
    - KTO: B rows (a prompt and its completion) with gradients; its KL batch (B rows of a prompt and the previous
      example's completion, loss_type kto) goes through the policy under torch.no_grad, before its forward, and
      through the reference, after it; the reference forward of the B rows under torch.no_grad."""
    conf = cfg.objective
    return {"sequences": 2 if obj.paired else 1,
            "reference": obj.reference and not conf.get("precompute_ref_log_probs", False),
            "kl_rows": obj.kl_batch and str(conf.get("loss_type", "kto")) != "apo_zero_unpaired",
            "full_logits": obj.full_logits}


def padded_reason(obj: Objective, s: Settings, data: DataShape | None) -> str:
    """The plan's line for a padded preference run (its settings as fitted)."""
    b, longest = s.batch_size, s.max_length if data is None else min(data.max_tokens, s.max_length)
    where = "the prepared rows' longest sequence" if data else "max_length: no prepared rows"
    if s.sequences == 2:
        rows = (f"2B rows (B = {b} pairs: {2 * b} rows, prompt + chosen and prompt + rejected) of the longest "
                f"sequence ({longest} tokens, {where})")
    else:
        rows = f"B rows (B = {b}: a prompt and its completion) of the longest sequence ({longest} tokens, {where})"
    extra = []
    if s.reference:
        extra.append("the reference forward over them without gradients (no saved activations, a transient)")
    elif obj.reference:
        extra.append("no reference forward (precompute_ref_log_probs)")
    else:
        extra.append("no reference")
    if s.kl_rows:
        extra.append(f"the KL batch ({b} mismatched prompt/completion rows) through the policy"
                     f"{' and the reference' if s.reference else ''} without gradients")
    if s.full_logits:
        extra.append("the logits of every position (TRL's ORPO has no fused LM head)")
    return (f"padded pairs: {obj.name} modelled as {rows} with gradients; {'; '.join(extra)}; "
            "held to one H200 run each of 8B LoRA ORPO and KTO (conf/plan/calibration.json)")


def packed_reasons(cfg: DictConfig, obj: Objective, data: DataShape | None) -> tuple[list[str], DataShape | None]:
    """The plan's line for packed pairs (KTO: packed rows), and the data shape the memory model uses for them
    (ORPO's fused LM head scores the whole chosen sequence: its share of the packed tokens bounded by all)."""
    tokens = pair_row_tokens(cfg, obj, data)
    if obj.paired and obj.reference:  # DPO
        return [f"plan: a pair is one packed row of up to {tokens} tokens (the prompt once, both answers); the "
                "reference forward runs without gradients"], data
    if obj.paired:  # ORPO
        return [f"plan: a pair is one packed row of up to {tokens} tokens (the prompt once, both answers), every "
                "token scored by the fused LM head (the chosen NLL); no reference"], (
            replace(data, assistant_share=1.0) if data else data)
    return [f"plan: an example is one packed row of up to {tokens} tokens; the KL batch and the reference forwards "
            "run without gradients"], data
