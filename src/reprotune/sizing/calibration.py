"""The sizing models against GPU measurements (conf/plan/calibration.json): predictions of each measured
configuration, their errors, and the least-squares fit of the throughput constants. Used by tests/test_plan.py and
bench/plan_calibrate.py; make plan reads only measured_run."""

from __future__ import annotations

import copy
import json
from dataclasses import MISSING, asdict, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from reprotune.run_settings import Settings
from reprotune.sizing.decide import configured_settings
from reprotune.sizing.memory import memory
from reprotune.sizing.shape import PLAN_DIR, DataShape, count_params, load_table, model_shape
from reprotune.sizing.throughput import overhead_terms, step_work, tokens_per_second


def load_calibration(path: Path | None = None) -> list[dict[str, Any]]:
    return json.loads((path or PLAN_DIR / "calibration.json").read_text())


def entry_settings(entry: dict[str, Any]) -> tuple[DictConfig, Settings]:
    """The composed config and the plan's settings of one measured configuration (its code_flags applied)."""
    from reprotune.config import compose

    cfg = compose([o for o in entry["overrides"] if not o.startswith(("paths.", "data.path="))])
    return cfg, replace(configured_settings(cfg), **entry.get("code_flags", {}))


def predict_entry(entry: dict[str, Any], consts: dict[str, Any] | None = None,
                  throughput: dict[str, Any] | None = None) -> dict[str, Any]:
    """The plan's prediction for one measured configuration (its overrides and its recorded data shape); tokens/s
    from the throughput model alone, never from the measurement itself."""
    cfg, s = entry_settings(entry)
    shape = model_shape(cfg.model)
    p = count_params(shape, list(s.targets), s.r, s.dora)
    data = DataShape(**entry["data_shape"])
    if entry.get("plan_bound") in ("longest_pair_rows", "drawn_batches"):  # packed pairs: the longest pair
        s = replace(s, max_length=data.max_tokens)
    if entry.get("plan_bound") == "drawn_batches":  # and the largest micro-batch the measured run drew
        data = replace(data, drawn_batch_tokens=tuple((int(b), int(t)) for b, t in entry["drawn_batch_tokens"]))
    mem = memory(shape, p, s, data, consts or load_table("memory.yaml"))
    tps, _ = tokens_per_second(shape, s, data, "H200", {"throughput": throughput or load_table("throughput.yaml")})
    return {"peak_gib": mem["peak_gib"], "reserved_gib": mem["reserved_gib"], "tokens_per_second": round(tps),
            "parts_gib": mem["parts_gib"], "model": str(cfg.model.name), "settings": asdict(s),
            "work": step_work(shape, s, data)}


def calibration_errors(entries: list[dict[str, Any]], consts: dict[str, Any] | None = None,
                       throughput: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """(predicted - measured) / measured of the peak and of tokens/s, for every entry with a measured peak."""
    rows = []
    for e in entries:
        measured = (e.get("measured") or {}).get("peak_allocated_gib")
        if not measured:
            continue
        pred = predict_entry(e, consts, throughput)
        tps = e["measured"].get("tokens_per_second")
        rows.append({"name": e["name"], "predicted_gib": pred["peak_gib"], "measured_gib": measured,
                     "error": round((pred["peak_gib"] - measured) / measured, 4),
                     "measured_reserved_gib": e["measured"].get("peak_reserved_gib"),
                     "predicted_reserved_gib": pred["reserved_gib"],
                     "measured_tokens_per_second": tps,
                     "predicted_tokens_per_second": pred["tokens_per_second"],
                     "tokens_per_second_error": round((pred["tokens_per_second"] - tps) / tps, 4) if tps else None,
                     "tokens_per_second_outlier": e.get("tokens_per_second_outlier"),
                     "left_out_of_fit": e.get("left_out_of_throughput_fit"),
                     "plan_bound": e.get("plan_bound"),
                     "model": pred["model"], "settings": pred["settings"], "work": pred["work"]})
    return rows


def measured_run(model_name: str, s: Settings, data: DataShape | None) -> dict[str, Any] | None:
    """A committed H200 measurement of exactly this configuration: the same model preset, the same settings
    (recorded as plan_settings by bench/plan_calibrate.py --table --write) and data of the same mean length."""
    if data is None:
        return None
    # as stored (tuples become lists); the SM count the deterministic attention backward sizes its dQ sums by is
    # the card's, not the configuration's (the committed runs are H200 runs)
    wanted = {k: v for k, v in json.loads(json.dumps(asdict(s))).items() if k != "dq_split_sms"}
    defaults = {f.name: f.default for f in fields(Settings) if f.default is not MISSING and f.name != "dq_split_sms"}
    for e in load_calibration():
        mean = e.get("data_shape", {}).get("mean_tokens") or 0
        stored = ({k: v for k, v in {**defaults, **e["plan_settings"]}.items() if k != "dq_split_sms"}
                  if e.get("plan_settings") else None)  # older rows lack new keys
        if (e.get("plan_model") == model_name and stored == wanted
                and abs(mean - data.mean_tokens) <= 0.02 * mean and (e.get("measured") or {}).get("tokens_per_second")
                and not e.get("tokens_per_second_outlier")):
            return e
    return None


def fit_throughput(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The overhead constants of conf/plan/throughput.yaml that best match measured runs (calibration_errors
    rows): least squares on relative error, each row  gemm/t + sum_k const_k * n_k / (1000 * tokens * t) = 1."""
    import numpy as np  # only here: make plan itself never fits

    keys = sorted({k for r in rows for k, n in overhead_terms(r["work"]).items() if n})
    a, b = [], []
    for r in rows:
        w, t = r["work"], 1 / r["measured_tokens_per_second"]
        terms = overhead_terms(w)
        a.append([terms.get(k, 0.0) / 1e3 / w.step.counted / t for k in keys])
        b.append(1.0)
    a_, b_ = np.array(a), np.array(b)
    free = list(range(len(keys)))
    solution = np.zeros(len(keys))
    while free:  # a cost cannot be negative: drop a negative constant (it stays 0) and refit the rest
        fitted, *_ = np.linalg.lstsq(a_[:, free], b_, rcond=None)
        if (fitted >= 0).all():
            solution[free] = fitted
            break
        free.pop(int(np.argmin(fitted)))
    return {k: round(float(v), 3) for k, v in zip(keys, solution, strict=True)}


def throughput_fit_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calibration rows the constants are fitted to: measured tokens/s, not marked outlier or left out."""
    return [r for r in rows if r["measured_tokens_per_second"] and not r["tokens_per_second_outlier"]
            and not r["left_out_of_fit"]]


def with_constants(throughput: dict[str, Any], constants: dict[str, float]) -> dict[str, Any]:
    """A copy of the throughput table with fitted constants ("fast.layer_pass_ms": 3.4, ...) put in."""
    out = copy.deepcopy(throughput)
    for key, value in constants.items():
        node = out["model"]
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return out
