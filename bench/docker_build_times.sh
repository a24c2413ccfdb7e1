#!/usr/bin/env bash
# Build timings of the reprotune image, printed as a table: cold (no layers, no pip cache, llama.cpp compiled in the
# image), cached (nothing changed), code change (src/ touched: only the project layers), --no-cache rebuild (pip
# downloads cached; llama.cpp reused from the host's identical build when there is one), the smoke train and
# merge + gguf in the container with --network=none, and the image size.
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
  timed "cold build (empty caches, llama.cpp compiled)" env LLAMA_CPP_SEED=0 bash scripts/docker_build.sh
fi
timed "cached build (nothing changed)" bash scripts/docker_build.sh
touch_file=src/reprotune/__init__.py
cp -p "$touch_file" "/tmp/reprotune-bench-init.py"
echo "# bench $(date +%s%N)" >> "$touch_file"
timed "code change (src/ edited)" bash scripts/docker_build.sh
cp -p "/tmp/reprotune-bench-init.py" "$touch_file"
timed "--no-cache rebuild (pip downloads cached)" env DOCKER_BUILD_FLAGS=--no-cache bash scripts/docker_build.sh
timed "--no-cache rebuild of /opt/venv (--target env)" env DOCKER_BUILD_FLAGS="--no-cache --target env" \
  REPROTUNE_IMAGE="$REPROTUNE_IMAGE-env" bash scripts/docker_build.sh
"$DOCKER" image rm "$REPROTUNE_IMAGE-env" >/dev/null

ws=$(mktemp -d)
trap 'rm -rf "$ws"' EXIT
git ls-files -co --exclude-standard -z | xargs -0 -I{} cp --parents {} "$ws/" 2>/dev/null || true
(cd "$ws" && git init -q && git add -A && git -c user.email=b@b -c user.name=b commit -qm bench)
timed "make test-smoke RUNNER=docker --network=none" \
  make -C "$ws" test-smoke RUNNER=docker VARIANT="$VARIANT" DOCKER_RUN_FLAGS=--network=none
timed "make merge gguf RUNNER=docker --network=none" \
  make -C "$ws" merge gguf RUNNER=docker VARIANT="$VARIANT" DOCKER_RUN_FLAGS=--network=none \
  ARGS="model=tiny_random export.quant=[Q8_0] export.parity.greedy_prompts=2 export.parity.max_new_tokens=8 export.merge.prompts=2"

size=$("$DOCKER" image inspect -f '{{.Size}}' "$REPROTUNE_IMAGE" | awk '{printf "%.2f GB", $1/1e9}')
echo
printf '%-44s %10s\n' "reprotune:$VARIANT ($(nproc) cores)" "time"
printf '%s\n' "${rows[@]}"
printf '%-44s %10s\n' "image size (uncompressed)" "$size"
