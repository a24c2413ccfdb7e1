#!/usr/bin/env bash
# Build (or reuse) the pinned llama.cpp used by 'make gguf' and 'make serve'.
#
# llama.cpp comes from the llama-cpp-python sdist on PyPI, checked against the sha256 in
# lockfiles/llama-cpp.txt. From that one source tree we use:
#   - the llama-cpp-python wheel (libllama + Python bindings, also llama_model_quantize and the server),
#     built without -march=native (-DGGML_NATIVE=OFF), CPU kernels for x86-64-v3 where the CPU has it (below),
#     with the hash-locked tools of lockfiles/llama-cpp-build.txt, and without llama.cpp's common/ library
#     (scripts/llama_cpp_project.cmake: nothing here loads it);
#   - llama-imatrix and llama-quantize, compiled in the wheel's build tree after it and linked against the same
#     libllama and libggml (the tools and the libraries they load in $dir/tools/bin, run path $ORIGIN);
#   - vendor/llama.cpp/convert_hf_to_gguf.py with its own vendored gguf-py.
# Results are cached under $LLAMA_CPP_CACHE/<version>-<key>, key = sdist sha256 + build flags + Python minor
# version + glibc, so a rerun (or a rebuilt .venv) only reinstalls the cached wheel. The compiler that built it is
# recorded in <dir>/toolchain.
# LLAMA_CPP_COMPILE_ONLY=1 fills the cache and installs nothing (see below).
# LLAMA_CPP_SEED=<dir> (docker build): a cache directory made elsewhere is reused instead of compiling when its key
# and its recorded compiler are the same as here (same sdist, flags, Python, glibc, compiler; README says which
# libraries come out byte-identical: bench/llama_cpp_build_identity.sh).
# Prints the source dir on the last line of stdout.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
CACHE=${LLAMA_CPP_CACHE:-.cache/llama-cpp}
mkdir -p "$CACHE" && CACHE=$(cd "$CACHE" && pwd)   # absolute: the image keeps it in /opt/llama.cpp
PYTHON="$VENV/bin/python"   # not python3: an image has Python only in its venv
LOCK=lockfiles/llama-cpp.txt
# GGML_NATIVE=OFF: no -march=native, so the bytes do not depend on the machine that compiles. LLAMA_OPENSSL=OFF:
# llama.cpp's HTTPS model downloader is never used here, and with it ON the build would depend on whether the machine
# happens to have libssl-dev (it changes libllama-common).
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DLLAMA_OPENSSL=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
# CPU kernels (ggml-cpu only; docs/export.md). On x86-64, NATIVE=OFF alone compiles them without any SIMD: the parity
# step's F16 greedy took 130-150 s per prompt. So a fixed set, x86-64-v3 (Haswell/Zen and later; ggml's own "haswell"
# variant), when this CPU has it: the same flags, hence the same bytes, on every such machine. ggml's runtime choice
# (GGML_BACKEND_DL + GGML_CPU_ALL_VARIANTS) is not usable here: llama-cpp-python 0.3.36 neither packages the
# libggml-cpu-<variant>.so modules nor loads them. aarch64: NEON is part of the base ISA, so the default build already
# has SIMD there and the x86 flags do not apply. LLAMA_CPP_CPU=portable forces the baseline (an image for older CPUs).
X86_64_V3_FLAGS="-DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_F16C=ON -DGGML_FMA=ON -DGGML_AVX2=ON -DGGML_BMI2=ON"
X86_64_V3_CPUINFO="sse4_2 avx f16c fma avx2 bmi2"   # the same features as /proc/cpuinfo names them
cpu_lacks() {  # the x86-64-v3 features this CPU lacks (all of them on another architecture); tests fake the cpuinfo
  local have missing=()
  [ "$(uname -m)" = x86_64 ] || { echo "$X86_64_V3_CPUINFO"; return; }
  have=" $(grep -m1 '^flags' "${LLAMA_CPP_CPUINFO:-/proc/cpuinfo}" 2>/dev/null | cut -d: -f2) "
  for f in $X86_64_V3_CPUINFO; do [[ "$have" == *" $f "* ]] || missing+=("$f"); done
  echo "${missing[*]}"
}
case "${LLAMA_CPP_CPU:-auto}" in
  auto)
    lacks=$(cpu_lacks)
    if [ -z "$lacks" ]; then CPU_LEVEL=x86-64-v3
    else
      CPU_LEVEL=portable
      [ "$(uname -m)" != x86_64 ] || echo "build_llama_cpp: this CPU lacks $lacks: llama.cpp is built without" \
        "x86 SIMD (portable; the GGUF parity step then takes minutes per prompt)" >&2
    fi ;;
  portable|x86-64-v3) CPU_LEVEL=$LLAMA_CPP_CPU ;;
  *) echo "build_llama_cpp: LLAMA_CPP_CPU must be auto, x86-64-v3 or portable, not '$LLAMA_CPP_CPU'" >&2; exit 2 ;;
esac
[ "$CPU_LEVEL" = portable ] || CMAKE_FLAGS="$CMAKE_FLAGS $X86_64_V3_FLAGS"

pin=$(grep -o '^llama-cpp-python==[^ ]*' "$LOCK")
version=${pin#llama-cpp-python==}
sha=$(grep -A1 '^llama-cpp-python==' "$LOCK" | grep -o 'sha256:[0-9a-f]*' | head -1 | cut -d: -f2)
[ -n "$sha" ] || { echo "build_llama_cpp: no sha256 for llama-cpp-python in $LOCK" >&2; exit 2; }
platform=$("$PYTHON" -c 'import platform, sys; print(sys.version_info[:2], platform.machine(), platform.libc_ver())')
# v2: the build maps its own paths to fixed names (-ffile-prefix-map), so the binaries do not depend on where
# the cache is (__FILE__ in ggml's asserts would otherwise embed it)
# the project include (common/ and the tools out of the wheel's target, scripts/llama_cpp_project.cmake) is part of
# the build, so of the key
PROJECT_INCLUDE=$PWD/scripts/llama_cpp_project.cmake
key=$(printf '%s %s %s %s %s' "$sha" "$CMAKE_FLAGS" "$platform" "paths-v2" "$(sha256sum < "$PROJECT_INCLUDE")" \
  | sha256sum | cut -c1-16)
dir="$CACHE/$version-$key"
src="$dir/src/llama_cpp_python-$version"

log() { echo "build_llama_cpp: $*" >&2; }
toolchain() { "${CXX:-c++}" --version 2>/dev/null | head -1; }
need_compiler() {
  command -v "${CXX:-c++}" >/dev/null || { log "no C++ compiler (${CXX:-c++}); install g++ (Debian: apt-get install g++)"; exit 1; }
}
# Into a fresh work dir $1 (with dl/ and src/): the pinned sdist, unpacked in $1/src, and $1/buildenv, a venv with the
# hash-locked build tools. --require-hashes: pip refuses an sdist whose sha256 differs from the lock. Source-only for
# this package alone: ':all:' would also force pip's metadata build environment (scikit-build-core...) from source.
# The build venv's pip is the interpreter's bundled one (Debian's python3.11: pip 23.0.1, no -C short option).
fetch_source() {
  local at=$1
  log "fetching $pin (sdist, sha256 $sha) and the build tools of lockfiles/llama-cpp-build.txt"
  printf '%s --hash=sha256:%s\n' "$pin" "$sha" > "$at/req.txt"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
    --require-hashes -r "$at/req.txt" -d "$at/dl"
  tar -xzf "$at/dl/llama_cpp_python-$version.tar.gz" -C "$at/src"
  "$PYTHON" -m venv "$at/buildenv"
  "$at/buildenv/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps \
    -r lockfiles/llama-cpp-build.txt
}
# After the compile only the converter is needed from the source tree (176 MB of docs, test vocabularies and C++
# sources otherwise stay in the cache and in the image): convert_*.py, its conversion/ package, gguf-py, licenses.
prune_source() {
  local top=$1 keep
  find "$top" -mindepth 1 -maxdepth 1 ! -name vendor ! -name LICENSE.md -exec rm -rf {} +
  find "$top/vendor" -mindepth 1 -maxdepth 1 ! -name llama.cpp -exec rm -rf {} +
  keep='^(convert_[a-z_]+\.py|conversion|gguf-py|LICENSE|licenses|requirements|requirements\.txt|pyproject\.toml)$'
  for entry in "$top/vendor/llama.cpp"/* "$top/vendor/llama.cpp"/.[!.]*; do
    [ -e "$entry" ] || continue
    basename "$entry" | grep -qE "$keep" || rm -rf "$entry"
  done
}

# The two llama.cpp tools 'make gguf' runs as programs: llama-imatrix (the importance matrix of the training data;
# it needs llama.cpp's common/ library, which the wheel leaves out) and llama-quantize (it reads the imatrix file
# with common's loader). Built in the wheel's build tree $1/build (scripts/llama_cpp_project.cmake declares them
# there, outside the wheel's target): only common/, cpp-httplib and the two tools compile; they link against the
# libllama and libggml the wheel ships. Each tool and every library of that tree it loads go to $1/tools/bin.
build_tools() {
  local at=$1 t0 lib
  t0=$(date +%s)
  log "compiling llama-imatrix and llama-quantize in the same build tree (common/ and the tools only)"
  # shellcheck disable=SC2086  # CMAKE_FLAGS is a list of -D flags
  if ! { PATH="$at/buildenv/bin:$PATH" SOURCE_DATE_EPOCH=1767225600 GIT_CEILING_DIRECTORIES="$at" \
      cmake -S "$at/src/llama_cpp_python-$version" -B "$at/build" $CMAKE_FLAGS -DREPROTUNE_LLAMA_TOOLS=ON \
      -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    && PATH="$at/buildenv/bin:$PATH" SOURCE_DATE_EPOCH=1767225600 GIT_CEILING_DIRECTORIES="$at" \
      cmake --build "$at/build" --parallel "$(nproc)" --target llama-imatrix llama-quantize; } \
      > "$at/tools-build.log" 2>&1; then
    tail -40 "$at/tools-build.log" >&2
    log "llama.cpp tools build failed; full log: $at/tools-build.log"; exit 1
  fi
  mkdir -p "$at/tools/bin"
  find "$at/build" -type f \( -name llama-imatrix -o -name llama-quantize \) -exec cp {} "$at/tools/bin/" \;
  # the libraries by their file names and sonames (cp -a keeps the links), found by what the tools ask for
  for lib in $(LD_LIBRARY_PATH=$(find "$at/build" -name '*.so*' -printf '%h\n' | sort -u | paste -sd:) \
      ldd "$at/tools/bin/llama-imatrix" "$at/tools/bin/llama-quantize" | awk -v b="$at/build/" 'index($3, b) == 1 {print $3}' | sort -u); do
    cp -a "$(dirname "$lib")/$(basename "$lib" | sed 's/\.so.*/.so/')"* "$at/tools/bin/"
  done
  if ldd "$at/tools/bin/llama-imatrix" "$at/tools/bin/llama-quantize" | grep -q "not found"; then
    ldd "$at/tools/bin/llama-imatrix" "$at/tools/bin/llama-quantize" >&2
    log "llama.cpp tools: a library is missing next to them in $at/tools/bin"; exit 1
  fi
  echo "$(( $(date +%s) - t0 ))" > "$at/tools/build_seconds"
  touch "$at/tools/done"
  log "built the tools in $(( $(date +%s) - t0 )) s: $(ls "$at/tools/bin" | paste -sd' ')"
}

if [ "$CPU_LEVEL" = x86-64-v3 ] && [ -n "$(cpu_lacks)" ]; then  # it would die of SIGILL at the first AVX2 instruction
  log "LLAMA_CPP_CPU=x86-64-v3, but this CPU lacks $(cpu_lacks): use LLAMA_CPP_CPU=auto or portable"; exit 1
fi
if [ ! -f "$dir/done" ] && [ "$CPU_LEVEL" = portable ] && grep -qsx x86-64-v3 "$CACHE"/"$version"-*/cpu_level; then
  log "the llama.cpp build in $CACHE needs an x86-64-v3 CPU ($X86_64_V3_CPUINFO) and this one lacks" \
    "$(cpu_lacks): it needs a portable build (LLAMA_CPP_CPU=portable; an image: rebuild it on such a CPU)"
fi
if [ -f "$CACHE/NOT-BUILT" ] && [ ! -f "$dir/done" ]; then
  log "$(cat "$CACHE/NOT-BUILT"): rebuild it with llama.cpp (make docker-build, LLAMA_CPP=1 is the default)"; exit 1
fi
seed="${LLAMA_CPP_SEED:-}/$version-$key"
if [ ! -f "$dir/done" ] && [ -n "${LLAMA_CPP_SEED:-}" ] && [ -f "$seed/done" ]; then
  if [ "$(cat "$seed/toolchain" 2>/dev/null)" = "$(toolchain)" ]; then
    log "reusing the build in $seed (same sdist, flags, Python, glibc and compiler: $(toolchain))"
    rm -rf "$dir.tmp" && cp -a "$seed" "$dir.tmp" && rm -rf "$dir" && mv "$dir.tmp" "$dir"
  else
    log "not reusing $seed: built with '$(cat "$seed/toolchain" 2>/dev/null)', here '$(toolchain)'"
  fi
fi

if [ ! -f "$dir/done" ]; then
  need_compiler
  rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/dl" "$dir.tmp/src" "$dir.tmp/wheel"
  fetch_source "$dir.tmp"
  log "compiling libllama ($CMAKE_FLAGS) on $(nproc) cores; takes minutes (ninja's [done/total] below)"
  start=$(date +%s)
  # the build venv's cmake and ninja come first on PATH: the same tools on every machine
  # the source and build trees get fixed names inside the binaries, and llama.cpp's build info must not pick up the
  # git commit of a repository the cache happens to sit in (GIT_CEILING_DIRECTORIES): the same bytes wherever built
  prefix_map="-ffile-prefix-map=$dir.tmp/src=/llama-cpp/src -ffile-prefix-map=$dir.tmp/build=/llama-cpp/build"
  PATH="$dir.tmp/buildenv/bin:$PATH" CMAKE_ARGS="$CMAKE_FLAGS -DCMAKE_PROJECT_llama.cpp_INCLUDE=$PROJECT_INCLUDE" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    CFLAGS="$prefix_map" CXXFLAGS="$prefix_map" SOURCE_DATE_EPOCH=1767225600 GIT_CEILING_DIRECTORIES="$dir.tmp" \
    "$dir.tmp/buildenv/bin/python" -m pip wheel -v --disable-pip-version-check --no-deps --no-build-isolation \
    --config-settings=cmake.verbose=false --config-settings=build-dir="$dir.tmp/build" \
    -w "$dir.tmp/wheel" "$dir.tmp/src/llama_cpp_python-$version" \
    > "$dir.tmp/build.log" 2>&1 &
  pid=$!
  # progress: ninja's step counter, one line every 20 s
  while kill -0 "$pid" 2>/dev/null; do
    sleep 20
    step=$(grep -oE '^\s*\[[0-9]+/[0-9]+\]' "$dir.tmp/build.log" | tail -1 | tr -d ' ' || true)
    log "  ${step:-configuring} ($(( $(date +%s) - start )) s)"
  done
  if ! wait "$pid"; then
    tail -40 "$dir.tmp/build.log" >&2
    log "wheel build failed; full log: $dir.tmp/build.log"; exit 1
  fi
  log "built the wheel in $(( $(date +%s) - start )) s: $(ls "$dir.tmp/wheel")"
  build_tools "$dir.tmp"
  echo "$(( $(date +%s) - start ))" > "$dir.tmp/build_seconds"
  rm -rf "$dir.tmp/buildenv" "$dir.tmp/dl" "$dir.tmp/build"
  prune_source "$dir.tmp/src/llama_cpp_python-$version"
  toolchain > "$dir.tmp/toolchain"
  echo "$CPU_LEVEL" > "$dir.tmp/cpu_level"
  touch "$dir.tmp/done"
  rm -rf "$dir" && mv "$dir.tmp" "$dir"
fi
[ -f "$dir/tools/done" ] || { log "$dir has no llama-imatrix/llama-quantize (an older layout): remove it and rerun"; exit 1; }

# LLAMA_CPP_COMPILE_ONLY=1: stop at the cache. .ci/run compiles while the project's venv is still being built (VENV
# is then a bare venv of the same interpreter, so the key above is the same) and installs later with make llama-cpp.
if [ "${LLAMA_CPP_COMPILE_ONLY:-0}" = 1 ]; then echo "$src/vendor/llama.cpp"; exit 0; fi
# Install into the venv when it lacks this exact build (a rebuilt .venv only costs a reinstall).
wheel=$(ls "$dir"/wheel/llama_cpp_python-*.whl)
stamp="$VENV/.llama-cpp-$version-$key-$(sha256sum "$LOCK" | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  log "installing $(basename "$wheel") (+ lockfiles/llama-cpp.txt) into $VENV"
  [ -w "$VENV" ] || { log "$VENV is read-only and lacks this llama.cpp build (an image from another lockfiles/llama-cpp.txt?): rebuild it (make docker-build)"; exit 1; }
  # every pin but llama-cpp-python itself (its entry runs until the line without a trailing backslash)
  awk '/^llama-cpp-python==/{skip=1} !skip && !/^#/{print} skip && !/\\$/{skip=0}' "$LOCK" > "$dir/server-req.txt"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r "$dir/server-req.txt"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall "$wheel"
  rm -f "$VENV"/.llama-cpp-* && touch "$stamp"
fi
echo "$src/vendor/llama.cpp"
