"""The plan: parameters, predicted memory by part, the pick on each card, steps, time and cost, warnings, as JSON
(outputs/plan.json) and as text. The pick is reprotune.sizing.decide's, the one make train's preflight takes.
No torch."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig

from reprotune.config import CONF_DIR
from reprotune.run import Run, resolve
from reprotune.run_settings import RunSettings, Settings
from reprotune.sizing.calibration import measured_run
from reprotune.sizing.decide import (
    Hardware,
    card,
    configured_batch,
    configured_settings,
    decide,
    preference_padded_on,
)
from reprotune.sizing.draws import run_keys
from reprotune.sizing.fit import both_budgets, checkpointing_words, describe, overrides_for
from reprotune.sizing.memory import GIB, memory, weight_bytes
from reprotune.sizing.shape import (
    BUILTIN_TOKENIZER_VOCAB,
    DataShape,
    Shape,
    count_params,
    load_data_shape,
    load_tables,
    model_shape,
)
from reprotune.sizing.throughput import steps_and_tokens, tokens_per_second

SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def warnings_for(cfg: DictConfig, resolved: Run, s: Settings, data: DataShape | None,
                 run: dict[str, Any]) -> list[str]:
    out, obj = [], resolved.objective
    model = cfg.model
    local = bool(model.path) and Path(str(model.path)).is_dir()
    if model.source == "hub" and not local and not SHA_RE.match(str(model.revision or "")):
        out.append(f"model.revision={model.revision}: the hub model {model.path} is not pinned to a commit; a new "
                   "upload changes your run (set model.revision=<40-hex sha>)")
    if model.get("gated") and not local and not (os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")):
        out.append(f"{model.path} is gated and HF_TOKEN is not set in the environment: the download will fail")
    builtin_tokenizer = model.source == "random_init" and not model.random_init.get("tokenizer_dir")
    vocab = model_shape(model).vocab
    if builtin_tokenizer and vocab < BUILTIN_TOKENIZER_VOCAB:  # what make train's vocabulary check will stop on
        out.append(f"model '{model.name}': the built-in tokenizer has {BUILTIN_TOKENIZER_VOCAB:,} ids but the model's "
                   f"vocab_size is {vocab:,}: make train stops (give it a tokenizer of at most {vocab:,} ids)")
    if data is None:
        if obj.preference:  # a preference run's rows are in paths.pairs
            out.append(f"{resolved.paths['pairs']}: no prepared pairs (run make prepare ARGS=\"objective="
                       f"{cfg.objective.name}\"); memory assumes the longest rows max_length allows, and no time or cost "
                       "without token counts")
            return out
        out.append(f"{resolved.paths['prepared']}: no prepared data (run make prepare); memory assumes full-length "
                   "examples, and no time or cost without token counts")
        return out
    if data.overlong:
        out.append(f"{data.overlong} example(s) were over data.max_length {data.prepared_max_length} when prepared "
                   f"({cfg.data.overlong}: see {data.source}/report.json)")
    if data.prepared_max_length is not None and int(data.prepared_max_length) != int(cfg.data.max_length):
        out.append(f"data was prepared with max_length {data.prepared_max_length}, the config says "
                   f"{cfg.data.max_length}: re-run make prepare")
    if data.max_tokens > s.max_length:
        out.append(f"the longest example ({data.max_tokens} tokens) is over train.max_length {s.max_length}: "
                   "TRL truncates it")
    if data.tokenizer_model and tokenizer_id(data.tokenizer_model) != tokenizer_id(str(model.name)):
        out.append(f"token counts come from {data.tokenizer_model}'s tokenizer (prepared for it), not {model.name}'s: "
                   "re-run make prepare with this model for exact counts")
    if run and run["epochs"] > 1.0 and run_keys(cfg)["max_steps"] > 0:
        where = "objective" if cfg.objective.get("max_steps") is not None else "train"
        out.append(f"{where}.max_steps={run_keys(cfg)['max_steps']} passes over the {data.examples} examples "
                   f"{run['epochs']:.1f} times: the dataset is small for this step count (overfitting risk)")
    if data.examples < s.batch_size * s.grad_accum:
        out.append(f"{data.examples} examples are fewer than one optimizer step's batch "
                   f"({s.batch_size} x {s.grad_accum})")
    return out


def tokenizer_id(preset: str) -> str:
    """Presets that share a tokenizer (the random shapes use the built-in SmolLM2 one) share token counts."""
    path = CONF_DIR / "model" / f"{preset}.yaml"
    if not path.is_file():
        return preset
    model = yaml.safe_load(path.read_text())
    builtin = model.get("builtin") or (model.get("random_init") or {}).get("tokenizer_from_builtin")
    return f"builtin:{builtin['sha256']}" if builtin else str(model.get("path") or preset)


def time_and_cost(cfg: DictConfig, resolved: Run, shape: Shape, base: Settings, data: DataShape | None,
                  tables: dict[str, Any]) -> list[dict[str, Any]]:
    """Per GPU class in the price table: what make train would run there (or, where that does not fit, the setting
    its preflight suggests), tokens/s, time per epoch and run, cost."""
    prices = tables["prices"]
    # the global batch, and so the steps, is the same in every setting
    run = steps_and_tokens(base, data, cfg, resolved.objective)
    rows = []
    for gpu in prices["gpus"]:
        decided = decide(cfg, card(gpu), shape, data, resolved)
        cand = decided.planned if decided.fits else decided.fallback
        row: dict[str, Any] = {"gpu": gpu, "fits": cand is not None, "as_configured": decided.fits}
        if cand and run:
            tps, how = tokens_per_second(shape, cand, data, gpu, tables)
            seen = measured_run(str(cfg.model.name), cand, data) if gpu == "H200" else None
            if seen:
                tps, how = seen["measured"]["tokens_per_second"], f"measured: {seen['name']} (conf/plan/calibration.json)"
            hours = run["tokens_trained"] / tps / 3600
            row.update({"setting": describe(cand), "tokens_per_second": round(tps), "throughput_source": how,
                        "epoch_hours": round(run["tokens_per_epoch"] / tps / 3600, 3), "run_hours": round(hours, 3),
                        "cost_usd": {prov: (round(hours * table[gpu], 2) if table.get(gpu) is not None else None)
                                     for prov, table in prices["providers"].items()}})
        rows.append(row)
    return rows


def fit_row(decided: RunSettings, base: Settings, gpu: str) -> dict[str, Any]:
    """One card of the fit table: what make train picks there, or, where it stops, what its preflight suggests."""
    host = {"host_gib": decided.predicted["host_offload_gib"],
            "host_budget_gib": host_gib(decided.host_budget_bytes)}
    if decided.fits:
        return {"gpu": gpu, "setting": describe(decided.planned), "overrides": overrides_for(decided.planned, base),
                "peak_gib": decided.predicted["peak_gib"], "card_gib": decided.predicted["card_gib"], **host}
    other = decided.fallback
    return {"gpu": gpu, "setting": None, "fits_with": describe(other) if other else None,
            "overrides": overrides_for(other, base) if other else [],
            # the smallest setting's needs, against both budgets (refusal_line)
            "smallest": describe(decided.planned), "card_gib": decided.predicted["card_gib"],
            "budget_gib": round(decided.budget_bytes / GIB, 1), **host}


def host_gib(budget: float | None) -> float | None:
    return None if budget is None else round(budget / GIB, 1)


def over_host(row: dict[str, Any]) -> bool:
    """A card's row stops on the host budget (issue #48): its smallest setting needs more host memory than that."""
    return (not row["setting"] and row.get("host_budget_gib") is not None
            and row["host_gib"] > row["host_budget_gib"])


def host_words(row: dict[str, Any]) -> str:
    """A fit row's host memory: pinned offloaded activations, against the host budget where there is one."""
    budget = row.get("host_budget_gib")
    return f"host {row['host_gib']} GiB" + (f" of {budget}" if budget is not None else "")


def fit_table(cfg: DictConfig, resolved: Run, shape: Shape, data: DataShape | None, base: Settings,
              world_size: int = 1) -> dict[str, dict[str, Any]]:
    """The plan's cards (conf/plan/throughput.yaml `cards`), each with make train's pick there."""
    return {f"{size} GB": fit_row(decide(cfg, card(gpu, world_size), shape, data, resolved), base, gpu)
            for size, gpu in load_tables()["throughput"]["cards"].items()}


def make_plan(cfg: DictConfig, hw: Hardware | None = None, shape: Shape | None = None,
              run: RunSettings | None = None, resolved: Run | None = None) -> dict[str, Any]:
    """The whole plan as a JSON-able dict, for `hw` (make train's preflight: this GPU; make plan: the largest card,
    the H200). shape: as reprotune.sizing.decide.decide takes it; run: decide's answer when already known;
    resolved: the stage's reprotune.run.Run (default: resolve(cfg, "plan")'s)."""
    resolved = resolved if resolved is not None else resolve(cfg, "plan")
    described = hw or card("H200")
    tables = load_tables()
    consts = tables["memory"]
    shape = shape or model_shape(cfg.model)
    # rows as the run will batch them (packed pairs: the micro-batches it will draw on these processes)
    rows, accum = configured_batch(cfg)
    data = load_data_shape(cfg, padded=preference_padded_on(cfg, described, resolved),
                           world_size=described.world_size, resolved=resolved, global_batch=rows * accum)
    run = run or decide(cfg, described, shape, data, resolved)
    s, mem, budget = run.planned, run.predicted, run.budget_bytes
    base = configured_settings(cfg, described, resolved)
    p = count_params(shape, list(s.targets), s.r, s.dora)
    mem_other = memory(shape, p, replace(s, checkpointing=not s.checkpointing), data, consts)
    fit = fit_table(cfg, resolved, shape, data, base, described.world_size)
    steps = steps_and_tokens(s, data, cfg, resolved.objective)
    return {
        "model": {"name": str(cfg.model.name), "shape": asdict(shape), "parameters": p.total,
                  "trainable_parameters": p.trainable,
                  "frozen_weight_bytes": {"bf16": p.total * 2,
                                          "nf4_double_quant": int(weight_bytes(p, replace(s, load_in_4bit=True,
                                                                                          double_quant=True,
                                                                                          host_embedding=False),
                                                                               consts))}},
        "settings": asdict(s) | {"gradient_checkpointing_setting": str(cfg.hardware.gradient_checkpointing),
                                 "budget_gib": round(budget / GIB, 1), "device": hw.device if hw else None,
                                 "host_budget_gib": host_gib(run.host_budget_bytes)},
        "memory": mem,
        "memory_other_checkpointing": mem_other,
        "fit": fit,
        "data": asdict(data) if data else None,
        "run": steps,
        "time_and_cost": time_and_cost(cfg, resolved, shape, base, data, tables),
        "prices_as_of": tables["prices"]["as_of"],
        "prices_verified": tables["prices"].get("verified", False),
        "warnings": warnings_for(cfg, resolved, s, data, steps),
        "reasons": list(run.reasons),
    }


def format_plan(plan: dict[str, Any]) -> str:
    m, mem, s = plan["model"], plan["memory"], plan["settings"]
    gib = 1 / GIB
    lines = [f"plan: {m['name']} ({m['shape']['source']})",
             f"  parameters {m['parameters'] / 1e9:.3f} B, trainable (LoRA r{s['r']}) {m['trainable_parameters'] / 1e6:.2f} M; "
             f"frozen weights bf16 {m['frozen_weight_bytes']['bf16'] * gib:.2f} GiB, "
             f"NF4+double quant {m['frozen_weight_bytes']['nf4_double_quant'] * gib:.2f} GiB",
             f"  settings: {s['method']}, checkpointing {checkpointing_words(s['checkpointing'], s['ckpt_every'])} "
             f"(hardware.gradient_checkpointing={s['gradient_checkpointing_setting']}, budget {s['budget_gib']} GiB), "
             f"{'packed ' if s['packing'] else ''}micro-batch {mem['tokens_per_micro_batch']} tokens "
             + (f"(bs {s['batch_size']} pairs = {s['batch_size'] * s['sequences']} padded rows, max_length "
                f"{s['max_length']})" if s.get("sequences", 1) > 1 else
                f"(bs {s['batch_size']}, max_length {s['max_length']})")
             + (", activations offloaded to host" if s.get("offload") else "")
             + (f", MLP in {s['tiled_mlp']}-token tiles" if s.get("tiled_mlp") else "")
             + (", input embedding on the host (hardware.embedding_on_host)" if s.get("host_embedding") else ""),
             f"  predicted peak GPU memory: {mem['peak_gib']} GiB allocated, {mem['reserved_gib']} GiB reserved, "
             f"{mem['card_gib']} GiB on the card"
             + f"; host memory (pinned offload): {mem['host_offload_gib']} GiB"
             + (f" of a {s['host_budget_gib']} GiB host budget" if s.get("host_budget_gib") is not None
                else " (host budget not checked for a described card: set hardware.host_memory_budget_gib)"),
             *[f"    {k.replace('_', ' '):32s} {v:8.2f} GiB" for k, v in mem["parts_gib"].items()],
             f"    (checkpointing {'off' if s['checkpointing'] else 'on'} instead: "
             f"{plan['memory_other_checkpointing']['peak_gib']} GiB)",
             # padded preference pairs: what the model counts, and that no GPU measurement checks it yet
             *[f"  {r.removeprefix('plan: ')}" for r in plan.get("reasons", []) if r.startswith("plan: padded pairs:")],
             "  fits:"]
    for size, row in plan["fit"].items():
        other = (f": {row['smallest']} " + both_budgets(row["card_gib"], row["budget_gib"], row["host_gib"],
                                                         row["host_budget_gib"]) if over_host(row) else "")
        other += f"; fits with {' '.join(row['overrides'])}" if row.get("fits_with") else ""
        lines.append(f"    {size:7s} ({row['gpu']:8s}) " + (f"{row['setting']}: GPU {row['peak_gib']} GiB peak "
                                                           f"({row['card_gib']} on the card), {host_words(row)}"
                                                           if row["setting"] else f"does not fit{other}"))
    run = plan["run"]
    if run:
        lines.append(f"  data: {run['examples']} examples, {run['tokens_per_epoch']:,} tokens per epoch; "
                     f"{run['steps']} steps ({run['steps_per_epoch']} per epoch, {run['epochs']} epochs)")
        lines.append(f"  time and cost (prices as of {plan['prices_as_of']}"
                     f"{', unverified: edit conf/plan/prices.yaml' if not plan['prices_verified'] else ''}):")
        for row in plan["time_and_cost"]:
            if not row.get("tokens_per_second"):
                lines.append(f"    {row['gpu']:9s} does not fit")
                continue
            costs = ", ".join(f"{k} ${v:.2f}" for k, v in row["cost_usd"].items() if v is not None)
            scaled = "*" if "unmeasured" in row["throughput_source"] else " "
            lines.append(f"    {row['gpu']:9s} {row['tokens_per_second']:>6,} tok/s{scaled} epoch {row['epoch_hours'] * 60:7.1f} min"
                         f"  run {row['run_hours'] * 60:7.1f} min  {costs}")
        lines.append("    (H200: the throughput model of docs/plan.md, or a measured run of the same configuration; * scaled "
                     "from it by bf16 peak FLOPs, unmeasured; run 50 steps and read the manifest's tokens/s before a "
                     "long run)")
    for w in plan["warnings"]:
        lines.append(f"  warning: {w}")
    return "\n".join(lines)


def write_plan(plan: dict[str, Any], out: Path) -> Path:
    """make plan: outputs/plan.json; make train's preflight: outputs/train/plan.json (a DVC output of train)."""
    from reprotune.manifest import write_json

    write_json(out, plan)
    return out
