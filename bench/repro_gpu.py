"""Strict vs default reproducibility on a GPU: are two runs byte-identical, and what does strict cost?

    .venv/bin/python bench/repro_gpu.py                       # SmolLM2-135M, 60 steps, each mode twice
    .venv/bin/python bench/repro_gpu.py --steps 30 --runs 2 -- method=qlora

Runs `python -m reprotune.train` in a fresh process per run (as make does), in a temp root holding the
prepared built-in data, for repro=default and repro=strict (deterministic algorithms, fixed cuBLAS
workspace, eager attention). Prints a table (mode, run, tokens/s, adapter sha256, identical to run 1) and
writes both modes' numbers, hashes and the environment to a manifest (default
outputs/bench/repro_gpu.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def run_once(root: Path, mode: str, steps: int, extra: list[str]) -> dict:
    out = root / f"run-{mode}"
    shutil.rmtree(out / "outputs", ignore_errors=True)
    (out / "data").mkdir(parents=True, exist_ok=True)
    if not (out / "data/prepared").exists():
        shutil.copytree(root / "prepared", out / "data/prepared")
    cmd = [sys.executable, "-m", "reprotune.train", f"paths.root={out}", f"repro={mode}", "hardware=gpu",
           f"train.max_steps={steps}", f"train.save_steps={steps * 10}", "train.logging_steps=5", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench: {mode} run failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "outputs/train/manifest.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "outputs/bench/repro_gpu.json")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides (e.g. model=..., method=qlora)")
    args = parser.parse_args()

    import torch

    from reprotune import manifest as mf
    from reprotune.config import compose
    from reprotune.prepare import prepare

    if not torch.cuda.is_available():
        sys.exit("bench: needs a CUDA GPU (torch sees none)")
    root = Path(tempfile.mkdtemp(prefix="reprotune-bench-repro-"))
    cfg = compose([f"paths.root={REPO}", f"paths.prepared={root / 'prepared'}", *args.overrides])
    prepare(cfg)
    rows, results = [], {}
    for mode in ("default", "strict"):
        runs = [run_once(root, mode, args.steps, args.overrides) for _ in range(args.runs)]
        first = runs[0]["outputs"]["adapter"]["sha256"]
        tps = [r["timing"]["tokens_per_second"] for r in runs]
        results[mode] = {
            "adapter_sha256": [r["outputs"]["adapter"]["sha256"] for r in runs],
            "byte_identical": all(r["outputs"]["adapter"]["sha256"] == first for r in runs),
            "tokens_per_second": tps,
            "train_seconds": [r["timing"]["train_seconds"] for r in runs],
            "peak_gpu_memory_gib": [r["timing"]["peak_gpu_memory_gib"] for r in runs],
            "determinism": runs[0]["determinism"],
        }
        for i, r in enumerate(runs, 1):
            rows.append((mode, i, r["timing"]["tokens_per_second"], r["timing"]["train_seconds"],
                         r["outputs"]["adapter"]["sha256"][:16], r["outputs"]["adapter"]["sha256"] == first))
    mean = {m: sum(results[m]["tokens_per_second"]) / len(results[m]["tokens_per_second"]) for m in results}
    record = mf.base_manifest("bench.repro_gpu", {"steps": args.steps, "runs": args.runs,
                                                  "overrides": args.overrides})
    record.update({"modes": results, "strict_throughput_cost": round(1 - mean["strict"] / mean["default"], 4)})
    mf.write_json(args.out, record)
    shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'mode':<8} {'run':>3} {'tokens/s':>10} {'train s':>8}  {'adapter sha256':<16}  same as run 1")
    for mode, i, tps, secs, digest, same in rows:
        print(f"{mode:<8} {i:>3} {tps:>10.1f} {secs:>8.1f}  {digest:<16}  {'yes' if same else 'NO'}")
    print(f"\nstrict costs {100 * record['strict_throughput_cost']:.1f}% throughput "
          f"({mean['strict']:.0f} vs {mean['default']:.0f} tokens/s) on {record['hardware']['gpus']}")
    print(f"manifest: {args.out}")


if __name__ == "__main__":
    main()
