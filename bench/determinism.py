"""Bitwise reruns: train the same config twice per repro mode, compare adapter hashes, report throughput.

    python bench/determinism.py --model llama32_1b_random --modes default fast -- train.max_steps=30

repro=default (and strict) promise identical bytes run to run on the CPU and on CUDA (torch's deterministic
algorithms, a fixed cuBLAS workspace, the FlashAttention varlen backward in its deterministic form); repro=fast
leaves the CUDA kernels in their fastest, nondeterministic forms. Prints a markdown table: each mode's two
adapter sha256 side by side, and its tokens/s against the first mode's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def train_once(model: str, method: str, mode: str, run: int, overrides: list[str], root: Path) -> dict:
    out = root / f"{model}-{method}-{mode}-{run}"
    (out / "data").mkdir(parents=True, exist_ok=True)
    if not (out / "data/prepared").exists():
        (out / "data/prepared").symlink_to(Path("data/prepared").resolve())
    cmd = [sys.executable, "-m", "reprotune.train", f"model={model}", f"method={method}", f"repro={mode}",
           f"paths.root={out}", *overrides]
    print("+", " ".join(cmd), flush=True)
    with open(out / "train.log", "w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    manifest = json.loads((out / "outputs/train/manifest.json").read_text())
    return {"adapter": manifest["outputs"]["adapter"]["sha256"],
            "metrics": manifest["outputs"]["metrics_sha256"],
            "tokens_per_s": manifest["timing"]["tokens_per_second"],
            "device": manifest["device"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny_random")
    parser.add_argument("--method", default="lora")
    parser.add_argument("--modes", nargs="+", default=["default", "fast"])
    parser.add_argument("--root", type=Path, default=Path("bench-out/determinism"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = []
    for mode in args.modes:
        a, b = (train_once(args.model, args.method, mode, i, args.overrides, args.root) for i in (1, 2))
        rows.append({"mode": mode, "device": a["device"], "identical_adapter": a["adapter"] == b["adapter"],
                     "identical_metrics": a["metrics"] == b["metrics"], "adapter_run1": a["adapter"][:16],
                     "adapter_run2": b["adapter"][:16], "tokens_per_s": round((a["tokens_per_s"] + b["tokens_per_s"]) / 2, 1)})
    base = rows[0]["tokens_per_s"]
    print("\n| mode | device | identical adapter | identical metrics | run 1 | run 2 | tokens/s | vs first |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['device']} | {r['identical_adapter']} | {r['identical_metrics']} | {r['adapter_run1']} | "
              f"{r['adapter_run2']} | {r['tokens_per_s']} | {r['tokens_per_s'] / base:.2f}x |")


if __name__ == "__main__":
    main()
