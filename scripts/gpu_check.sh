#!/usr/bin/env bash
# `make gpu-check GPU_BUNDLE=archive`: unpack a bundle made by `scripts/gpu_bundle.sh OUT` and run
# its runner, on a machine with one NVIDIA GPU that has only the driver and the CUDA runtime (no
# cmake, no compiler, no package manager). Prints one table (kernels against the measured
# device-to-device bandwidth, CUDA engine against CPU engine, a 1P+1D cluster over cuda_ipc
# against monolithic CUDA generate, llama-1b-shape throughput, the TTFT breakdown) and writes it
# to $OUT/gpu_check.md (OUT defaults to a fresh folder under /tmp). GPU_CHECK_ARGS=--smoke only
# checks that every binary starts and the gpu tests run (they skip without a device).
set -euo pipefail
BUNDLE=${GPU_BUNDLE:-${1:-}}
if [ -z "$BUNDLE" ]; then
  echo "gpu-check: give the bundle: make gpu-check GPU_BUNDLE=tandem-gpu.tar.gz" >&2
  echo "(build one on a CPU machine with: scripts/gpu_bundle.sh tandem-gpu.tar.gz)" >&2
  exit 2
fi
[ -f "$BUNDLE" ] || { echo "gpu-check: no such bundle: $BUNDLE" >&2; exit 2; }
DIR=$(mktemp -d /tmp/tandem-gpu-bundle.XXXXXX)
trap 'rm -rf "$DIR"' EXIT
tar -C "$DIR" -xzf "$BUNDLE"
OUT=${OUT:-$(mktemp -d /tmp/tandem-gpu-check.XXXXXX)}
# shellcheck disable=SC2086
"$DIR/tandem-gpu/run.sh" ${GPU_CHECK_ARGS:-} "$OUT"
