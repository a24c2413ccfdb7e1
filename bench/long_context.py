"""Long context on the GPU this runs on: `reprotune.train` on examples of a given length, one example per
micro-step, with what it kept on the GPU and the host next to what `make plan` predicted (issue #27).

    python bench/long_context.py --runs qlora@16384 qlora@65536+offload qlora@98304+offload+tiled
    python bench/long_context.py --runs lora@262144+offload+tiled --steps 1     # peak memory only
    python bench/long_context.py --runs qlora@98304+offload+tiled+strict qlora@98304+offload+tiled+strict#2
    python bench/long_context.py --longest qlora --budget-gib 22               # the longest length that fits
    python bench/long_context.py --cards --model qwen3_8b     # make plan's longest context per card (no GPU)

A run is METHOD@TOKENS[xROWS][+offload][+tiled[N]][+strict][#N] (ROWS examples per micro-step, default 1): every layer checkpointed (hardware.gradient_checkpointing=
true, what every long run needs), TRL's activation offloading and the tiled MLP on exactly when named (forced, so
the measurement is of that setting; +tiled8192: tiles of 8,192 tokens), repro=strict when named, #N a repeat. Data: seed-shaped chat examples
(bench/seed_recipe.py's words; user 25-50% of the tokens, the rest the answer) of exactly TOKENS tokens with the
model's chat template. Each run is its own process; the table gives steady tokens/s (steps after the first two;
with --steps 1 or 2 none), peak allocated / reserved GPU memory, pinned host memory, and the preflight's
prediction. --longest asks the plan for the longest length that fits the budget (doubling, then bisecting), runs
it, and steps down by an eighth until a run stays within the budget (reserved + CUDA context).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "bench"))

from seed_recipe import SYSTEM, _n_tokens, _words, release_gpu_memory  # noqa: E402


def long_examples(tokenizer, n: int, tokens: int, seed: int = 0) -> list[dict]:
    """n chat examples of at most, and within a few tokens of, `tokens` tokens (rendered with the chat template)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        user_share = rng.uniform(0.25, 0.5)
        user = _words(rng, max(8, int(tokens * user_share / 1.5)))
        answer = _words(rng, max(8, int(tokens * (1 - user_share) / 1.2)))  # longer than needed: cut below
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user},
                    {"role": "assistant", "content": answer}]
        ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        lo, hi = 4, len(ids)  # the longest answer prefix whose example fits `tokens`
        while lo < hi:
            mid = (lo + hi + 1) // 2
            messages[2]["content"] = tokenizer.decode(ids[:mid]).strip()
            lo, hi = (mid, hi) if _n_tokens(tokenizer, messages) <= tokens else (lo, mid - 1)
        messages[2]["content"] = tokenizer.decode(ids[:lo]).strip()
        rows.append({"messages": messages})
    return rows


def write_data(root: Path, model_dir: str, n: int, tokens: int) -> dict:
    """The examples as prepare writes them (train.jsonl, holdout.jsonl, and the report.json lengths the plan
    reads: its assistant share sizes the loss head)."""
    from transformers import AutoTokenizer

    prepared = root / "data" / "prepared"
    tok = AutoTokenizer.from_pretrained(model_dir)
    if not (prepared / "report.json").is_file():
        rows = long_examples(tok, n, tokens)
        prepared.mkdir(parents=True, exist_ok=True)
        (prepared / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (prepared / "holdout.jsonl").write_text(json.dumps(rows[0]) + "\n")
        lengths = [_n_tokens(tok, r["messages"]) for r in rows]
        train = {"n": len(lengths), "min": min(lengths), "max": max(lengths), "total": sum(lengths),
                 "mean": sum(lengths) / len(lengths), "model": "bench/long_context.py"}
        (prepared / "report.json").write_text(json.dumps({"tokens": {"train": train}, "max_length": tokens,
                                                          "examples": {"overlong": {"count": 0}}}))
    return json.loads((prepared / "report.json").read_text())["tokens"]["train"]


def parse(run: str) -> tuple[str, int, set[str]]:
    """METHOD@TOKENS[xROWS][+flag...][#N] -> (method, tokens, flags); rows travel as the flag "rowsN".

    Flags: offload, tiled[N] (tiled MLP, N tokens a tile), strict / fast (repro mode; the default otherwise)."""
    spec, _, _repeat = run.partition("#")
    head, *flags = spec.split("+")
    method, _, tokens = head.partition("@")
    tokens, _, rows = tokens.partition("x")
    return method, int(tokens), set(flags) | ({f"rows{int(rows)}"} if rows else set())


def run_overrides(method: str, tokens: int, flags: set[str], steps: int) -> list[str]:
    rows = next((int(f.removeprefix("rows")) for f in flags if f.startswith("rows")), 1)
    out = [f"method={method}", "hardware=gpu", f"data.max_length={tokens}", f"train.max_steps={steps}",
           f"train.per_device_train_batch_size={rows}", "train.gradient_accumulation_steps=1", "train.logging_steps=1",
           "train.save_steps=100000", "train.run.resume=never", "hardware.gradient_checkpointing=true",
           f"hardware.activation_offloading={'offload' in flags}".lower(),
           f"hardware.tiled_mlp={any(f.startswith('tiled') for f in flags)}".lower()]
    tiles = [f.removeprefix("tiled") for f in flags if f.startswith("tiled") and f != "tiled"]
    out += [f"hardware.tiled_mlp_tokens={int(tiles[0])}"] if tiles else []  # +tiled8192: tiles of 8,192 tokens
    return out + [f"repro={mode}" for mode in ("strict", "fast") if mode in flags]


def ours(model: str, root: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "reprotune.train", f"model={model}", f"paths.root={root}", *overrides]
    print("+", " ".join(cmd), flush=True)
    done = subprocess.run(cmd)
    if done.returncode:
        return {"failed": done.returncode}
    manifest = json.loads((root / "outputs/train/manifest.json").read_text())
    t, rs = manifest["timing"], manifest["run_settings"]
    plan = json.loads((root / "outputs/train/plan.json").read_text())["memory"] or {}
    return {"steady_tokens_per_s": t["steady_tokens_per_second"], "tokens_per_s": t["tokens_per_second"],
            "mfu": t["mfu"], "peak_gib": t["peak_gpu_memory_gib"], "reserved_gib": t["peak_gpu_reserved_gib"],
            "pinned_host_gib": t.get("pinned_host_gib"), "step_seconds": t["step_seconds"],
            "planned_peak_gib": plan.get("peak_gib"), "planned_reserved_gib": plan.get("reserved_gib"),
            "planned_host_gib": plan.get("host_offload_gib"),
            "offload": rs["activation_offloading"], "tiled_mlp": rs["tiled_mlp_tokens"],
            "adapter_sha256": manifest["outputs"]["adapter"]["sha256"]}


def gpu_multiprocessors() -> int:
    """The SM count of the GPU this runs on (FlashAttention's deterministic backward sizes its dQ sums by it), or
    an H100's 132 without one."""
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def planned(model: str, method: str, tokens: int, budget_gib: float, extra: list[str], sms: int) -> dict:
    """What make plan says of this length on a card of budget_gib and `sms` multiprocessors (the fit free to
    choose)."""
    from reprotune.config import compose
    from reprotune.sizing import decide as d
    from reprotune.sizing.fit import describe

    cfg = compose([f"model={model}", f"method={method}", "hardware=gpu", "paths.prepared=/nonexistent",
                   f"data.max_length={tokens}", "train.per_device_train_batch_size=1",
                   "train.gradient_accumulation_steps=1", f"hardware.memory_budget_gib={budget_gib}", *extra])
    run = d.decide(cfg, d.Hardware(device="cuda", free_bytes=budget_gib * 2**30, name="budget", multiprocessors=sms),
                   None, None)
    return {"fits": run.fits, "setting": describe(run.planned), "peak_gib": run.predicted["peak_gib"],
            "card_gib": run.predicted["card_gib"], "host_gib": run.predicted["host_offload_gib"],
            "offload": run.planned.offload, "tiled": run.planned.tiled_mlp}


def longest_planned(model: str, method: str, budget_gib: float, extra: list[str],
                    sms: int) -> tuple[int, dict] | None:
    """The longest length (a multiple of 1,024 tokens) the plan fits in budget_gib, and its plan."""
    lo, hi = 0, 1024
    while planned(model, method, hi, budget_gib, extra, sms)["fits"] and hi < 1 << 22:
        lo, hi = hi, hi * 2
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        lo, hi = (mid, hi) if planned(model, method, mid, budget_gib, extra, sms)["fits"] else (lo, mid)
    return (lo, planned(model, method, lo, budget_gib, extra, sms)) if lo else None


def card_table(model: str, extra: list[str]) -> None:
    """make plan's longest context per card (no GPU needed): the 24 GB card at the kit's own budget (22 GiB of
    card), the others at 90% of their memory; one example per micro-step, every technique allowed."""
    from reprotune.sizing.shape import load_tables

    tp = load_tables()["throughput"]
    print("| card | method | longest context (tokens) | setting | peak GiB (alloc) | card GiB | host GiB |\n"
          "|---|---|---|---|---|---|---|")
    for size, gpu in tp["cards"].items():
        if size == 40:
            continue
        budget = 22.0 if size == 24 else round(0.9 * tp["gpus"][gpu]["memory_gib"], 1)
        for method in ("qlora", "lora"):
            found = longest_planned(model, method, budget, extra, int(tp["gpus"][gpu]["multiprocessors"]))
            if not found:
                print(f"| {size} GB | {method} | - | does not fit | | | |")
                continue
            tokens, plan = found
            print(f"| {size} GB ({budget} GiB) | {method} | {tokens:,} | {plan['setting']} | {plan['peak_gib']} | "
                  f"{plan['card_gib']} | {plan['host_gib']} |")


def longest(args, model_dir: str) -> dict:
    method, budget = args.longest, args.budget_gib
    extra = [o for o in args.overrides if o.startswith("model.")]
    sms = gpu_multiprocessors()
    found = longest_planned(args.model, method, budget, extra, sms)  # the plan's longest; then measured, stepping down
    lo = found[0] if found else 16384
    length, results = lo, {}
    while length >= 4096:
        plan = planned(args.model, method, length, budget, extra, sms)
        flags = {f for f, on in (("offload", plan["offload"]), ("tiled", plan["tiled"])) if on}
        root = args.out / f"longest-{method}-{length}"
        write_data(root, model_dir, 2, length)
        r = ours(args.model, root, [*run_overrides(method, length, flags, 2), *args.overrides,
                                    f"hardware.memory_budget_gib={budget}"])
        results[length] = {**r, "plan": plan}
        print(json.dumps({length: results[length]}), flush=True)
        if "failed" not in r and r["reserved_gib"] + 0.6 <= budget:
            return {"longest": length, "runs": results}
        length = (length - length // 8) // 1024 * 1024
    return {"longest": None, "runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", default=["qlora@16384", "qlora@65536+offload",
                                                      "qlora@98304+offload+tiled"])
    parser.add_argument("--model", default="qwen3_8b_random")  # Qwen3ForCausalLM, 8.19 B, random weights
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--longest", choices=["lora", "qlora", "dora"], help="find the longest fitting length")
    parser.add_argument("--budget-gib", type=float, default=22.0, help="card budget for --longest (24 GB: 22)")
    parser.add_argument("--cards", action="store_true", help="make plan's longest context per card (no GPU)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/long_context"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()

    if args.cards:
        # every override reaches the plan (repro=fast, hardware.host_memory_budget_gib=48, model.*): the search
        # used to keep only model.* ones, so `-- repro=fast` planned the default
        card_table(args.model, list(args.overrides))
        return
    from reprotune.config import compose
    from reprotune.models import resolve_model_dir

    cfg = compose([f"model={args.model}", *[o for o in args.overrides if o.startswith("model.")]])
    model_dir = resolve_model_dir(cfg.model, cfg.paths.model_cache)
    release_gpu_memory()  # a random-init model is built on the GPU; the runs below must find all of it free
    args.out.mkdir(parents=True, exist_ok=True)
    if args.longest:
        found = longest(args, model_dir)
        (args.out / "longest.json").write_text(json.dumps(found, indent=1))
        print(f"\n{args.model} {args.longest}: longest context within {args.budget_gib} GiB: {found['longest']}")
        return
    results = {}
    for run in args.runs:
        method, tokens, flags = parse(run)
        root = args.out / run.replace("@", "-").replace("+", "-").replace("#", "-")
        rows = next((int(f.removeprefix("rows")) for f in flags if f.startswith("rows")), 1)
        stats = write_data(root, model_dir, args.steps * rows, tokens)
        results[run] = {**ours(args.model, root, [*run_overrides(method, tokens, flags, args.steps),
                                                  *args.overrides]), "data": stats}
        print(json.dumps({run: results[run]}), flush=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print_table(args.model, results)


def print_table(model: str, results: dict) -> None:
    print(f"\n{model}, one example per micro-step, every layer checkpointed\n")
    print("| run | tokens/s (steady) | peak GiB alloc / reserved | pinned host GiB | planned peak / reserved "
          "| planned host GiB | adapter sha256 |\n|---|---|---|---|---|---|---|")
    for run, r in results.items():
        if "failed" in r:
            print(f"| {run} | failed (exit {r['failed']}) | | | | | |")
            continue
        # the allocator's peak of pinned blocks held (its "*.allocated" keys are running totals: 112 GiB at 96k)
        host = (r.get("pinned_host_gib") or {}).get("allocated_bytes.peak", "-")
        print(f"| {run} | {r['steady_tokens_per_s'] or 0:,.0f} | {r['peak_gib']} / {r['reserved_gib']} | "
              f"{host} | {r['planned_peak_gib']} / {r['planned_reserved_gib']} | "
              f"{r['planned_host_gib']} | {r['adapter_sha256'][:16]} |")


if __name__ == "__main__":
    main()
