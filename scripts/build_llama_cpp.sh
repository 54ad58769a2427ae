#!/usr/bin/env bash
# Builds the reference llama.cpp (the exact source shipped in node-llama-cpp@3.21.1) plus our
# tests/fidelity/llama_ref program, into a cache folder outside the repo so that `make clean`
# and fresh checkouts do not pay the 10-20 minute build again.
#
#   scripts/build_llama_cpp.sh            # prints nothing but progress; idempotent
#   TANDEM_LLAMA_CACHE=/path scripts/build_llama_cpp.sh
#   TANDEM_LLAMA_JOBS=1 scripts/build_llama_cpp.sh
#
# Layout of the cache:
#   src/                  clone of the bundle at its HEAD revision
#   build/bin/            llama-server, llama-bench, llama-cli, llama-completion, lib*.so
#   .built-<rev>          stamp: llama.cpp at <rev> is fully built
#   ref-<key>/bin/llama_ref  our reference decoder, one build per repo checkout (<key> hashes
#                         the checkout path, since a CMake build tree is tied to its source)
#
# Prints the path of llama_ref on its last line of stdout, for scripts that call it.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cache=${TANDEM_LLAMA_CACHE:-$HOME/.cache/tandem/llama.cpp}
jobs=${TANDEM_LLAMA_JOBS:-$(nproc)}
bundle="$here/.cache/npm/gitRelease.bundle"

log() { echo "build_llama_cpp: $*" >&2; }

# The bundle is fetched (and extracted from the npm tarball) by fetch_vocab.sh; reuse it.
if [ ! -f "$bundle" ]; then
  "$here/scripts/fetch_vocab.sh" >&2
fi
[ -f "$bundle" ] || { log "missing $bundle"; exit 1; }

rev=$(git bundle list-heads "$bundle" | awk '$2 == "HEAD" { print $1; exit }')
[ -n "$rev" ] || rev=$(git bundle list-heads "$bundle" | awk 'NR == 1 { print $1 }')
[ -n "$rev" ] || { log "cannot read the revision of $bundle"; exit 1; }

mkdir -p "$cache"
stamp="$cache/.built-$rev"
if [ ! -f "$stamp" ]; then
  start=$(date +%s)
  if [ "$(git -C "$cache/src" rev-parse HEAD 2>/dev/null || true)" != "$rev" ]; then
    log "cloning $rev"
    rm -rf "$cache/src"
    git clone -q "$bundle" "$cache/src"
    git -C "$cache/src" checkout -q "$rev"
  fi
  # Tools need LLAMA_BUILD_COMMON/TOOLS (on by default for a standalone build). The web UI is
  # neither built with npm nor downloaded: the machine may be offline, and we only use the API.
  launcher=()
  if command -v ccache >/dev/null; then
    launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  fi
  log "configuring in $cache/build"
  nice -n 10 cmake -S "$cache/src" -B "$cache/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_OPENSSL=OFF "${launcher[@]}" >&2
  log "building with -j$jobs (nice 10); this takes 10-20 minutes on 2 cores"
  nice -n 10 cmake --build "$cache/build" -j "$jobs" \
    --target llama llama-bench llama-server llama-cli llama-completion >&2
  rm -f "$cache"/.built-*
  touch "$stamp"
  log "llama.cpp $rev built in $(( $(date +%s) - start )) s"
fi

# Our reference program is tiny; cmake --build is a no-op when nothing changed.
key=$(printf '%s' "$here" | md5sum | cut -c1-10)
ref_build="$cache/ref-$key"
if [ ! -f "$ref_build/build.ninja" ]; then
  nice -n 10 cmake -S "$here/tests/fidelity" -B "$ref_build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_SRC_DIR="$cache/src" -DLLAMA_BUILD_DIR="$cache/build" >&2
fi
nice -n 10 cmake --build "$ref_build" -j "$jobs" >&2
echo "$ref_build/bin/llama_ref"
