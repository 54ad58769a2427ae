#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) in build-fuzz/ and runs each one for a
# while from its committed seed corpus. Usage:
#   scripts/fuzz_smoke.sh [SECONDS_PER_TARGET=20] [TARGET...]
# Environment: FUZZ_BUILD (build folder, default build-fuzz), FUZZ_JOBS (ninja -j, default 2),
# FUZZ_RUNS (libFuzzer -runs instead of a time limit, e.g. 1000000).
# New inputs libFuzzer finds go to a scratch corpus under the build folder, never into the
# committed seeds; a crash leaves crash-* files there and fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-20}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(gguf_fuzz tokenizer_fuzz generate_request_fuzz openai_request_fuzz)
build=${FUZZ_BUILD:-build-fuzz}
if ! command -v clang++ >/dev/null; then
  echo "fuzz_smoke: clang++ is needed (apt-get install clang)" >&2
  exit 1
fi
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ -DTANDEM_FUZZ=ON
fi
ninja -C "$build" -j "${FUZZ_JOBS:-2}" "${targets[@]}"
status=0
for t in "${targets[@]}"; do
  work="$build/fuzz-work/$t"
  mkdir -p "$work/corpus"
  limit=(-max_total_time="$secs")
  [ -n "${FUZZ_RUNS:-}" ] && limit=(-runs="$FUZZ_RUNS")
  echo "== $t (${FUZZ_RUNS:+$FUZZ_RUNS runs}${FUZZ_RUNS:-$secs s})"
  if ! (cd "$work" && "$OLDPWD/$build/bin/$t" "${limit[@]}" -max_len=4096 -timeout=10 \
          -rss_limit_mb=4096 -print_final_stats=1 corpus "$OLDPWD/tests/fuzz/corpus/$t" \
          2>&1 | tee "$t.log" | grep -E "^(#[0-9]+ +DONE|stat::number_of_executed_units|==[0-9]+==ERROR|SUMMARY)"); then
    :
  fi
  if ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* >/dev/null 2>&1; then
    echo "fuzz_smoke: $t found a failing input: $(ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* 2>/dev/null)" >&2
    status=1
  fi
done
exit $status
