#!/usr/bin/env bash
# make docker-build: build docker/Dockerfile for VARIANT=cpu|cuda as reprotune:<variant>.
#
# Environment (all optional):
#   REPROTUNE_IMAGE        tag (default reprotune:$VARIANT)
#   REPROTUNE_DOCKER_BASE  replaces the pinned base (CI: reprotune-base:bookworm from scripts/docker_engine.sh)
#   CA_BUNDLE              CA bundle of a TLS-intercepting proxy, passed as the BuildKit secret 'cabundle' (default:
#                          the bundle the host's pip/requests already trust: PIP_CERT, SSL_CERT_FILE, REQUESTS_CA_BUNDLE)
#   LLAMA_CPP=0            build the image without llama.cpp's tools (scripts/build_llama_cpp.sh)
#   LLAMA_CPP_SEED=0       compile llama.cpp in the image even when the host has the same build (see below)
#   DOCKER_BUILD_FLAGS     extra flags for docker build (e.g. --no-cache, --progress=plain)
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT=${VARIANT:-cpu}
DOCKER=${DOCKER:-docker}
TAG=${REPROTUNE_IMAGE:-reprotune:$VARIANT}
lock="lockfiles/$VARIANT.txt"
[ -f "$lock" ] || { echo "docker-build: no lockfile $lock (VARIANT=cpu|cuda)" >&2; exit 2; }

# Wheels the lock pins that PyPI does not serve (local versions such as torch==2.13.0+cpu): copy them from what
# the host's pip configuration reaches (find-links, a mirror) into the build context, hash-checked. When the host
# has none, the build gets them from the PyTorch index instead, with the same locked hashes.
mkdir -p build/wheelhouse
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
awk '/^[A-Za-z0-9]/ {keep = ($1 ~ /==[^ ]*\+/)} keep' "$lock" > "$tmp/local-versions.txt"
if [ -s "$tmp/local-versions.txt" ]; then
  if python3 -m pip download --quiet --no-index --no-deps --require-hashes --disable-pip-version-check \
       -r "$tmp/local-versions.txt" -d build/wheelhouse >/dev/null 2>&1; then
    echo "docker-build: build/wheelhouse has $(grep -o '^[^ ]*==[^ ]*' "$tmp/local-versions.txt" | tr '\n' ' ')(from the host's pip configuration)"
  else
    echo "docker-build: the host's pip cannot supply $(grep -o '^[^ ]*==[^ ]*' "$tmp/local-versions.txt" | tr '\n' ' ')locally; the build downloads it from the PyTorch index" >&2
  fi
fi

# The host's llama.cpp builds (make llama-cpp) go to the build as build/llama-cpp-seed: the image reuses one only
# when it was built from the same sdist with the same flags, Python, glibc and compiler (build_llama_cpp.sh checks),
# which saves its compile (minutes); otherwise the image compiles its own.
rm -rf build/llama-cpp-seed && mkdir -p build/llama-cpp-seed
host_cache=${LLAMA_CPP_CACHE:-.cache/llama-cpp}
if [ "${LLAMA_CPP:-1}" = 1 ] && [ "${LLAMA_CPP_SEED:-1}" = 1 ] && [ -d "$host_cache" ]; then
  for built in "$host_cache"/*/done; do
    [ -f "$built" ] || continue
    d=$(dirname "$built")
    cp -al "$d" build/llama-cpp-seed/ 2>/dev/null || cp -a "$d" build/llama-cpp-seed/
    echo "docker-build: offering the host's llama.cpp build $(basename "$d") ($(cat "$d/toolchain" 2>/dev/null || echo 'compiler unknown'))"
  done
fi

args=(--build-arg "VARIANT=$VARIANT" --build-arg "LLAMA_CPP=${LLAMA_CPP:-1}")
[ -n "${REPROTUNE_DOCKER_BASE:-}" ] && args+=(--build-arg "BASE_IMAGE=$REPROTUNE_DOCKER_BASE")
ca=${CA_BUNDLE-${PIP_CERT:-${SSL_CERT_FILE:-${REQUESTS_CA_BUNDLE:-}}}}
if [ -n "$ca" ]; then
  [ -f "$ca" ] || { echo "docker-build: CA_BUNDLE=$ca: no such file" >&2; exit 2; }
  args+=(--secret "id=cabundle,src=$ca")
fi
# Installed bytes depend only on the lock: its commit time is the build's SOURCE_DATE_EPOCH.
epoch=$(git log -1 --format=%ct -- "$lock" 2>/dev/null || true)
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
[ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && commit="$commit-dirty"
created=$(date -u -d "@$(git log -1 --format=%ct 2>/dev/null || echo 0)" +%FT%TZ)
lock_sha=$(cat "$lock" lockfiles/builtin-model.txt | sha256sum | cut -d' ' -f1)
args+=(--build-arg "SOURCE_DATE_EPOCH=${epoch:-1767225600}" --build-arg "GIT_COMMIT=$commit"
       --build-arg "LOCK_SHA256=$lock_sha" --build-arg "CREATED=$created")

echo "docker-build: $TAG (variant $VARIANT, base ${REPROTUNE_DOCKER_BASE:-pinned debian:12.12-slim}, llama.cpp tools ${LLAMA_CPP:-1})"
# shellcheck disable=SC2086  # DOCKER_BUILD_FLAGS is a list of flags
DOCKER_BUILDKIT=1 "$DOCKER" build -f docker/Dockerfile -t "$TAG" "${args[@]}" ${DOCKER_BUILD_FLAGS:-} .
echo "docker-build: $TAG = $("$DOCKER" image inspect -f '{{.Id}}' "$TAG"), $("$DOCKER" image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.2f GB", $1/1e9}')"
