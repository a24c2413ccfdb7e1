"""How long `make prepare` takes on the built-in dataset, with and without PII scrubbing.

    python bench/prepare_time.py [--runs 2] [extra hydra overrides...]

Each run is a fresh `python -m reprotune.prepare` process (imports and model loading included, as a user
sees it), writing into a temporary paths.root holding a copy of data/raw. Prints a table; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(root: Path, overrides: list[str]) -> tuple[float, dict]:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "reprotune.prepare", f"paths.root={root}", *overrides], cwd=REPO,
                   check=True, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    pii = json.loads((root / "data/prepared/pii_report.json").read_text())
    return elapsed, pii


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args, extra = parser.parse_known_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        shutil.copytree(REPO / "data/raw", root / "data/raw")
        n = sum(1 for _ in (root / "data/raw/invoices.jsonl").open())
        for label, overrides in (("scrub on (default)", []), ("scrub off", ["data.scrub=false"])):
            times = []
            for _ in range(args.runs):
                elapsed, pii = one_run(root, overrides + extra)
                times.append(elapsed)
            found = pii.get("total_replacements", "-")
            rows.append((label, n, min(times), max(times), found))
    print(f"{'config':<20} {'examples':>8} {'best s':>8} {'worst s':>8} {'PII replaced':>13}")
    for label, n, best, worst, found in rows:
        print(f"{label:<20} {n:>8} {best:>8.1f} {worst:>8.1f} {found!s:>13}")


if __name__ == "__main__":
    main()
