#!/usr/bin/env bash
# scripts/gpu_bundle.sh OUT: build tandem's CUDA configuration for sm_90 on a CPU machine and pack
# everything `make gpu-check GPU_BUNDLE=OUT` runs into one archive (at most 48 MiB), for a GPU
# machine that has the NVIDIA driver and the CUDA runtime but no compiler, package manager or
# network (docs/gpu.md).
#
# The archive (tandem-gpu/) holds:
#   bin/   tandem, the four services, cuda_kernel_bench, engine_bench and the gpu test binaries
#          (stripped);
#   lib/   every shared library they load beyond glibc, the CUDA driver and the CUDA runtime
#          (libcudart, libcublas/libcublasLt, libnccl: what the GPU machine's toolkit provides),
#          found with ldd;
#   data/  the tiny real model (stories260K) and the llama vocabulary `tandem synth` needs;
#   run.sh the runner (scripts/gpu_bundle_run.sh).
# Environment: BUILD (default build-gpu-bundle), CUDA_ARCH (default 90), JOBS (default 2),
# MODEL (the stories260K GGUF), VOCAB (the vocab GGUF folder). Builds take the shared build lock
# /tmp/tandem-build.lock when flock is present, so machines shared by several builds stay usable.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_bundle.sh OUT.tar.gz}
case "$OUT" in /*) ;; *) OUT="$PWD/$OUT" ;; esac
BUILD=${BUILD:-build-gpu-bundle}
CUDA_ARCH=${CUDA_ARCH:-90}
JOBS=${JOBS:-2}
MODEL=${MODEL:-$PWD/../shared/models/stories260K/stories260K.gguf}
VOCAB=${VOCAB:-$PWD/.cache/vocab}
LIMIT=$((48 << 20))

if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi
LOCK=()
if command -v flock >/dev/null 2>&1; then LOCK=(flock /tmp/tandem-build.lock); fi

echo "== configure $BUILD (sm_$CUDA_ARCH)"
"${LOCK[@]}" nice cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CUDA_ARCHITECTURES="$CUDA_ARCH" >"$BUILD.configure.log" 2>&1 || {
  cat "$BUILD.configure.log" >&2
  exit 1
}
grep -E "tandem: (CUDA|NCCL)" "$BUILD.configure.log" || true
grep -q "tandem: CUDA kernels for" "$BUILD.configure.log" || {
  echo "gpu_bundle: CUDA is not configured (see $BUILD.configure.log)" >&2
  exit 1
}

SERVICES="tandem tandem-router tandem-prefill tandem-decode tandem-kvstore"
BENCHES="cuda_kernel_bench engine_bench"
TESTS="cuda_kernels_test cuda_engine_test cuda_ipc_transport_test"
grep -q "NCCL transport enabled" "$BUILD.configure.log" && TESTS="$TESTS nccl_transport_test"
echo "== build"
"${LOCK[@]}" nice cmake --build "$BUILD" -j "$JOBS" --target $SERVICES $BENCHES $TESTS

STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
B="$STAGE/tandem-gpu"
mkdir -p "$B/bin" "$B/lib" "$B/data"
for t in $SERVICES $BENCHES $TESTS; do
  cp "$BUILD/bin/$t" "$B/bin/"
  strip --strip-unneeded "$B/bin/$t"
done

# Libraries the GPU machine provides itself: glibc, the CUDA driver, the CUDA runtime.
provided() {
  case "$1" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libpthread.so* | libdl.so* | \
      librt.so* | libutil.so* | libresolv.so* | libanl.so* | libmvec.so* | libnsl.so*) return 0 ;;
    libcuda.so* | libnvidia-*.so*) return 0 ;;
    libcudart.so* | libcublas.so* | libcublasLt.so* | libnccl.so* | libnvJitLink.so* | \
      libnvrtc.so*) return 0 ;;
  esac
  return 1
}
echo "== libraries (ldd)"
for f in "$B"/bin/*; do
  ldd "$f" | awk '/=>/ { print $1, $3 }'
done | sort -u | while read -r name path; do
  if provided "$name"; then continue; fi
  if [ "$path" = "not" ] || [ ! -e "$path" ]; then
    echo "gpu_bundle: $name is not found on this machine" >&2
    exit 1
  fi
  cp -L "$path" "$B/lib/$name"
  strip --strip-unneeded "$B/lib/$name" 2>/dev/null || true
done
# UCX loads its transport modules with dlopen from <libucs dir>/ucx/ (ldd cannot see them):
# carry the shared-memory one (cma); the others need InfiniBand libraries a single node lacks.
UCS=$(ldd "$B/bin/tandem-decode" | awk '/libucs.so/ { print $3 }')
if [ -n "$UCS" ] && [ -e "$(dirname "$UCS")/ucx/libuct_cma.so.0" ]; then
  mkdir -p "$B/lib/ucx"
  cp -L "$(dirname "$UCS")/ucx/libuct_cma.so.0" "$B/lib/ucx/"
fi
ls "$B/lib"

[ -f "$MODEL" ] && cp "$MODEL" "$B/data/stories260K.gguf" || echo "gpu_bundle: no $MODEL (the engine comparison on a real model will be skipped)" >&2
cp "$VOCAB/ggml-vocab-llama-bpe.gguf" "$B/data/"
cp scripts/gpu_bundle_run.sh "$B/run.sh"
chmod +x "$B/run.sh"
git rev-parse HEAD >"$B/COMMIT" 2>/dev/null || echo unknown >"$B/COMMIT"

mkdir -p "$(dirname "$OUT")"
tar -C "$STAGE" -czf "$OUT" tandem-gpu
SIZE=$(stat -c %s "$OUT")
echo "gpu_bundle: $OUT: $SIZE bytes ($((SIZE >> 20)) MiB; limit 48 MiB)"
if [ "$SIZE" -gt "$LIMIT" ]; then
  echo "gpu_bundle: the archive is over 48 MiB" >&2
  exit 1
fi
