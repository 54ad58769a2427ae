#!/usr/bin/env bash
# `make gpu-check`: on a machine with one NVIDIA GPU, build the CUDA kernels for that GPU's
# architecture (sm_90 unless CUDA_ARCH says otherwise), run the gpu-labelled tests, then time
# every kernel against the measured device-to-device copy bandwidth and print the table.
# The table also goes to $OUT/gpu_check.md when OUT is set. Meant to finish within a few
# minutes; the build is the longest step.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
CUDA_ARCH=${CUDA_ARCH:-90}
JOBS=${JOBS:-$(nproc)}

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
command -v nvcc >/dev/null 2>&1 || { echo "gpu-check: nvcc not found" >&2; exit 1; }
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L || true

echo "== configure ($BUILD, sm_$CUDA_ARCH)"
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" -DTANDEM_ENGINE_CUDA=ON | grep -E "tandem: CUDA|Error" || true
grep -q '^CMAKE_CUDA_COMPILER:' "$BUILD/CMakeCache.txt" || { echo "gpu-check: CUDA not configured" >&2; exit 1; }

echo "== build"
cmake --build "$BUILD" -j "$JOBS" --target cuda_kernels_test cuda_kernel_bench kernel_refs_test \
  cuda_engine_test

echo "== gpu tests"
LOG=$(mktemp)
ctest --test-dir "$BUILD" -L gpu --output-on-failure -j 1 | tee "$LOG"
# Cases skip without a usable device (and the FP8 GEMM on GPUs older than sm_89): say so.
if grep -q "(Skipped)" "$LOG"; then
  echo "gpu-check: WARNING: some gpu tests were skipped (listed above)" >&2
fi
rm -f "$LOG"

echo "== kernel timings"
TABLE=$(mktemp)
"$BUILD/bin/cuda_kernel_bench" --out "$TABLE"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$TABLE" "$OUT/gpu_check.md"
  echo "table written to $OUT/gpu_check.md"
fi
rm -f "$TABLE"
