#!/usr/bin/env bash
# Times a new user's loop in a fresh clone (issue #15): make venv, make train, make eval, make gguf with the
# defaults (built-in SmolLM2), then dvc status and a second make train (must run nothing). Prints one line per
# step. LLAMA_CPP_CACHE=<dir> reuses a llama.cpp build (else the clone compiles it inside make gguf).
# Usage: bash bench/pipeline_timing.sh [repo (default: this checkout)] [clone dir (default: a new temp dir)]
set -uo pipefail
repo=${1:-$(cd "$(dirname "$0")/.." && pwd)}
dir=${2:-$(mktemp -d)/reprotune}
git clone -q "$repo" "$dir" && cd "$dir" || exit 2
logs=$(mktemp -d)
step() {
  local start rc; start=$(date +%s.%N)
  "$@" > "$logs/$(echo "$*" | tr ' /' '__').log" 2>&1; rc=$?
  printf '%-22s rc=%-3s %7.1f s\n' "$*" "$rc" "$(echo "$(date +%s.%N) - $start" | bc)"
}
echo "clone $dir at $(git rev-parse --short HEAD); load $(cut -d' ' -f1-3 /proc/loadavg); logs in $logs"
step make venv
step make train
step make eval
step make gguf
echo "dvc status: $(.venv/bin/dvc status 2>&1 | tail -1)"
step make train
sed -n '/GGUF parity/,/timings/p' "$logs/make_gguf.log"
