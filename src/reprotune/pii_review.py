"""make pii-review: print a sample of the PII replacements prepare would make, each in its context, so a
person can check them before training (false positives cost answers, misses cost privacy).

    python -m reprotune.pii_review [hydra overrides]      e.g. data.path=my_chats.jsonl data.pii.review_sample=60
    make pii-review ARGS="data.path=<file or folder>"

Prints to the terminal only: originals are personal data, so nothing is written to a file.
"""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

import hydra
from omegaconf import DictConfig

from reprotune.config import CONF_DIR
from reprotune.errors import user_errors
from reprotune.formats import read_dataset
from reprotune.run import resolve


def one_line(text: str) -> str:
    return text.replace("\n", "⏎ ")


def review(cfg: DictConfig, out: object = sys.stdout) -> list[dict]:
    """Scrub the dataset in memory and print a seeded sample of its replacements; returns the sample."""
    from reprotune.pii import scrub_records

    data = cfg.data
    files = read_dataset(Path(data.path), str(data.format), str(data.get("extra_keys", "drop")),
                         str(data.get("on_invalid", "error")))
    records = [r for f in files for r in f.records]
    trace: list[dict] = []
    scrub_records(records, cfg, trace=trace)
    n = int(data.pii.get("review_sample", 40))
    sample = sorted(random.Random(int(data.pii.seed)).sample(range(len(trace)), min(n, len(trace))))
    counts = Counter(t["entity"] for t in trace)
    print(f"{len(trace)} replacements in {len(records)} examples "
          f"({', '.join(f'{k} {v}' for k, v in sorted(counts.items())) or 'none'}); {len(sample)} shown:", file=out)
    for i in sample:
        t = trace[i]
        where = f"{records[t['example']].file}:{records[t['example']].line}"
        print(f"  {where}  {t['entity']}\n    …{one_line(t['before'])}[{t['original']} -> {t['fake']}]"
              f"{one_line(t['after'])}…", file=out)
    print("Wrong ones? Keep terms with data.pii.allow=[...]; PII left in? see docs/data.md (what is detected).",
          file=out)
    return [trace[i] for i in sample]


@hydra.main(version_base=None, config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    with user_errors(summary="pii-review: {count} problem(s)"):
        resolve(cfg, "pii_review")  # the door: the config makes a run (the review takes nothing else from it yet)
        review(cfg)


if __name__ == "__main__":
    main()
