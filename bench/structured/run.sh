#!/usr/bin/env bash
# What constrained decoding costs: engine_bench's batch case (N_SEQS concurrent greedy requests,
# N_GEN tokens each, through engine::Scheduler) with every output constrained by a 20-field NPC
# schema (npc20.json), against the same case unconstrained, alternating the two PAIRS times
# (the order flips every pair). Prints the medians of the decode-phase tokens per second and the
# ratio of time per output token. Results feed docs/perf/structured.md.
#
# usage: bench/structured/run.sh [BUILD_DIR]      (default BUILD_DIR: build)
# env:   PAIRS (3), THREADS (2), N_SEQS (32), N_GEN (64), SEQ_PROMPT (32), TEMPERATURE (0:
#        greedy; else each request samples with its own seed), MODEL (llama-1b-q4_0;
#        SHAPE-TYPE, synthesised into MODEL_DIR when missing), MODEL_DIR
#        (~/.cache/tandem/models), SCHEMA (npc20.json), OUT (results folder; default mktemp)
#
# The synthetic model's weights are random, so greedy output wanders; the schema bounds every
# string, so each document completes, and N_GEN stays below a document's length so every
# measured token is drawn under the constraint. A random model never repeats the same text, so
# it visits more grammar states than a trained one: the cost here is an upper bound.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${1:-build}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
PAIRS=${PAIRS:-3}
THREADS=${THREADS:-2}
N_SEQS=${N_SEQS:-32}
N_GEN=${N_GEN:-64}
SEQ_PROMPT=${SEQ_PROMPT:-32}
TEMPERATURE=${TEMPERATURE:-0}
MODEL=${MODEL:-llama-1b-q4_0}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/tandem/models}
SCHEMA=${SCHEMA:-$HERE/npc20.json}
OUT=${OUT:-$(mktemp -d /tmp/structured-bench.XXXXXX)}
mkdir -p "$OUT" "$MODEL_DIR"
log() { echo "structured-bench: $*" >&2; }

f="$MODEL_DIR/$MODEL.gguf"
if [ ! -f "$f" ]; then
  log "synthesising $f"
  "$BUILD/bin/tandem" synth --shape "${MODEL%-*}" --type "${MODEL##*-}" --seed 1 --out "$f.tmp" >&2
  mv "$f.tmp" "$f"
fi

run() {  # variant: free | constrained
  local extra=()
  [ "$1" = constrained ] && extra=(--json-schema "$SCHEMA")
  "$BUILD/bin/engine_bench" --model "$f" -t "$THREADS" --modes batch --reps 1 \
    --n-seqs "$N_SEQS" -n "$N_GEN" --seq-prompt "$SEQ_PROMPT" \
    --batch-temperature "$TEMPERATURE" "${extra[@]}" \
    | python3 -c 'import json,sys; j=json.load(sys.stdin); j["variant"]=sys.argv[1]; print(json.dumps(j))' "$1" \
    >>"$OUT/raw.jsonl"
}

: >"$OUT/raw.jsonl"
for p in $(seq 1 "$PAIRS"); do
  if [ $((p % 2)) -eq 1 ]; then order="free constrained"; else order="constrained free"; fi
  for v in $order; do log "pair $p: $v"; run "$v"; done
done

python3 - "$OUT/raw.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def med(v):
    return statistics.median(r["batch"]["decode_phase_tokens_per_s"]["median"]
                             for r in rows if r["variant"] == v)
free, con = med("free"), med("constrained")
masks = [r["batch"].get("constraint") for r in rows if r["variant"] == "constrained"]
print(json.dumps({"free_tok_s": round(free, 2), "constrained_tok_s": round(con, 2),
                  "tpot_ratio": round(free / con, 4), "masks": masks}))
PY
log "raw results in $OUT/raw.jsonl"
