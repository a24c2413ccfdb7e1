"""Merge stage: fold the LoRA adapter into its base model and prove the merge changed nothing.

    python -m reprotune.merge [hydra overrides]      # == make merge ARGS="..."
    python -m reprotune.merge objective=dpo          # == make merge ARGS="objective=dpo" (DVC stage merge_pref)

Reads  the base model (reprotune.models.resolve_model_dir), outputs/adapter/ (PEFT adapter, tokenizer and
       the inference chat template) and data/prepared/holdout.jsonl.
Writes outputs/merged/ (safetensors in export.dtype, config, generation config, tokenizer, chat template,
       parity.json) and outputs/export/merge_manifest.json (provenance and timings).
With a preference objective (its paths: conf/objective/paths/preference.yaml): outputs/pref/adapter and data/pairs/holdout.jsonl
(each row's prompt + chosen answer) in, outputs/pref/merged and outputs/pref/export/merge_manifest.json out. The
preference adapter is one whole adapter (started from the SFT adapter, its weights trained further; TRL's frozen
'ref' copy is never saved), so base + it is the model the preference run trained and eval_pref scored.

A QLoRA adapter is merged into the full-precision base, never into 4-bit weights: the 4-bit base only
existed to save memory during training, and dequantised NF4 weights merged with a LoRA delta would bake
the quantisation error into every exported weight.

Parity: logits of base + adapter (PEFT, unmerged, float32) are compared on a few holdout conversations
with (1) the float32 merge in memory, which must agree to export.merge.fp32_atol, and (2) the model as saved
(cast to export.dtype, reloaded from disk), whose argmax token must agree at export.merge.min_top1_agreement
of the positions; the numbers go to outputs/merged/parity.json.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from reprotune.config import CONF_DIR, quantization
from reprotune.errors import ReprotuneError, needs_bytes, tensor_bytes, user_errors
from reprotune.io import read_conversations, swap_dir, tmp_path
from reprotune.models import load_float32, load_tokenizer, resolve_model_dir, save_tokenizer
from reprotune.preference.pair_eval import export_conversations
from reprotune.run import Run, resolve

log = logging.getLogger("reprotune.merge")


# ------------------------------------------------------------------------------------------------ inputs
def read_holdout(run: Run) -> list[list[dict[str, str]]] | list[str]:
    """Holdout conversations (lists of messages) of the Run's paths.prepared, in file order; a preference holdout's
    rows as prompt + chosen answer (text rows: their text)."""
    path = run.path("prepared") / "holdout.jsonl"
    if run.objective.preference:
        return export_conversations(path)
    return read_conversations(path, "run 'make prepare' first")


def check_adapter(adapter_dir: Path, model_cfg: Any, make_train: str = "make train") -> None:
    """The adapter is complete and was trained on the configured base (its recorded identity, not assumed)."""
    from reprotune.models import base_identity

    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"):
        if not (adapter_dir / name).is_file():
            raise ReprotuneError(f"{adapter_dir / name}: file: not found; run '{make_train}' first")
    recorded = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    expected = base_identity(model_cfg)[0]
    if recorded != expected:
        raise ReprotuneError(f"{adapter_dir}/adapter_config.json: base_model_name_or_path: the adapter was "
                             f"trained on {recorded}, but model= is {expected}")


def save_dtype(cfg: DictConfig, model_dir: str) -> str:
    if cfg.export.dtype != "auto":
        return str(cfg.export.dtype)
    config = json.loads((Path(model_dir) / "config.json").read_text()) if Path(model_dir).is_dir() else {}
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


# ------------------------------------------------------------------------------------------------ models
def parity_batches(tokenizer, conversations: list[list[dict]] | list[str]) -> list[Any]:
    """Each whole conversation (prompt and answer) rendered with the inference chat template; a text row (a
    standard preference pair) tokenized as it is."""
    return [tokenizer(c, return_tensors="pt")["input_ids"] if isinstance(c, str) else
            tokenizer.apply_chat_template(c, tokenize=True, return_tensors="pt", return_dict=True)["input_ids"]
            for c in conversations]


def logits_of(model, batches: list[Any]) -> list[Any]:
    import torch

    with torch.no_grad():
        return [model(input_ids=ids).logits.float() for ids in batches]


def compare_logits(reference: list[Any], candidate: list[Any]) -> dict[str, float]:
    import torch

    diffs = torch.cat([(r - c).abs().flatten() for r, c in zip(reference, candidate, strict=True)])
    same = torch.cat([(r.argmax(-1) == c.argmax(-1)).flatten() for r, c in zip(reference, candidate, strict=True)])
    return {"max_abs_diff": float(diffs.max()), "mean_abs_diff": float(diffs.mean()),
            "top1_agreement": float(same.float().mean()), "positions": int(same.numel())}


# ------------------------------------------------------------------------------------------------ output
def write_generation_config(model, tokenizer, out: Path) -> None:
    """generation_config.json whose eos ids include the chat template's end-of-turn token."""
    gen = model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    eos = [e for e in eos if e is not None]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    gen.save_pretrained(out)


# -------------------------------------------------------------------------------------------------- steps
def merge_in_float32(cfg: DictConfig, model_dir: str, adapter_dir: Path, batches: list) -> tuple[Any, Any, dict, dict]:
    """(the float32 merge, base + adapter's logits, the adapter's effect on them, the merge's difference from
    them): the merge is refused when it moves the logits by more than export.merge.fp32_atol."""
    from peft import PeftModel

    log.info("loading %s in float32 + adapter %s", model_dir, adapter_dir)
    peft_model = PeftModel.from_pretrained(load_float32(model_dir, cfg.model), adapter_dir).eval()
    reference = logits_of(peft_model, batches)
    with peft_model.disable_adapter():  # how far the adapter moves the base: the scale of a wrong merge
        adapter_effect = compare_logits(reference, logits_of(peft_model, batches))
    merged = peft_model.merge_and_unload()
    fp32 = compare_logits(reference, logits_of(merged, batches))
    if fp32["max_abs_diff"] > float(cfg.export.merge.fp32_atol):
        raise ReprotuneError(f"export.merge.fp32_atol: merged logits differ from base + adapter by "
                             f"{fp32['max_abs_diff']:.3g} (> {cfg.export.merge.fp32_atol}); the merge is wrong")
    return merged, reference, adapter_effect, fp32


def save_merged(merged: Any, tokenizer: Any, dtype: str, tmp: Path) -> None:
    """The merged model in export.dtype, its tokenizer, chat template and generation config, into tmp."""
    import torch

    shutil.rmtree(tmp, ignore_errors=True)
    merged.to(getattr(torch, dtype))
    with needs_bytes(tensor_bytes(merged.state_dict().values())):  # a full disk says how much the model needed
        merged.save_pretrained(tmp)
    save_tokenizer(tokenizer, tmp)  # tokenizer.json, tokenizer_config.json and chat_template.jinja
    write_generation_config(merged, tokenizer, tmp)


def check_saved(cfg: DictConfig, tmp: Path, reference: Any, batches: list, dtype: str, n_conversations: int,
                adapter_effect: dict, fp32: dict) -> dict[str, Any]:
    """parity.json: what ships is the saved file, so that (reloaded, upcast to float32) is compared with base +
    adapter; below export.merge.min_top1_agreement the saved model is removed and the stage fails."""
    from reprotune import manifest as mf

    saved_model = load_float32(tmp)
    saved = compare_logits(reference, logits_of(saved_model, batches))
    del saved_model
    min_top1 = float(cfg.export.merge.min_top1_agreement)
    parity = {
        "holdout_conversations": n_conversations,
        "reference": "base (float32, unquantised) + PEFT adapter, unmerged",
        "adapter_effect": {"max_abs_diff": adapter_effect["max_abs_diff"],
                           "top1_agreement": adapter_effect["top1_agreement"]},  # base alone vs base + adapter
        "fp32_merge": {**fp32, "tolerance_max_abs_diff": float(cfg.export.merge.fp32_atol), "passed": True},
        "saved": {**saved, "dtype": dtype, "min_top1_agreement": min_top1,
                  "passed": saved["top1_agreement"] >= min_top1},
        "qlora_merged_into_full_precision": bool(quantization(cfg)),
    }
    mf.write_json(tmp / "parity.json", parity)
    if not parity["saved"]["passed"]:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ReprotuneError(f"export.merge.min_top1_agreement: the {dtype} merged model picks the same next token "
                             f"as base + adapter at only {saved['top1_agreement']:.3f} of positions (< {min_top1}); "
                             "try export.dtype=float32")
    return parity


def merge_record(cfg: DictConfig, resolved: Run, adapter_dir: Path, model_dir: str, parity: dict[str, Any],
                 timing: dict[str, float]) -> dict[str, Any]:
    """outputs/export/merge_manifest.json: provenance, inputs and output by sha256, parity, timings."""
    from reprotune import manifest as mf

    root = resolved.path("root")
    manifest_path = resolved.path("export_dir") / "merge_manifest.json"
    record = mf.stage_record("merge", cfg, manifest_path, root, **{
        "seeds": mf.seeds_record(cfg, resolved),
        "inputs": {"adapter": mf.path_record(adapter_dir, root),
                   "holdout": mf.path_record(resolved.path("prepared") / "holdout.jsonl", root),
                   "base_model": mf.base_model_record(model_dir, files=False)},
        "outputs": {"merged": mf.path_record(resolved.path("merged"), root)},
        "parity": parity,
        "timing": timing,
    })
    mf.write_json(manifest_path, record)
    return record


# -------------------------------------------------------------------------------------------------- main
def merge(cfg: DictConfig, resolved: Run | None = None) -> dict[str, Any]:
    """resolved: the stage's Run (main resolves it first; a caller without one: resolve(cfg, "merge"))."""
    import torch

    from reprotune import kernels

    kernels.route_matmul_as_pinned()

    started = time.time()
    resolved = resolved if resolved is not None else resolve(cfg, "merge")
    adapter_dir = resolved.path("adapter")
    check_adapter(adapter_dir, cfg.model, f"make train{resolved.objective.make_args}")
    conversations = read_holdout(resolved)[: int(cfg.export.merge.prompts)]
    model_dir = resolve_model_dir(cfg.model, resolved.paths["model_cache"])
    dtype = save_dtype(cfg, model_dir)
    torch.manual_seed(int(cfg.seed))

    # the adapter dir holds the tokenizer and the chat template the model was trained and evaluated with
    tokenizer = load_tokenizer(adapter_dir)
    batches = parity_batches(tokenizer, conversations)
    t0 = time.time()
    merged, reference, adapter_effect, fp32 = merge_in_float32(cfg, model_dir, adapter_dir, batches)
    merge_seconds = time.time() - t0

    final = resolved.path("merged")
    tmp = tmp_path(final)
    t0 = time.time()
    save_merged(merged, tokenizer, dtype, tmp)
    save_seconds = time.time() - t0
    del merged
    parity = check_saved(cfg, tmp, reference, batches, dtype, len(conversations), adapter_effect, fp32)
    swap_dir(tmp, final)

    record = merge_record(cfg, resolved, adapter_dir, model_dir, parity, {
        "merge_seconds": round(merge_seconds, 2), "save_seconds": round(save_seconds, 2),
        "wall_seconds": round(time.time() - started, 2)})
    saved = parity["saved"]
    log.info("merged -> %s (%s); fp32 max |Δlogit| %.2e; saved %s: max |Δlogit| %.3f, top-1 agreement %.4f",
             final, dtype, fp32["max_abs_diff"], dtype, saved["max_abs_diff"], saved["top1_agreement"])
    return record


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors():
        run = resolve(cfg, "merge")
        merge(cfg, run)


if __name__ == "__main__":
    main()
