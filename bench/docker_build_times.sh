#!/usr/bin/env bash
# Build timings of the reprotune image, printed as a table: cold (no layers, no pip cache), cached (nothing changed),
# code change (src/ touched: only the project layers), --no-cache rebuild (pip downloads cached), the smoke train in
# the container with --network=none, and the image size.
#
#   bash bench/docker_build_times.sh [cpu|cuda]        (needs an engine: eval "$(bash scripts/docker_engine.sh start)")
#   BENCH_COLD=0 skips the cold build (it empties the BuildKit cache, pip's download cache included).
# Uses REPROTUNE_DOCKER_BASE / CA_BUNDLE / LLAMA_CPP like make docker-build.
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=${1:-cpu}
DOCKER=${DOCKER:-docker}
export VARIANT DOCKER REPROTUNE_IMAGE=reprotune:$VARIANT-bench
rows=()

timed() {  # label, command...
  local label=$1 start end; shift
  start=$(date +%s.%N)
  "$@" > "/tmp/reprotune-bench-$VARIANT.log" 2>&1 || { echo "bench: '$label' failed, see /tmp/reprotune-bench-$VARIANT.log" >&2; exit 1; }
  end=$(date +%s.%N)
  rows+=("$(printf '%-44s %8.1f s' "$label" "$(awk -v s="$start" -v e="$end" 'BEGIN {print e - s}')")")
}

if [ "${BENCH_COLD:-1}" = 1 ]; then
  "$DOCKER" image rm -f "$REPROTUNE_IMAGE" >/dev/null 2>&1 || true
  "$DOCKER" builder prune -af >/dev/null
  timed "cold build (empty layer and pip caches)" bash scripts/docker_build.sh
fi
timed "cached build (nothing changed)" bash scripts/docker_build.sh
touch_file=src/reprotune/__init__.py
cp -p "$touch_file" "/tmp/reprotune-bench-init.py"
echo "# bench $(date +%s%N)" >> "$touch_file"
timed "code change (src/ edited)" bash scripts/docker_build.sh
cp -p "/tmp/reprotune-bench-init.py" "$touch_file"
timed "--no-cache rebuild (pip downloads cached)" env DOCKER_BUILD_FLAGS=--no-cache bash scripts/docker_build.sh

ws=$(mktemp -d)
trap 'rm -rf "$ws"' EXIT
git ls-files -co --exclude-standard -z | xargs -0 -I{} cp --parents {} "$ws/" 2>/dev/null || true
(cd "$ws" && git init -q && git add -A && git -c user.email=b@b -c user.name=b commit -qm bench)
timed "make test-smoke RUNNER=docker --network=none" \
  make -C "$ws" test-smoke RUNNER=docker VARIANT="$VARIANT" DOCKER_RUN_FLAGS=--network=none

size=$("$DOCKER" image inspect -f '{{.Size}}' "$REPROTUNE_IMAGE" | awk '{printf "%.2f GB", $1/1e9}')
echo
printf '%-44s %10s\n' "reprotune:$VARIANT ($(nproc) cores)" "time"
printf '%s\n' "${rows[@]}"
printf '%-44s %10s\n' "image size (uncompressed)" "$size"
