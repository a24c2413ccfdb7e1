"""Preference tuning (DPO, ORPO, KTO): the objectives' trainers and configs (`trainers`), the preference data
formats (`formats`), their preparation into train/holdout pairs (`pairs`) and the built-in task's pairs
(reprotune.invoices.wrong_extraction). docs/preference.md says how to use it.

A preference run has its own inputs and outputs, so that it and the SFT run it starts from are both versioned
(dvc.yaml's stages prepare_pairs, train_pref, eval_pref, merge_pref, gguf_pref): conf/objective/{dpo,orpo,kto}.yaml
compose conf/objective/paths/preference.yaml over paths/, so paths.prepared is paths.pairs and the adapter, train,
eval, checkpoint and export folders (merged, gguf, export) are under paths.pref in the config every stage gets."""

from __future__ import annotations

from reprotune.objectives import OBJECTIVES

# the registry's sets, by name (reprotune.objectives says what each property means)
WITH_REFERENCE = tuple(n for n, o in OBJECTIVES.items() if o.reference)
PACKED_OBJECTIVES = tuple(n for n, o in OBJECTIVES.items() if o.packs)
PAIRED_OBJECTIVES = tuple(n for n, o in OBJECTIVES.items() if o.paired)
# next to the prepared pairs' train.jsonl: each training pair's packed tokens in its order (make prepare writes it,
# the plan reads it: reprotune.sizing.draws)
PAIR_LENGTHS_FILE = "train_lengths.json"
