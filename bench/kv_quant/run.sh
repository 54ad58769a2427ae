#!/usr/bin/env bash
# KV-cache quantisation quality: int8 and fp8-e4m3 (and f16) KV against f32 KV, greedy, on the
# synthetic test model and the TinyStories models. Prints one table per model and writes the
# JSON lines to $OUT (default BUILD_DIR/kv_quant_results.jsonl). Figures go to docs/perf/kv-quant.md.
#
#   bench/kv_quant/run.sh [BUILD_DIR]      (default build)
# Env: TOKENS (greedy tokens per prompt, default 256), THREADS (default 1).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$ROOT/build}
BIN=$BUILD/bin/kv_quant_eval
[[ -x $BIN ]] || BIN=$BUILD/bench/kv_quant/kv_quant_eval
TOKENS=${TOKENS:-256}
THREADS=${THREADS:-1}
OUT=${OUT:-$BUILD/kv_quant_results.jsonl}
: >"$OUT"

PROMPTS=(--prompt "" --prompt "Once upon a time, there was a little girl named Lily."
         --prompt "The dog ran to the park and saw a big red ball." --prompt "Tom and Sam were friends.")

run() {
  "$BIN" "$@" --tokens "$TOKENS" -t "$THREADS" "${PROMPTS[@]}" 2>>"$OUT"
  echo
}

run --tiny
for m in "$ROOT/../shared/models/stories260K/stories260K.gguf" \
         "$HOME/.cache/tandem/models/stories15M-f32.gguf"; do
  if [[ -f $m ]]; then run --model "$m"; else echo "skip: $m not found"; fi
done
