"""How long `make plan` takes, as a user runs it: a fresh `python -m reprotune.plan` process per run (Python and
Hydra start-up included), for a few presets, with and without prepared data to read.

    python bench/plan_time.py [--runs 3] [extra hydra overrides...]

make plan loads no weights and imports no ML library (tests/test_plan.py checks that); this measures what that
buys. Prints a table; asserts nothing. The runs of the variants alternate, so a change in the machine's load
falls on all of them; the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {
    "qwen3_8b_random qlora, 100 prepared examples": ["model=qwen3_8b_random", "method=qlora", "data.max_length=1024"],
    "qwen3_8b_random lora, no prepared data": ["model=qwen3_8b_random", "method=lora"],
    "llama32_1b_random lora, no prepared data": ["model=llama32_1b_random", "method=lora"],
}


def write_prepared(folder: Path, n: int = 100, tokens: int = 600) -> None:
    """A prepared folder as reprotune.prepare writes it (report.json + train.jsonl), n examples of `tokens`."""
    folder.mkdir(parents=True, exist_ok=True)
    row = json.dumps({"messages": [{"role": "user", "content": "u" * (3 * tokens)},
                                   {"role": "assistant", "content": "a" * tokens}]})
    (folder / "train.jsonl").write_text((row + "\n") * n)
    report = {"max_length": 1024, "examples": {"train": n, "overlong": {"policy": "drop", "count": 0, "dropped": 0,
                                                                          "truncated": 0}},
              "tokens": {"model": "smollm2_135m", "train": {"n": n, "min": tokens, "max": tokens, "mean": tokens,
                                                            "total": n * tokens}}}
    (folder / "report.json").write_text(json.dumps(report))


def one_run(root: Path, overrides: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "reprotune.plan", f"paths.root={root}", *overrides], cwd=REPO, env=env,
                   check=True, capture_output=True, text=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args, extra = parser.parse_known_args()
    times: dict[str, list[float]] = {label: [] for label in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        roots = {label: Path(tmp) / str(i) for i, label in enumerate(VARIANTS)}
        write_prepared(roots[next(iter(VARIANTS))] / "data" / "prepared")
        for _ in range(args.runs):
            for label, overrides in VARIANTS.items():
                times[label].append(one_run(roots[label], overrides + extra))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    print(f"{'make plan ARGS=...':<48} {'runs':>4} {'best s':>7} {'worst s':>8}")
    for label, found in times.items():
        print(f"{label:<48} {len(found):>4} {min(found):>7.2f} {max(found):>8.2f}")


if __name__ == "__main__":
    main()
