#!/usr/bin/env bash
# The runner of a GPU bundle (scripts/gpu_bundle.sh packs it as tandem-gpu/run.sh). Needs only
# bash, coreutils, the NVIDIA driver and the CUDA runtime (libcudart, libcublasLt, libnccl from
# the machine's CUDA toolkit): no compiler, no cmake, no package manager, no network.
#
#   run.sh [--smoke] [OUT_DIR]
#
# --smoke: every bundled binary answers --help and every gpu test binary runs (skipping with
# "no CUDA device" on a machine without a GPU): the check the CPU machines make of a bundle.
# Without it, the full check prints one table (and writes OUT_DIR/gpu_check.md), each part
# bounded by `timeout` so the whole run stays within about 8 minutes:
#   1. the gpu tests (kernels against CPU references, the CUDA engine against the CPU engine,
#      the cuda_ipc transport, NCCL where present);
#   2. each kernel's time against the measured device-to-device copy bandwidth;
#   3. CUDA engine tokens against the CPU engine's on the real tiny model (stories260K);
#   4. a 1P+1D cluster on one GPU over cuda_ipc, whose tokens must equal monolithic CUDA
#      `tandem generate`, with the TTFT breakdown from the workers' /metrics;
#   5. llama-1b-shape Q4_0, Q8_0, BF16 (tandem synth): decode tok/s at batch 1 and 32, prefill
#      tok/s at 512 and 4096 tokens.
# Exit status: 0 when every part passed, 1 otherwise.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SMOKE=0
if [ "${1:-}" = "--smoke" ]; then SMOKE=1; shift; fi
OUT=${1:-$(mktemp -d /tmp/tandem-gpu-check.XXXXXX)}
mkdir -p "$OUT"
BIN="$HERE/bin"
DATA="$HERE/data"
# The bundle's libraries first, then the machine's CUDA runtime wherever the toolkit put it.
CUDA_LIBS=""
for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" "${CUDA_HOME:-/usr/local/cuda}/lib" \
  /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && CUDA_LIBS="$CUDA_LIBS:$d"
done
export LD_LIBRARY_PATH="$HERE/lib$CUDA_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
FAIL=0
ROWS=()
row() { ROWS+=("| $1 | $2 | $3 |"); }

gtest_summary() {  # log -> "N passed, M skipped, K failed"
  local p s f
  p=$(grep -o '\[  PASSED  \] [0-9]*' "$1" | grep -o '[0-9]*$' || true)
  s=$(grep -o '\[  SKIPPED \] [0-9]*' "$1" | grep -o '[0-9]*$' || true)
  f=$(grep -o '\[  FAILED  \] [0-9]* test' "$1" | grep -o '[0-9]* ' || true)
  echo "${p:-0} passed, ${s:-0} skipped, ${f:-0} failed"
}

echo "== binaries (--help)"
for b in "$BIN"/*; do
  name=$(basename "$b")
  case "$name" in *_test) continue ;; esac
  if timeout 30 "$b" --help >"$OUT/$name.help" 2>&1; then
    echo "$name --help: ok ($(head -1 "$OUT/$name.help" | cut -c1-70))"
  else
    echo "$name --help: FAILED"; sed -n 1,5p "$OUT/$name.help"; FAIL=1
  fi
done

echo "== libraries"
# Every library a binary loads must come from the bundle, except glibc, the CUDA driver and the
# CUDA runtime, which the machine provides (scripts/gpu_bundle.sh packs the rest).
provided() {
  case "$1" in
    linux-vdso.so* | ld-linux*.so* | libc.so* | libm.so* | libpthread.so* | libdl.so* | \
      librt.so* | libutil.so* | libresolv.so* | libanl.so* | libmvec.so* | libnsl.so*) return 0 ;;
    libcuda.so* | libnvidia-*.so* | libcudart.so* | libcublas.so* | libcublasLt.so* | \
      libnccl.so* | libnvJitLink.so* | libnvrtc.so*) return 0 ;;
  esac
  return 1
}
LIBS_OK=1
for b in "$BIN"/*; do
  ldd "$b" | awk '/=>/ { print $1, $3 }' | while read -r name path; do
    if provided "$name"; then
      [ "$path" = "not" ] && echo "$(basename "$b"): $name (CUDA runtime/driver) not found on this machine"
      continue
    fi
    case "$path" in
      "$HERE"/lib/*) ;;
      *) echo "$(basename "$b"): $name resolves to $path, outside the bundle"; exit 1 ;;
    esac
  done || LIBS_OK=0
done
[ $LIBS_OK -eq 1 ] || FAIL=1
echo "libraries: $([ $LIBS_OK -eq 1 ] && echo "every one from the bundle or the machine's glibc/CUDA" || echo FAILED)"

echo "== gpu tests"
for t in "$BIN"/*_test; do
  name=$(basename "$t")
  timeout 240 "$t" >"$OUT/$name.log" 2>&1
  rc=$?
  sum=$(gtest_summary "$OUT/$name.log")
  skip_why=$(grep -ho 'no CUDA device\|a CUDA device is present\|needs two CUDA devices\|no FP8 tensor cores\|is absent' "$OUT/$name.log" | sort | uniq -c | sed 's/^ *//' | tr '\n' ';' | sed 's/;$//')
  echo "$name: rc $rc, $sum${skip_why:+ (skips: $skip_why)}"
  [ $rc -eq 0 ] || FAIL=1
  row "test $name" "$([ $rc -eq 0 ] && echo pass || echo FAIL)" "$sum${skip_why:+; skips: $skip_why}"
done
if [ $SMOKE -eq 1 ]; then
  echo "gpu-check --smoke: $([ $FAIL -eq 0 ] && echo ok || echo FAILED)"
  exit $FAIL
fi

command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L

echo "== kernel timings"
if timeout 120 "$BIN/cuda_kernel_bench" --out "$OUT/kernels.md" >"$OUT/kernel_bench.log" 2>&1; then
  cat "$OUT/kernels.md"
  row "kernel table" pass "$OUT/kernels.md (each kernel vs measured D2D bandwidth)"
else
  tail -5 "$OUT/kernel_bench.log"; FAIL=1; row "kernel table" FAIL "see kernel_bench.log"
fi

tokens_of() { tr -d ' \n' <"$1" | grep -o '"tokens":\[[^]]*\]' | head -1; }
PROMPT="Once upon a time"
if [ -f "$DATA/stories260K.gguf" ]; then
  echo "== CUDA engine vs CPU engine (stories260K, greedy)"
  M="$DATA/stories260K.gguf"
  timeout 60 "$BIN/tandem" generate --model "$M" --prompt "$PROMPT" --max-tokens 32 \
    --temperature 0 --seed 1 --threads 2 --json >"$OUT/gen_cpu.json" 2>"$OUT/gen_cpu.err"
  timeout 60 "$BIN/tandem" generate --model "$M" --prompt "$PROMPT" --max-tokens 32 \
    --temperature 0 --seed 1 --threads 2 --json --device cuda >"$OUT/gen_cuda.json" 2>"$OUT/gen_cuda.err"
  if [ -n "$(tokens_of "$OUT/gen_cuda.json")" ] && [ "$(tokens_of "$OUT/gen_cpu.json")" = "$(tokens_of "$OUT/gen_cuda.json")" ]; then
    row "CUDA vs CPU engine tokens" pass "32 greedy tokens equal (logits: cuda_engine_test)"
  else
    FAIL=1; row "CUDA vs CPU engine tokens" FAIL "see gen_cpu.json / gen_cuda.json / gen_cuda.err"
  fi

  echo "== 1P+1D over cuda_ipc on one GPU"
  PIDS=()
  cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
  trap cleanup EXIT
  wait_port() { for _ in $(seq 1 300); do [ -s "$1" ] && { cat "$1"; return 0; }; sleep 0.1; done; return 1; }
  "$BIN/tandem-router" --model "$M" --port 0 --port-file "$OUT/router.port" >"$OUT/router.log" 2>&1 &
  PIDS+=($!)
  RP=$(wait_port "$OUT/router.port") || { FAIL=1; echo "router did not start"; tail "$OUT/router.log"; }
  "$BIN/tandem-decode" --model "$M" --device cuda --transport cuda_ipc --router "127.0.0.1:$RP" \
    --port 0 --port-file "$OUT/decode.port" --metrics-port 19461 >"$OUT/decode.log" 2>&1 &
  PIDS+=($!)
  "$BIN/tandem-prefill" --model "$M" --device cuda --transport cuda_ipc --router "127.0.0.1:$RP" \
    --port 0 --port-file "$OUT/prefill.port" --metrics-port 19462 >"$OUT/prefill.log" 2>&1 &
  PIDS+=($!)
  wait_port "$OUT/decode.port" >/dev/null && wait_port "$OUT/prefill.port" >/dev/null || {
    FAIL=1; tail -3 "$OUT/decode.log" "$OUT/prefill.log"; }
  sleep 1  # registration heartbeat
  timeout 60 "$BIN/tandem" client --router "127.0.0.1:$RP" --prompt "$PROMPT" --max-tokens 32 \
    --temperature 0 --seed 1 --json >"$OUT/cluster.json" 2>"$OUT/cluster.err"
  if [ -n "$(tokens_of "$OUT/cluster.json")" ] && [ "$(tokens_of "$OUT/cluster.json")" = "$(tokens_of "$OUT/gen_cuda.json")" ]; then
    row "1P+1D cuda_ipc == CUDA generate" pass "32 greedy tokens equal"
  else
    FAIL=1; row "1P+1D cuda_ipc == CUDA generate" FAIL "see cluster.json / cluster.err / decode.log / prefill.log"
  fi
  # TTFT breakdown: the workers' histograms (seconds, sums over the request).
  scrape() { exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3 && cat <&3; exec 3>&-; }
  for p in 19461 19462; do scrape $p >"$OUT/metrics.$p.txt" 2>/dev/null; done
  ttft=$(grep -h '^tandem[:_]time_to_first_token_seconds_sum' "$OUT"/metrics.*.txt | head -1 | awk '{print $2}')
  xfer=$(grep -h '^tandem[:_]kv_transfer_seconds_sum' "$OUT"/metrics.*.txt | head -1 | awk '{print $2}')
  queue=$(grep -h '^tandem[:_]request_queue_time_seconds_sum' "$OUT"/metrics.*.txt | head -1 | awk '{print $2}')
  row "TTFT breakdown (s)" info "ttft ${ttft:-?}, queue ${queue:-?}, kv transfer ${xfer:-?}; client timings in cluster.json"
  cleanup; PIDS=()
else
  row "CUDA vs CPU engine / 1P+1D" FAIL "data/stories260K.gguf missing from the bundle"; FAIL=1
fi

echo "== llama-1b shape throughput (CUDA engine)"
med() { tr -d ' \n' <"$1" | grep -o "\"$2\":{[^}]*\"tokens_per_s\":{\"median\":[0-9.e+-]*" | grep -o '[0-9.e+-]*$'; }
for T in q4_0 q8_0 bf16; do
  G="$OUT/llama-1b-$T.gguf"
  if ! timeout 120 "$BIN/tandem" synth --shape llama-1b --type "$T" --out "$G" --vocab-dir "$DATA" >"$OUT/synth-$T.log" 2>&1; then
    FAIL=1; row "llama-1b $T" FAIL "synth failed (synth-$T.log)"; continue
  fi
  timeout 150 "$BIN/engine_bench" --model "$G" --device cuda --modes decode,batch,prefill --reps 2 \
    --n-gen 64 --n-seqs 32 --seq-prompt 32 --n-prefill 512 --batch-tokens 4096 >"$OUT/bench-$T-512.json" 2>"$OUT/bench-$T.err"
  timeout 90 "$BIN/engine_bench" --model "$G" --device cuda --modes prefill --reps 2 \
    --n-prefill 4096 --batch-tokens 4096 >"$OUT/bench-$T-4096.json" 2>>"$OUT/bench-$T.err"
  d1=$(med "$OUT/bench-$T-512.json" decode); d32=$(med "$OUT/bench-$T-512.json" batch)
  p512=$(med "$OUT/bench-$T-512.json" prefill); p4k=$(med "$OUT/bench-$T-4096.json" prefill)
  [ -n "$d1" ] && [ -n "$p4k" ] || FAIL=1
  row "llama-1b $T tok/s" "$([ -n "$d1" ] && echo pass || echo FAIL)" "decode b1 ${d1:-?}, b32 ${d32:-?}; prefill 512 ${p512:-?}, 4096 ${p4k:-?}"
  rm -f "$G"
done

{
  echo "| check | result | detail |"
  echo "|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
} | tee "$OUT/gpu_check.md"
echo "gpu-check: $([ $FAIL -eq 0 ] && echo PASS || echo FAIL) (files in $OUT)"
exit $FAIL
