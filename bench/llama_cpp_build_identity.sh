#!/usr/bin/env bash
# Is llama.cpp compiled inside the image the same build as the host's? (The premise of build/llama-cpp-seed:
# make docker-build offers the host's build to the image, which takes it only with the same sdist, flags, Python,
# glibc and compiler.) Builds the image with LLAMA_CPP_SEED=0 (llama.cpp compiled in the image, ~6-10 min on
# 2 cores), then prints the sha256 of every installed shared library, host vs image, as a table.
#
#   bash bench/llama_cpp_build_identity.sh        (needs an engine and the host build: make llama-cpp)
#   BENCH_BUILD=0 BENCH_IMAGE=<tag> ...            compare an image already built with LLAMA_CPP_SEED=0
set -euo pipefail
cd "$(dirname "$0")/.."
DOCKER=${DOCKER:-docker}
TAG=${BENCH_IMAGE:-reprotune:cpu-llama-compiled}
# the wheel's shared libraries: llama_cpp/lib (what the Python bindings load) and lib/ (llama.cpp's own install)
site=$(.venv/bin/python -c 'import llama_cpp, os; print(os.path.dirname(os.path.dirname(llama_cpp.__file__)))')
if [ "${BENCH_BUILD:-1}" = 1 ]; then
  LLAMA_CPP_SEED=0 REPROTUNE_IMAGE=$TAG VARIANT=cpu bash scripts/docker_build.sh > /tmp/reprotune-llama-identity.log 2>&1 \
    || { echo "build failed: /tmp/reprotune-llama-identity.log" >&2; exit 1; }
fi
image_sums=$("$DOCKER" run --rm --network=none --entrypoint bash "$TAG" -c \
  'cd /opt/venv/lib/python3.11/site-packages && sha256sum llama_cpp/lib/*.so.*.* lib/*.so.*.*')
printf '%-40s %-18s %-18s %s\n' library host image same
same=0 total=0
for f in "$site"/llama_cpp/lib/*.so.*.* "$site"/lib/*.so.*.*; do
  name=${f#"$site"/}
  h=$(sha256sum "$f" | cut -c1-16)
  i=$(awk -v n="$name" '$2 == n {print substr($1, 1, 16)}' <<< "$image_sums")
  total=$((total + 1)); [ "$h" = "$i" ] && same=$((same + 1))
  printf '%-40s %-18s %-18s %s\n' "$name" "$h" "${i:-missing}" "$([ "$h" = "$i" ] && echo yes || echo NO)"
done
echo "$same of $total shared libraries byte-identical (host compiler: $(c++ --version | head -1))"
[ "${BENCH_BUILD:-1}" = 1 ] && "$DOCKER" image rm "$TAG" >/dev/null
exit 0
