"""Model families that reprotune treats alike, by transformers' model_type: one table, read by the planner
(reprotune.sizing.decide: which norm kernel, whether the input embedding can stay on the host) and by the train
stage (which RMSNorm classes it patches). Pure: no project import."""

from __future__ import annotations

# The Llama-style families and their RMSNorm class: the norm is weight * x / rms (torch's fused rms_norm as it is)
# and the input embedding a plain torch.nn.Embedding (a lookup the host can do). Gemma's norm is
# (1 + weight) * x / rms and its embedding scales its output: neither holds, so Gemma is not here.
LLAMA_STYLE: dict[str, str] = {"llama": "LlamaRMSNorm", "mistral": "MistralRMSNorm", "qwen2": "Qwen2RMSNorm",
                               "qwen3": "Qwen3RMSNorm"}
