#!/usr/bin/env bash
# Compares tandem's CPU engine (engine_bench) with llama.cpp on the same GGUF files, at the same
# thread count, alternating the two PAIRS times per case (the order flips every pair, so a drift
# in machine load hits both sides alike), and prints medians, ratios and the fraction of the
# measured read-bandwidth roofline. Results feed docs/perf/engine-cpu.md.
#
# usage: bench/engine/run.sh [BUILD_DIR]          (default BUILD_DIR: build)
# env:   PAIRS (5), THREADS (2), N_GEN (64), N_PROMPT (512), N_SEQS (32), SEQ_PROMPT (32),
#        CASES ("decode prefill batch"), MODELS ("llama-1b-q8_0 llama-1b-q4_0"; a name is
#        SHAPE-TYPE, synthesised into MODEL_DIR when missing), MODEL_DIR (~/.cache/tandem/models),
#        LLAMA_BIN (~/.cache/tandem/llama.cpp/build/bin), KV_TYPE (f16, llama.cpp's default),
#        PORT (18080, llama-server; one more port per extra variant), OUT (results folder;
#        default a fresh mktemp folder, kept), LLAMA_VARIANTS ("default omp-passive": llama.cpp
#        as it runs out of the box, and with OMP_WAIT_POLICY=passive), PRIO (a command prefix for
#        every measured process of both sides, e.g. "chrt -f 50": real-time priority keeps other
#        work on a shared machine from taking their cores; empty by default)
#
# Cases (tandem vs llama.cpp):
#   decode   engine_bench --modes decode -n N_GEN       vs llama-bench -p 0 -n N_GEN
#   prefill  engine_bench --modes prefill -p N_PROMPT   vs llama-bench -p N_PROMPT -n 0
#   batch    engine_bench --modes batch: N_SEQS requests of SEQ_PROMPT random tokens, N_GEN
#            generated each, through engine::Scheduler
#                                                       vs llama-server -np N_SEQS --cont-batching
#            driven by server_client.py with N_SEQS concurrent /completion requests (same sizes)
#   The read bandwidth (membw, THREADS threads and 1 thread) is measured before every model, and
#   at THREADS threads before every round of the decode case: the roofline of a round divides by
#   the bandwidth measured just before it, since the host's bandwidth drifts during a run.
#
# The machine is shared and noisy: only ratios from the alternating pairs of one run mean much.
# llama.cpp here is built with OpenMP, so its per-op barrier is libgomp's, which spins (up to
# GOMP_SPINCOUNT iterations) before it sleeps. When other work competes for the two cores, a
# spinning thread burns the slice its descheduled partner needs and llama.cpp at -t 2 collapses
# (4-40x slower); OMP_WAIT_POLICY=passive makes its threads sleep at once, as tandem's pool does.
# Both variants are measured and the summary gives a ratio against each.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
BUILD=${1:-build}
case $BUILD in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
PAIRS=${PAIRS:-5}
THREADS=${THREADS:-2}
N_GEN=${N_GEN:-64}
N_PROMPT=${N_PROMPT:-512}
N_SEQS=${N_SEQS:-32}
SEQ_PROMPT=${SEQ_PROMPT:-32}
CASES=${CASES:-"decode prefill batch"}
MODELS=${MODELS:-"llama-1b-q8_0 llama-1b-q4_0"}
MODEL_DIR=${MODEL_DIR:-$HOME/.cache/tandem/models}
LLAMA_BIN=${LLAMA_BIN:-$HOME/.cache/tandem/llama.cpp/build/bin}
KV_TYPE=${KV_TYPE:-f16}
PORT=${PORT:-18080}
LLAMA_VARIANTS=${LLAMA_VARIANTS:-"default omp-passive"}
read -r -a PRIO_CMD <<<"${PRIO:-}"  # empty array when unset
OUT=${OUT:-$(mktemp -d /tmp/engine-bench.XXXXXX)}
mkdir -p "$OUT"
RAW="$OUT/raw.jsonl"
: >"$RAW"

log() { echo "engine-bench: $*" >&2; }

# ---- Build what is needed ------------------------------------------------------------------------
if [ ! -f "$BUILD/build.ninja" ]; then
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >&2
fi
nice -n 10 ninja -C "$BUILD" -j2 tandem engine_bench membw >&2
if [ ! -x "$LLAMA_BIN/llama-bench" ] || [ ! -x "$LLAMA_BIN/llama-server" ]; then
  log "llama.cpp missing in $LLAMA_BIN: building it (scripts/build_llama_cpp.sh)"
  "$ROOT/scripts/build_llama_cpp.sh" >/dev/null
fi
export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---- Models ----------------------------------------------------------------------------------------
mkdir -p "$MODEL_DIR"
synth() {  # name: SHAPE-TYPE
  local f="$MODEL_DIR/$1.gguf"
  if [ ! -f "$f" ]; then
    log "synthesising $f"
    "$BUILD/bin/tandem" synth --shape "${1%-*}" --type "${1##*-}" --seed 1 --out "$f.tmp" >&2
    mv "$f.tmp" "$f"
  fi
}
for m in $MODELS stories15M-f32; do synth "$m"; done

# ---- Runners: each appends one JSON line to $RAW -----------------------------------------------
emit() {  # model case engine pair tokens_per_s [extra json fields]
  echo "{\"model\":\"$1\",\"case\":\"$2\",\"engine\":\"$3\",\"pair\":$4,\"tokens_per_s\":$5${6:+,$6}}" >>"$RAW"
}

run_membw() {  # model (the bandwidth measured next to it)
  for t in "$THREADS" 1; do
    local j
    j=$("${PRIO_CMD[@]}" "$BUILD/bin/membw" --threads "$t" --mib 1024 --passes 8)
    echo "{\"model\":\"$1\",\"case\":\"membw\",\"threads\":$t,\"gb_per_s\":$(python3 -c \
      'import json,sys; print(json.dumps(json.loads(sys.argv[1])["gb_per_s"]))' "$j")}" >>"$RAW"
  done
}

run_membw_round() {  # model pair: the bandwidth just before one round of the decode case
  local j
  j=$("${PRIO_CMD[@]}" "$BUILD/bin/membw" --threads "$THREADS" --mib 1024 --passes 8)
  echo "{\"model\":\"$1\",\"case\":\"membw_round\",\"pair\":$2,\"threads\":$THREADS,\"gb_per_s\":$(python3 -c \
    'import json,sys; print(json.dumps(json.loads(sys.argv[1])["gb_per_s"]))' "$j")}" >>"$RAW"
}

tandem_case() {  # model case pair
  local f="$MODEL_DIR/$1.gguf" j
  case $2 in
    decode)  j=$("${PRIO_CMD[@]}" "$BUILD/bin/engine_bench" --model "$f" -t "$THREADS" --kv-type "$KV_TYPE" -r 1 \
                 --modes decode -n "$N_GEN") || j= ;;
    prefill) j=$("${PRIO_CMD[@]}" "$BUILD/bin/engine_bench" --model "$f" -t "$THREADS" --kv-type "$KV_TYPE" -r 1 \
                 --modes prefill -p "$N_PROMPT") || j= ;;
    batch)   j=$("${PRIO_CMD[@]}" "$BUILD/bin/engine_bench" --model "$f" -t "$THREADS" --kv-type "$KV_TYPE" -r 1 \
                 --modes batch --n-seqs "$N_SEQS" --seq-prompt "$SEQ_PROMPT" -n "$N_GEN") || j= ;;
  esac
  [ -n "$j" ] || { log "tandem $2 run failed; no sample"; return 0; }
  local tps wb
  tps=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(d[sys.argv[2]]["tokens_per_s"]["median"])' "$j" "$2")
  wb=$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["weight_bytes_per_token"])' "$j")
  emit "$1" "$2" tandem "$3" "$tps" "\"weight_bytes_per_token\":$wb"
}

llama_name() {  # variant -> engine name in the results
  if [ "$1" = default ]; then echo llama.cpp; else echo "llama.cpp-$1"; fi
}
llama_env() {  # variant -> environment for llama.cpp's processes
  case $1 in
    default)     echo "LLAMA_BENCH_VARIANT=default" ;;
    omp-passive) echo "OMP_WAIT_POLICY=passive" ;;
    *)           echo "unknown llama.cpp variant $1" >&2; exit 2 ;;
  esac
}

llama_case() {  # model case pair variant-index
  local f="$MODEL_DIR/$1.gguf" j
  local variant
  variant=$(echo $LLAMA_VARIANTS | cut -d' ' -f$(($4 + 1)))
  case $2 in
    decode)  j=$("${PRIO_CMD[@]}" env "$(llama_env "$variant")" "$LLAMA_BIN/llama-bench" -m "$f" -t "$THREADS" \
                 -p 0 -n "$N_GEN" -r 1 -o json 2>/dev/null) || j= ;;
    prefill) j=$("${PRIO_CMD[@]}" env "$(llama_env "$variant")" "$LLAMA_BIN/llama-bench" -m "$f" -t "$THREADS" \
                 -p "$N_PROMPT" -n 0 -r 1 -o json 2>/dev/null) || j= ;;
    batch)   j=$(python3 "$HERE/server_client.py" --url "http://127.0.0.1:$((PORT + $4))" \
                 --n "$N_SEQS" --prompt-len "$SEQ_PROMPT" --n-predict "$N_GEN" --seed "$3") ||
               { log "llama.cpp $variant batch run failed; no sample"; return 0; } ;;
  esac
  [ -n "$j" ] || { log "llama.cpp $variant $2 run failed; no sample"; return 0; }
  local tps
  tps=$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(d["tokens_per_s"] if isinstance(d, dict) else d[0]["avg_ts"])' "$j")
  emit "$1" "$2" "$(llama_name "$variant")" "$3" "$tps"
}

SERVER_PIDS=()
stop_servers() {
  local p
  for p in "${SERVER_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${SERVER_PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  SERVER_PIDS=()
}
trap stop_servers EXIT

start_servers() {  # model: one llama-server per variant, on PORT, PORT+1, ...
  local slot_ctx=$(( (SEQ_PROMPT + N_GEN + 64 + 255) / 256 * 256 )) k=0 variant
  for variant in $LLAMA_VARIANTS; do
    "${PRIO_CMD[@]}" env "$(llama_env "$variant")" "$LLAMA_BIN/llama-server" -m "$MODEL_DIR/$1.gguf" \
        -t "$THREADS" -tb "$THREADS" -np "$N_SEQS" -c $((N_SEQS * slot_ctx)) --cont-batching \
        --no-webui --cache-ram 0 --host 127.0.0.1 --port $((PORT + k)) \
        >"$OUT/llama-server-$1-$variant.log" 2>&1 &
    SERVER_PIDS+=($!)
    k=$((k + 1))
  done
}

# ---- The alternating pairs -------------------------------------------------------------------------
for m in $MODELS; do
  log "$m: read bandwidth"
  run_membw "$m"
  for c in $CASES; do
    [ "$c" = batch ] && start_servers "$m"
    # Each round runs tandem and every llama.cpp variant once, the starting point rotating.
    n_side=$(( $(echo $LLAMA_VARIANTS | wc -w) + 1 ))
    for ((i = 0; i < PAIRS; i++)); do
      log "$m $c round $((i + 1))/$PAIRS"
      [ "$c" = decode ] && run_membw_round "$m" "$i"
      for ((k = 0; k < n_side; k++)); do
        s=$(( (i + k) % n_side ))
        if ((s == 0)); then tandem_case "$m" "$c" "$i"; else llama_case "$m" "$c" "$i" $((s - 1)); fi
      done
    done
    [ "$c" = batch ] && stop_servers
  done
done
log "$(echo $MODELS | wc -w) models: read bandwidth again"
run_membw end

python3 "$HERE/summarize.py" "$RAW" --threads "$THREADS" --json "$OUT/summary.json" | tee "$OUT/summary.md"
log "raw results in $RAW, summary in $OUT/summary.{md,json}"
