"""Train-stage throughput and memory for several model/method pairs; prints a markdown table.

    python bench/train_throughput.py --runs llama32_1b_random:lora llama32_1b_random:qlora -- train.max_steps=30

Each run is `python -m reprotune.train model=<model> method=<method> <overrides>` in its own process, with
outputs under bench-out/<model>-<method>; numbers come from the run's outputs/train/manifest.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def run(model: str, method: str, overrides: list[str], root: Path) -> dict:
    out = root / f"{model}-{method}"
    (out / "data").mkdir(parents=True, exist_ok=True)
    prepared = out / "data" / "prepared"
    if not prepared.exists():
        prepared.symlink_to(Path("data/prepared").resolve())
    cmd = [sys.executable, "-m", "reprotune.train", f"model={model}", f"method={method}", f"paths.root={out}",
           *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    manifest = json.loads((out / "outputs/train/manifest.json").read_text())
    metrics = json.loads((out / "outputs/train/metrics.json").read_text())
    curve = json.loads((out / "outputs/train/loss_curves.json").read_text())["train"]
    return {
        "model": model, "method": method, "device": manifest["device"], "dtype": manifest["dtype"],
        "gpu": (manifest["hardware"]["gpus"] or [{"name": "-"}])[0]["name"],
        "steps": metrics["global_step"], "first_loss": curve[0][1], "final_loss": curve[-1][1],
        "tokens_per_s": manifest["timing"]["tokens_per_second"],
        "peak_gib": manifest["timing"]["peak_gpu_memory_gib"], "train_s": manifest["timing"]["train_seconds"],
        "adapter_sha256": manifest["outputs"]["adapter"]["sha256"][:16],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="model:method pairs")
    parser.add_argument("--root", type=Path, default=Path("bench-out"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    rows = [run(*pair.split(":"), args.overrides, args.root) for pair in args.runs]
    cols = list(rows[0])
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
