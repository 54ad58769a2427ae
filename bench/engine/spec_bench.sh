#!/usr/bin/env bash
# Speculative decoding with and without, side by side in one run (docs/perf/speculative.md).
#
# usage: bench/engine/spec_bench.sh [BUILD_DIR]          (default BUILD_DIR: build)
# env:   PAIRS (5), THREADS (2), MODEL_DIR (~/.cache/tandem/models), OUT (results folder;
#        default a fresh mktemp folder, kept), STORIES (../shared/models/stories260K/stories260K.gguf)
#
# Cases, each alternating off/on PAIRS times (the order flips every pair):
#   ngram     `tandem generate --json` at batch 1 on stories260K, greedy, 256 tokens, on prompts
#             whose continuation repeats them; decode tok/s and the mean acceptance length.
#   verify    engine_bench --modes verify on the llama-1b shape (Q8_0): step time of a chunk of
#             k+1 tokens with k+1 logit rows against a 1-token decode step, k = 0..8.
#   batch32   engine_bench --modes batch, 32 sequences, on llama-1b: off, ngram behind the
#             default gate (8), and ngram and self:q4_0 with the gate lifted (64), where only
#             the measured cost of a draft token holds speculation back.
#   self      engine_bench --modes batch at batch 1 on llama-1b Q8_0: off, the Q4_0 self-draft
#             (self:q4_0) adaptive, and the same drafting 4 tokens every step (--spec-fixed);
#             then decode and prefill of llama-1b Q8_0 and Q4_0 (the draft's step cost, and what
#             recomputing the draft's prompt K/V on decode costs).
#   draftkv   where the draft's prompt K/V come from in a 1 prefill + 1 decode cluster (separate
#             processes over UCX, each pinned to its own core, one thread each), llama-1b Q8_0
#             with self:q4_0: sent by prefill with the target's (--draft-kv prefill) against
#             computed by decode on the first proposal (--draft-kv decode), at prompt lengths
#             DRAFTKV_LENS (128 512 2048), `tandem bench` with 32 output tokens at concurrency 1
#             and 3. (No pairs: each cluster serves every length in one start.) The router's
#             reservation lease is raised to 10 minutes: on one thread a 2048-token prefill of
#             target and draft takes about 30 s, and queued requests wait behind it.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${1:-build}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
PAIRS=${PAIRS:-5}
THREADS=${THREADS:-2}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/tandem/models}
STORIES=${STORIES:-$ROOT/../shared/models/stories260K/stories260K.gguf}
CASES=${CASES:-"ngram verify batch32"}
OUT=${OUT:-$(mktemp -d /tmp/spec-bench.XXXXXX)}
mkdir -p "$OUT" "$MODEL_DIR"
RAW="$OUT/raw.jsonl"
: >"$RAW"
TANDEM="$BUILD/bin/tandem"
BENCH="$BUILD/bin/engine_bench"
log() { echo "spec-bench: $*" >&2; }

# One JSON line per measurement: {"case", "variant", "pair", ...the tool's own JSON}.
record() {  # case variant pair json
  printf '{"case":"%s","variant":"%s","pair":%s,"result":%s}\n' "$1" "$2" "$3" "$4" >>"$RAW"
}

PROMPTS=(
  "Lily saw a cat. Lily saw a dog. Lily saw a cat. Lily saw a dog. Lily"
  "Tom had a red ball. Tom liked the red ball. Tom played with the red ball. Tom"
  "Once upon a time, there was a little girl named Lily. Lily"
)

if [[ " $CASES " == *" ngram "* ]]; then
  for ((p = 0; p < PAIRS; p++)); do
    order=(off ngram)
    ((p % 2)) && order=(ngram off)
    for v in "${order[@]}"; do
      for i in "${!PROMPTS[@]}"; do
        j=$("$TANDEM" generate --model "$STORIES" --prompt "${PROMPTS[$i]}" --max-tokens 256 \
          --temperature 0 --ignore-eos --threads 1 --json --speculative "$v" --spec-tokens 6)
        record "ngram-p$i" "$v" "$p" "$j"
      done
    done
  done
fi

L1B="$MODEL_DIR/llama-1b-q8_0.gguf"
if [[ " $CASES " == *" verify "* || " $CASES " == *" batch32 "* || " $CASES " == *" self "* ||
  " $CASES " == *" draftkv "* ]] &&
  [[ ! -f $L1B ]]; then
  log "synthesising $L1B"
  "$TANDEM" synth --shape llama-1b --type q8_0 --out "$L1B"
fi

if [[ " $CASES " == *" verify "* ]]; then
  for ((p = 0; p < PAIRS; p++)); do
    j=$("$BENCH" --model "$L1B" --threads "$THREADS" --modes verify --verify-max 8 \
      --decode-prompt 128 --reps 3)
    record verify - "$p" "$j"
  done
fi

if [[ " $CASES " == *" batch32 "* ]]; then
  for ((p = 0; p < PAIRS; p++)); do
    variants=("off 8" "ngram 8" "ngram 64" "self:q4_0 64")
    ((p % 2)) && variants=("self:q4_0 64" "ngram 64" "ngram 8" "off 8")
    for v in "${variants[@]}"; do
      read -r spec gate <<<"$v"
      j=$("$BENCH" --model "$L1B" --threads "$THREADS" --modes batch --n-seqs 32 \
        --seq-prompt 32 -n 32 --reps 1 --speculative "$spec" --spec-max-batch "$gate")
      record batch32 "$spec-gate$gate" "$p" "$j"
    done
  done
fi

if [[ " $CASES " == *" self "* ]]; then
  L1B4="$MODEL_DIR/llama-1b-q4_0.gguf"
  [[ -f $L1B4 ]] || "$TANDEM" quantize "$L1B" "$L1B4" --type q4_0
  for ((p = 0; p < PAIRS; p++)); do
    variants=("off" "self:q4_0" "self:q4_0 --spec-fixed")
    ((p % 2)) && variants=("self:q4_0 --spec-fixed" "self:q4_0" "off")
    for v in "${variants[@]}"; do
      read -r spec fixed <<<"$v"
      # shellcheck disable=SC2086  # $fixed is empty or one flag
      j=$("$BENCH" --model "$L1B" --threads "$THREADS" --modes batch --n-seqs 1 \
        --seq-prompt 32 -n 96 --reps 1 --speculative "$spec" --spec-tokens 4 $fixed)
      record self "$spec${fixed:+-fixed}" "$p" "$j"
    done
    for m in "$L1B" "$L1B4"; do
      j=$("$BENCH" --model "$m" --threads "$THREADS" --modes decode,prefill -n 64 \
        --n-prefill 128 --reps 1)
      record steps "$(basename "$m" .gguf)" "$p" "$j"
    done
  done
fi

if [[ " $CASES " == *" draftkv "* ]]; then
  for mode in prefill decode; do
    dir="$OUT/cluster-$mode"
    "$TANDEM" cluster up --model "$L1B" --prefill 1 --decode 1 --dir "$dir" --router-port 0 \
      --http-port 0 --threads 1 --pin --ctx-size 4096 --speculative self:q4_0 \
      --worker-arg=--draft-kv --worker-arg="$mode" --timeout-ms 300000 \
      --router-arg=--reserve-lease-ms --router-arg=600000 >&2
    router=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' "$dir/cluster.json")
    for len in ${DRAFTKV_LENS:-128 512 2048}; do
      for conc in 1 3; do
        "$TANDEM" bench --router "$router" --num-requests $((conc * 2)) --concurrency "$conc" \
          --input-len "$len" --output-len 32 --seed "$len" --quiet --out "$OUT/draftkv.json" >&2
        record draftkv "$mode-$len-c$conc" 0 \
          "$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))))' "$OUT/draftkv.json")"
      done
    done
    "$TANDEM" cluster down --dir "$dir" --grace-ms 3000 >&2
  done
fi

python3 "$HERE/spec_summarize.py" "$RAW" | tee "$OUT/summary.md"
log "raw results in $RAW"
