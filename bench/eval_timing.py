"""How long the eval stage takes, and what batching buys: one eval run per batch size, a table at the end.

    python bench/eval_timing.py                                  # the built-in model + outputs/adapter
    python bench/eval_timing.py --batch-sizes 1,8 --examples 16 model=tiny_random paths.root=/tmp/x

Runs reprotune.evaluate (the real stage, greedy, holdout loss included unless eval.loss=false) into a
scratch folder, so outputs/eval is left alone. Timings come from each run's manifest.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from reprotune.config import compose
from reprotune.evaluate import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,4,8", help="comma-separated eval.batch_size values")
    parser.add_argument("--examples", type=int, default=None, help="eval.max_examples (default: whole holdout)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for make eval ARGS=...")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="reprotune-bench-eval-") as scratch:
        for size in [int(s) for s in args.batch_sizes.split(",")]:
            out = Path(scratch) / f"bs{size}"
            overrides = [*args.overrides, f"eval.batch_size={size}", f"paths.eval_dir={out}"]
            if args.examples:
                overrides.append(f"eval.max_examples={args.examples}")
            evaluate(compose(overrides))
            manifest = json.loads((out / "manifest.json").read_text())
            timing = manifest["timing"]
            rows.append((size, manifest["inputs"]["holdout"]["examples"], manifest["device"],
                         manifest["hardware"]["torch_threads"], timing["base"], timing["tuned"],
                         timing["wall_seconds"]))

    print("\n| batch | examples | device | threads | base s | tuned s | base ex/s | tuned ex/s "
          "| tuned new tok/s | wall s |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for size, n, device, threads, base, tuned, wall in rows:
        print(f"| {size} | {n} | {device} | {threads} | {base['seconds']:.1f} | {tuned['seconds']:.1f} "
              f"| {base['examples_per_second']:.2f} | {tuned['examples_per_second']:.2f} "
              f"| {tuned['new_tokens_per_second']:.1f} | {wall:.1f} |")


if __name__ == "__main__":
    main()
