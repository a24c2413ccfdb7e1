"""Measure peak GPU memory and tokens/s for a list of training configurations, to calibrate `make plan`.

    python bench/plan_calibrate.py                          # the default grid (16 short runs, see GRID)
    python bench/plan_calibrate.py --configs my.json --out /work/notes/gpu/calibration.json
    python bench/plan_calibrate.py --only 8b-lora-ckpt-long 1b-qlora-nockpt-short -- train.max_steps=8
    python bench/plan_calibrate.py --fold /work/notes/gpu/calibration.json   # add measurements to the table
    python bench/plan_calibrate.py --table [--write]   # predicted vs measured for conf/plan/calibration.json
    python bench/plan_calibrate.py --fit               # refit the throughput constants (conf/plan/throughput.yaml)

Each configuration is `{"name": ..., "data": "short" | "long" | <a .jsonl of chats>, "overrides": [...]}`.
For each one the script prepares its data once (data.scrub=false: the calibration data is synthetic), then runs
`python -m reprotune.train <overrides>` in its own process under <root>/<name>, and reads the numbers from that
run's outputs/train/manifest.json ('timing'). It writes a JSON list in the format of the committed table
(conf/plan/calibration.json): the overrides, the data shape the plan needs (token lengths from the prepare
report, the assistant share), the measured peak allocated / reserved GiB and tokens/s, the GPU, the commit and
the plan's prediction at measurement time. The file is rewritten after every run, so a crash keeps what ran.

Data: "short" is the built-in invoice set (~230 tokens); "long" is generated here, deterministically, with
lengths near data.max_length (so the largest micro-batch of a 6-step run is the data's largest, as the plan
assumes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STEPS = ["train.max_steps=6", "train.logging_steps=1", "train.save_steps=1000", "train.run.resume=never",
         "train.gradient_accumulation_steps=1"]
SHORT = ["train.per_device_train_batch_size=16"]
LONG = ["data.max_length=1100", "train.per_device_train_batch_size=4"]


def default_grid() -> list[dict[str, Any]]:
    """1B and 8B shapes x LoRA/QLoRA x checkpointing on/off x short/long examples (16 runs)."""
    grid = []
    for size, model in (("1b", "llama32_1b_random"), ("8b", "qwen3_8b_random")):
        for method in ("lora", "qlora"):
            for ckpt in (True, False):
                for data in ("short", "long"):
                    grid.append({
                        "name": f"{size}-{method}-{'ckpt' if ckpt else 'nockpt'}-{data}",
                        "data": data,
                        "overrides": [f"model={model}", f"method={method}", "hardware=gpu",
                                      f"hardware.gradient_checkpointing={str(ckpt).lower()}",
                                      *(SHORT if data == "short" else LONG), *STEPS],
                    })
    return grid


_WORDS = ("invoice total amount supplier customer order delivery payment account balance report quarter revenue "
         "margin forecast inventory shipment warehouse contract renewal discount schedule meeting summary review "
         "policy update release version service request ticket status priority owner deadline budget estimate "
         "the a of to and in for on with by from at as is was are be this that it which")
WORDS = _WORDS.split()


def write_long_data(path: Path, n: int = 240, seed: int = 0, low_words: int = 920, high_words: int = 1000) -> None:
    """Synthetic chats of ~1,000 tokens (SmolLM2 tokenizer), 40% of the words in the assistant reply."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            words = rng.randint(low_words, high_words)
            reply = int(words * 0.4)
            user = " ".join(rng.choice(WORDS) for _ in range(words - reply))
            answer = " ".join(rng.choice(WORDS) for _ in range(reply))
            fh.write(json.dumps({"messages": [
                {"role": "system", "content": f"Summarise document {i}."},
                {"role": "user", "content": user},
                {"role": "assistant", "content": answer}]}) + "\n")


def data_overrides(data: str, root: Path) -> list[str]:
    if data == "short":
        return []
    if data == "long":
        path = root / "long.jsonl"
        if not path.is_file():
            write_long_data(path)
        return [f"data.path={path.resolve()}"]
    return [f"data.path={Path(data).resolve()}"]


def prepare_key(overrides: list[str]) -> str:
    """Runs that share the data, its max_length and the tokenizer's model share one prepared folder."""
    keep = sorted(o for o in overrides if o.startswith(("data.", "model=")))
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:12] if keep else "default"


def run_one(entry: dict[str, Any], extra: list[str], root: Path, prepared: dict[str, Path]) -> dict[str, Any]:
    out = root / entry["name"]
    overrides = [*data_overrides(entry.get("data", "short"), root), *entry["overrides"], *extra]
    key = prepare_key(overrides)
    if key not in prepared:
        prep_root = root / f"prepared-{key}"
        cmd = [sys.executable, "-m", "reprotune.prepare", f"paths.root={prep_root}", "data.scrub=false",
               *[o for o in overrides if o.startswith(("data.", "model="))]]
        if not any(o.startswith("data.path=") for o in overrides):
            cmd.append(f"data.path={Path('data/raw/invoices.jsonl').resolve()}")
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
        prepared[key] = prep_root / "data" / "prepared"
    (out / "data").mkdir(parents=True, exist_ok=True)
    link = out / "data" / "prepared"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(prepared[key].resolve())
    cmd = [sys.executable, "-m", "reprotune.train", f"paths.root={out}", *overrides]
    print("+", " ".join(cmd), flush=True)
    started = time.time()
    proc = subprocess.run(cmd)
    record: dict[str, Any] = {"name": entry["name"], "data": entry.get("data", "short"), "overrides": overrides,
                              "data_shape": data_shape(prepared[key])}
    if proc.returncode != 0:
        record["error"] = f"exit {proc.returncode} after {time.time() - started:.0f} s (OOM?)"
        return record
    manifest = json.loads((out / "outputs/train/manifest.json").read_text())
    timing = manifest["timing"]
    record["measured"] = {"peak_allocated_gib": timing.get("peak_gpu_memory_gib"),
                          "peak_reserved_gib": timing.get("peak_gpu_reserved_gib"),
                          # steady: optimizer steps after the first two (no warm-up, compilation, allocation)
                          "tokens_per_second": timing.get("steady_tokens_per_second") or timing.get("tokens_per_second"),
                          "tokens_per_second_overall": timing.get("tokens_per_second"),
                          "train_seconds": timing.get("train_seconds")}
    gpus = manifest.get("hardware", {}).get("gpus") or [{}]
    record["provenance"] = {"gpu": gpus[0].get("name"), "commit": manifest.get("git", {}).get("commit"),
                            "dirty": manifest.get("git", {}).get("dirty"),
                            "torch": manifest.get("packages", {}).get("torch"),
                            "date": time.strftime("%Y-%m-%d", time.gmtime())}
    record["predicted"] = predicted(overrides, out)
    return record


def data_shape(prepared: Path) -> dict[str, Any]:
    """What the plan reads from the prepared data, copied so the committed table stands alone."""
    from reprotune.sizing import shape as sz_shape

    return sz_shape.data_shape_from_prepared(prepared)


def predicted(overrides: list[str], root: Path) -> dict[str, Any] | None:
    from reprotune.config import compose
    from reprotune.sizing import report as sz_report

    cfg = compose([f"paths.root={root}", *overrides])
    memory = sz_report.make_plan(cfg, device="cuda")["memory"]
    return {"peak_gib": memory["peak_gib"], "parts_gib": memory["parts_gib"]}


TABLE = Path(__file__).resolve().parents[1] / "conf" / "plan" / "calibration.json"


def fold(new: Path, table: Path = TABLE) -> None:
    """Add measured runs to the committed table (same name: the new measurement replaces the old one)."""
    entries = {e["name"]: e for e in json.loads(table.read_text())}
    for e in json.loads(new.read_text()):
        if e.get("measured", {}).get("peak_allocated_gib"):
            entries[e["name"]] = {k: v for k, v in e.items() if k not in ("predicted", "error")}
    write_table(list(entries.values()), table)


def write_table(entries: list[dict[str, Any]], table: Path = TABLE) -> None:
    """Record each entry's current predictions and errors (tests/test_plan.py fails if a change makes them worse)
    and the plan's settings for it (what make plan matches a measured run by)."""
    from reprotune.sizing import calibration as sz_calibration

    errors = {r["name"]: r for r in sz_calibration.calibration_errors(entries)}
    for e in entries:
        if e["name"] in errors:
            r = errors[e["name"]]
            e["predicted"] = {"peak_gib": r["predicted_gib"], "tokens_per_second": r["predicted_tokens_per_second"]}
            e["error"] = r["error"]
            e["tokens_per_second_error"] = r["tokens_per_second_error"]
            e["plan_model"], e["plan_settings"] = r["model"], r["settings"]
    tmp = table.with_name(table.name + ".tmp")
    tmp.write_text(json.dumps(entries, indent=1) + "\n")
    os.replace(tmp, table)


def print_table(table: Path = TABLE) -> None:
    from reprotune.sizing import calibration as sz_calibration

    rows = sz_calibration.calibration_errors(json.loads(table.read_text()))
    print("| configuration | predicted GiB | measured GiB | error | reserved GiB (pred / meas) "
          "| tok/s (pred / meas) | tok/s error |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        outlier = " (outlier)" if r["tokens_per_second_outlier"] else ""
        print(f"| {r['name']} | {r['predicted_gib']:.2f} | {r['measured_gib']:.2f} | {r['error']:+.1%} | "
              f"{r['predicted_reserved_gib']:.2f} / {r['measured_reserved_gib'] or '-'} | "
              f"{r['predicted_tokens_per_second']:,} / {r['measured_tokens_per_second'] or 0:,} | "
              f"{'-' if r['tokens_per_second_error'] is None else format(r['tokens_per_second_error'], '+.1%')}"
              f"{outlier} |")
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\nmemory: worst {worst['name']} {worst['error']:+.1%}; mean |error| "
          f"{sum(abs(r['error']) for r in rows) / len(rows):.1%} over {len(rows)} runs")
    tps = [r for r in rows if r["tokens_per_second_error"] is not None and not r["tokens_per_second_outlier"]]
    worst = max(tps, key=lambda r: abs(r["tokens_per_second_error"]))
    print(f"tokens/s: worst {worst['name']} {worst['tokens_per_second_error']:+.1%}; mean |error| "
          f"{sum(abs(r['tokens_per_second_error']) for r in tps) / len(tps):.1%} over {len(tps)} runs"
          f" ({len(rows) - len(tps)} marked outlier)")


def print_fit(table: Path = TABLE) -> None:
    """The fitted constants (paste into conf/plan/throughput.yaml) and each row's error, in-sample and with the
    row held out of the fit (where the rest still determine every constant it uses)."""
    from reprotune.sizing import calibration as sz_calibration
    from reprotune.sizing import shape as sz_shape
    from reprotune.sizing import throughput as sz_throughput

    throughput = sz_shape.load_table("throughput.yaml")
    rows = [r for r in sz_calibration.calibration_errors(json.loads(table.read_text()))
            if r["measured_tokens_per_second"]]
    used = sz_calibration.throughput_fit_rows(rows)
    constants = sz_calibration.fit_throughput(used)
    print("fitted (conf/plan/throughput.yaml, model:):")
    for key, value in constants.items():
        print(f"  {key}: {value}")
    fitted = sz_calibration.with_constants(throughput, constants)
    for r in rows:
        cfg_tp = {"throughput": fitted}
        w = r["work"]
        t = sz_throughput.model_seconds_per_token(w, cfg_tp["throughput"])
        pred = 1 / (t["gemm"] + t["overhead"])
        rest = [o for o in used if o["name"] != r["name"]]
        needed = {k for k, n in sz_throughput.overhead_terms(w).items() if n}
        held = ""
        if needed <= {k for o in rest for k, n in sz_throughput.overhead_terms(o["work"]).items() if n} and len(rest) > len(
                needed):
            t_out = sz_throughput.model_seconds_per_token(w, sz_calibration.with_constants(throughput, sz_calibration.fit_throughput(rest)))
            held = f", held out {1 / (t_out['gemm'] + t_out['overhead']) / r['measured_tokens_per_second'] - 1:+.1%}"
        mark = " (not fitted)" if r not in used else ""
        print(f"  {r['name']:36s} predicted {pred:8,.0f} measured {r['measured_tokens_per_second']:8,} "
              f"error {pred / r['measured_tokens_per_second'] - 1:+.1%}{held}; GEMMs "
              f"{t['gemm'] / (t['gemm'] + t['overhead']):.0%} of the time{mark}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=Path, help="JSON list of {name, data, overrides}; default: GRID")
    parser.add_argument("--only", nargs="*", help="run only these names")
    parser.add_argument("--root", type=Path, default=Path("bench-out/plan"))
    parser.add_argument("--out", type=Path, default=Path("bench-out/plan/calibration.json"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    parser.add_argument("--fold", type=Path, help="add the measurements of this JSON to conf/plan/calibration.json")
    parser.add_argument("--table", action="store_true", help="print predicted vs measured for the committed table")
    parser.add_argument("--write", action="store_true", help="with --table: record the current predictions")
    parser.add_argument("--fit", action="store_true", help="fit the throughput constants to the committed table")
    args = parser.parse_args()
    if args.fit:
        print_fit()
        return
    if args.fold or args.table:
        if args.fold:
            fold(args.fold)
        elif args.write:
            write_table(json.loads(TABLE.read_text()))
        print_table()
        return
    grid = json.loads(args.configs.read_text()) if args.configs else default_grid()
    if args.only:
        grid = [g for g in grid if g["name"] in set(args.only)]
    args.root.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    prepared: dict[str, Path] = {}
    for entry in grid:
        records.append(run_one(entry, args.overrides, args.root, prepared))
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_name(args.out.name + ".tmp")
        tmp.write_text(json.dumps(records, indent=1) + "\n")
        os.replace(tmp, args.out)
        m = records[-1].get("measured") or {}
        print(f"== {entry['name']}: peak {m.get('peak_allocated_gib')} GiB allocated, "
              f"{m.get('peak_reserved_gib')} reserved, {m.get('tokens_per_second')} tok/s "
              f"{records[-1].get('error', '')}", flush=True)
    print(f"wrote {args.out} ({len(records)} runs)")


if __name__ == "__main__":
    main()
