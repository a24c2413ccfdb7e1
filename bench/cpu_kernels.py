"""CPU kernels: pinned (OpenBLAS route) vs pinned with MKL COMPATIBLE (the old pinned path) vs native, alternated.

    python bench/cpu_kernels.py --rounds 2 -- train.max_steps=4 train.per_device_train_batch_size=2

Trains the built-in model (or --model) on the 32-invoice workspace once per variant per round, in the order
new, old, native, new, old, native, ..., each in its own process as `make train` runs it, and prints a markdown
table: tokens/s from each run's manifest (`timing.tokens_per_second`), the ratio to native in the same round, the
adapter sha256 and the load average when the run started (other jobs on the box slow every variant; alternating
keeps the ratio fair). `pinned-old` is pinned mode with REPROTUNE_CPU_MATMUL=torch: the products on MKL's
COMPATIBLE branch, as the kit pinned them before the OpenBLAS route.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = {"pinned-new": ([], {}),
            "pinned-old (MKL COMPATIBLE)": ([], {"REPROTUNE_CPU_MATMUL": "torch"}),
            "native": (["hardware.cpu_kernels=native"], {})}


def workspace(root: Path) -> None:
    """root/data/prepared with the test suite's 32 train and 8 holdout invoices (reprotune.invoices, seed 7)."""
    from reprotune.invoices import generate

    rows = generate(40, seed=7)
    for name, part in (("train", rows[:32]), ("holdout", rows[32:])):
        path = root / f"data/prepared/{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part), encoding="utf-8")


def train_once(name: str, run: int, model: str, overrides: list[str], root: Path) -> dict:
    extra, env = VARIANTS[name]
    out = root / f"{name.split()[0]}-{run}"
    if not (out / "data/prepared").exists():
        workspace(out)
    cmd = [sys.executable, "-m", "reprotune.train", f"model={model}", f"paths.root={out}", *extra, *overrides]
    clean = {k: v for k, v in os.environ.items() if k != "REPROTUNE_CPU_MATMUL"}
    load = os.getloadavg()[0]
    print("+", " ".join(cmd), env or "", flush=True)
    with open(out / "train.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT, env={**clean, **env})
    manifest = json.loads((out / "outputs/train/manifest.json").read_text())
    kernels = manifest["hardware"]["cpu_kernels"]
    return {"variant": name, "run": run, "tokens_per_s": manifest["timing"]["tokens_per_second"],
            "adapter": manifest["outputs"]["adapter"]["sha256"], "load": load,
            "matmul": kernels["matmul"]["library"], "capability": kernels["capability"], "threads": kernels["threads"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--root", type=Path, default=Path("bench-out/cpu_kernels"))
    parser.add_argument("--skip-old", action="store_true", help="leave out the old MKL COMPATIBLE path")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    variants = [name for name in VARIANTS if not (args.skip_old and name.startswith("pinned-old"))]
    rows = [train_once(name, run, args.model, args.overrides, args.root)
            for run in range(1, args.rounds + 1) for name in variants]
    print(f"\ncpu: {os.uname().machine}, {os.cpu_count()} CPUs; {' '.join(args.overrides)}\n")
    print("| round | kernels | matmul | ATen level | threads | tokens/s | vs native (same round) | adapter sha256 "
          "| load avg at start |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        native = next(x for x in rows if x["run"] == r["run"] and x["variant"] == "native")
        print(f"| {r['run']} | {r['variant']} | {r['matmul']} | {r['capability']} | {r['threads']} | "
              f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / native['tokens_per_s']:.2f}x | `{r['adapter'][:12]}` | "
              f"{r['load']:.1f} |")
    for name in variants:
        mine = [r for r in rows if r["variant"] == name]
        natives = [r for r in rows if r["variant"] == "native"]
        mean = sum(r["tokens_per_s"] for r in mine) / len(mine)
        ratio = mean / (sum(r["tokens_per_s"] for r in natives) / len(natives))
        print(f"{name}: mean {mean:.1f} tokens/s, {ratio:.2f}x native; adapters "
              f"{'identical' if len({r['adapter'] for r in mine}) == 1 else 'DIFFER'} across rounds")


if __name__ == "__main__":
    main()
