#!/usr/bin/env bash
# Make data/raw match data.dvc exactly: pull it from the DVC remote when one is configured and has it,
# otherwise regenerate the built-in dataset deterministically; either way DVC then verifies the hash.
set -euo pipefail
cd "$(dirname "$0")/.."
DVC=${DVC:-.venv/bin/dvc}
PY=${PY:-.venv/bin/python}

up_to_date() {
  # A fresh clone has no DVC cache: data that matches data.dvc then shows as "not in cache" (changed data shows
  # "modified"); caching it ('dvc commit' leaves data.dvc as it is when the hash matches) makes it up to date.
  if "$DVC" status data.dvc 2>/dev/null | grep -q "data/raw: *not in cache\|not in cache: *data/raw"; then
    "$DVC" commit -q -f data.dvc
  fi
  "$DVC" status data.dvc 2>/dev/null | grep -q "up to date"
}

if [ -d data/raw ] && up_to_date; then exit 0; fi
if [ -n "$("$DVC" remote list 2>/dev/null)" ] && "$DVC" pull -q data.dvc 2>/dev/null && up_to_date; then
  echo "data: pulled data/raw from the DVC remote"; exit 0
fi
if [ -d data/raw ] && [ -n "$(ls -A data/raw)" ] && [ ! -f data/raw/invoices.jsonl ]; then
  echo "data: data/raw holds your own files but does not match data.dvc; run 'dvc add data/raw && mv data/raw.dvc data.dvc'" >&2
  echo "      (or 'dvc commit data.dvc') to version them" >&2
  exit 1
fi
"$PY" -m reprotune.invoices --out data/raw/invoices.jsonl --n 600 --seed 1234
if ! up_to_date; then
  echo "data: regenerated data/raw does not match data.dvc (generator or environment changed):" >&2
  "$DVC" status data.dvc >&2
  exit 1
fi
echo "data: regenerated data/raw; its hash matches data.dvc"
