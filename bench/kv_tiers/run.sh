#!/usr/bin/env bash
# Tiered KV store benchmark (issue 5). Three parts, one markdown table each:
#  1. TTFT of a PROMPT_TOKENS-token prompt, cold against 95% cached (CACHED_FRAC) with the cached
#     prefix served from the kvstore's device (emulated), host and SSD tiers. One router, one
#     decode worker, one prefill worker started with --no-prefix-cache (so every hit is the
#     store's), and a tandem-kvstore whose capacities put the blocks in the wanted tier: the
#     tiers above it hold one block, so each new block pushes the previous one down.
#     Per repetition: a request with the prefix alone publishes its blocks (waited for on the
#     store's /metrics), then the measured request is prefix + fresh tail. Cold: a fresh prompt
#     of the same length on the same processes.
#  2. SSD tier write/read GB/s (`tandem-kvstore --ssd-bench-mb`, O_DIRECT + io_uring, its own
#     block files, SSD_QD in flight) against fio (one file, O_DIRECT, io_uring, the same block
#     size and queue depth) on the same directory, SSD_ROUNDS alternating rounds.
#  3. Prefix hit rate of KV-aware routing (--policy kv-aware) against round-robin on a multi-turn
#     workload (`tandem bench --workload multi-turn`) with 2 prefill workers (own prefix caches,
#     no kvstore), from the workers' tandem_prefix_cache_{hits,queries}_total.
#
# usage: bench/kv_tiers/run.sh [BUILD_DIR] [OUT_DIR]   (defaults: build, /tmp/tandem-kv-tiers)
# env:   MODEL (default: `tandem synth --shape llama-1b --type q8_0`), PROMPT_TOKENS (2048),
#        CACHED_FRAC (0.95), REPEAT (3), THREADS (2), KV_TYPE (f16), SSD_DIR (OUT_DIR/ssd: put it
#        on the disk to measure), SSD_MB (1024), SSD_QD (8), SSD_ROUNDS (3), CONVS (8 conversations), TURNS (4),
#        TURN_TOKENS (256), OUTPUT_LEN (16), PARTS ("1 2 3"), SMOKE=1 (stories260K, short
#        prompts, a few requests: about a minute).
# Writes OUT_DIR/results.md and prints it. Logs are in OUT_DIR/logs.
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$here/build}
OUT=${2:-${TMPDIR:-/tmp}/tandem-kv-tiers}
BIN=$BUILD/bin
for b in tandem tandem-router tandem-prefill tandem-decode tandem-kvstore; do
  [ -x "$BIN/$b" ] || { echo "$BIN/$b missing: build it first" >&2; exit 1; }
done
mkdir -p "$OUT/logs"
LOGS=$OUT/logs

if [ "${SMOKE:-0}" = 1 ]; then
  MODEL=${MODEL:-$here/../shared/models/stories260K/stories260K.gguf}
  PROMPT_TOKENS=${PROMPT_TOKENS:-200}
  REPEAT=${REPEAT:-1}
  SSD_MB=${SSD_MB:-16}
  CONVS=${CONVS:-3}
  TURNS=${TURNS:-3}
  TURN_TOKENS=${TURN_TOKENS:-48}
  OUTPUT_LEN=${OUTPUT_LEN:-4}
  KV_TYPE=${KV_TYPE:-f32}
fi
PROMPT_TOKENS=${PROMPT_TOKENS:-2048}
CACHED_FRAC=${CACHED_FRAC:-0.95}
REPEAT=${REPEAT:-3}
THREADS=${THREADS:-2}
KV_TYPE=${KV_TYPE:-f16}
SSD_DIR=${SSD_DIR:-$OUT/ssd}
SSD_MB=${SSD_MB:-1024}
SSD_QD=${SSD_QD:-8}
SSD_ROUNDS=${SSD_ROUNDS:-3}
CONVS=${CONVS:-8}
TURNS=${TURNS:-4}
TURN_TOKENS=${TURN_TOKENS:-256}
OUTPUT_LEN=${OUTPUT_LEN:-16}
PARTS=${PARTS:-1 2 3}
CTX=$((PROMPT_TOKENS + 256))
if [[ " $PARTS " != *" 1 "* && " $PARTS " != *" 3 "* ]]; then
  MODEL=${MODEL:-none}  # part 2 alone runs no model
elif [ -z "${MODEL:-}" ]; then
  MODEL=$OUT/llama-1b-q8_0.gguf
  [ -f "$MODEL" ] || "$BIN/tandem" synth --shape llama-1b --type q8_0 --out "$MODEL"
fi
[ "$MODEL" = none ] || [ -f "$MODEL" ] || { echo "model $MODEL missing" >&2; exit 1; }

cleanup() {  # every process this script started (each left a pid file)
  for f in "$OUT"/*.pid; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
    rm -f "$f"
  done
}
trap cleanup EXIT

# start NAME BINARY ARGS...: runs it with --port 0 --port-file, waits for the port, echoes it.
start() {
  local name=$1 bin=$2
  shift 2
  rm -f "$OUT/$name.port"
  "$BIN/$bin" --port 0 --port-file "$OUT/$name.port" "$@" >"$LOGS/$name.log" 2>&1 &
  echo $! >"$OUT/$name.pid"
  for _ in $(seq 600); do
    [ -s "$OUT/$name.port" ] && { cat "$OUT/$name.port"; return 0; }
    kill -0 "$(cat "$OUT/$name.pid")" 2>/dev/null || break
    sleep 0.1
  done
  echo "$name did not start; see $LOGS/$name.log" >&2
  tail -5 "$LOGS/$name.log" >&2
  return 1
}
stop() {
  local pid
  pid=$(cat "$OUT/$1.pid")
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true  # reaps it when it is this shell's child
  while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  rm -f "$OUT/$1.pid"
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
metric_sum() {  # URL NAME: sum of the series' values
  curl -s "$1" | awk -v n="$2" '$1 ~ "^"n"({|$)" {s += $2} END {printf "%.0f\n", s}'
}

# Text of about N tokens: common words (about one token each with a Llama vocabulary), chosen
# by a seeded generator so every seed is a different prompt.
words() {  # SEED N
  python3 - "$1" "$2" <<'EOF'
import random, sys
seed, n = int(sys.argv[1]), int(sys.argv[2])
w = ("time year people way day man thing woman life child world school state family student "
     "group country problem hand part place case week company system program question work "
     "government number night point home water room mother area money story fact month lot "
     "right study book eye job word business issue side kind head house service friend father "
     "power hour game line end member law car city community name president team minute idea "
     "kid body information back parent face others level office door health person art war "
     "history party result change morning reason research girl guy moment air teacher force").split()
r = random.Random(seed)
print(" ".join(r.choice(w) for _ in range(n)))
EOF
}

# ttft SEED PREFIX_WORDS TAIL_WORDS: TTFT (ms) and prompt tokens of one request whose prompt is
# words(SEED, PREFIX_WORDS) followed by a tail of fresh words.
ROUTER=""
ttft() {
  local prompt
  prompt="$(words "$1" "$2") $(words $(( $1 + 1000000 )) "$3")"
  if ! "$BIN/tandem" client --router "$ROUTER" --prompt "$prompt" --max-tokens 2 \
    --temperature 0 --ignore-eos --json >"$OUT/last.json" 2>>"$LOGS/client.log"; then
    echo "tandem client failed: $(tail -n 1 "$LOGS/client.log")" >&2
    return 1
  fi
  python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j["timings"]["ttft_ms"], len(j["prompt_tokens"]))' "$OUT/last.json"
}
median() { python3 -c 'import statistics,sys; v=[float(x) for x in sys.argv[1:]]; print(f"{statistics.median(v):.1f}" if v else "n/a")' "$@"; }

RESULTS=$OUT/results.md
{
  echo "# tandem tiered KV store benchmark"
  echo
  echo "model: \`$(basename "$MODEL")\`, kv: $KV_TYPE, threads: $THREADS, $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs"
  echo
} >"$RESULTS"

# The routers get a long KV reservation lease: a cold 2k-token prefill of a 1B model on two
# cores outlasts the default 30 s, and the reservation must still stand when decode claims it.
if [[ " $PARTS " == *" 1 "* ]]; then
  ROUTER_PORT=$(start router tandem-router --model "$MODEL" --ctx-size "$CTX" --policy least-load \
    --reserve-lease-ms 600000)
  ROUTER=127.0.0.1:$ROUTER_PORT
  start decode tandem-decode --model "$MODEL" --router "$ROUTER" --threads 1 --ctx-size "$CTX" \
    --max-seqs 2 --kv-type "$KV_TYPE" --transport ucx >/dev/null
  start prefill-calibrate tandem-prefill --model "$MODEL" --router "$ROUTER" --threads "$THREADS" \
    --ctx-size "$CTX" --max-seqs 1 --kv-type "$KV_TYPE" --transport ucx >/dev/null
  sleep 1
  # Tokens per word of this model's tokenizer, from one short request (BOS included).
  read -r _ cal_tokens < <(ttft 0 40 0)
  stop prefill-calibrate
  total_words=$(python3 -c "print(max(1, int(($PROMPT_TOKENS - 1) * 40 / max(1, $cal_tokens - 1))))")
  prefix_words=$(python3 -c "print(int($total_words * $CACHED_FRAC))")
  tail_words=$((total_words - prefix_words))
  echo "calibration: 40 words -> $cal_tokens tokens; prompts of $total_words words"
  declare -A TT
  seed=1
  for tier in device host ssd; do
    rm -rf "$SSD_DIR/store" && mkdir -p "$SSD_DIR/store"
    # A generous slot: the store learns the block size from the first publish.
    kv_args=(--block-kb 2048 --staging-mb 512 --ssd-min-hits 0 --transport ucx --dir "$SSD_DIR/store")
    case $tier in
      device) kv_args+=(--device-mb 4096 --host-mb 0 --ssd-mb 0) ;;
      host) kv_args+=(--device-mb 2 --host-mb 4096 --ssd-mb 0) ;;
      ssd) kv_args+=(--device-mb 2 --host-mb 0 --ssd-mb 8192) ;;
    esac
    mport=$(free_port)
    KV_PORT=$(start kvstore-$tier tandem-kvstore "${kv_args[@]}" --metrics-port "$mport")
    pm=$(free_port)
    start prefill-$tier tandem-prefill --model "$MODEL" --router "$ROUTER" --threads "$THREADS" \
      --ctx-size "$CTX" --max-seqs 1 --kv-type "$KV_TYPE" --transport ucx --no-prefix-cache \
      --kvstore "127.0.0.1:$KV_PORT" --kvstore-read-ms 60000 --metrics-port "$pm" >/dev/null
    sleep 1  # registration
    # Warm-up, not recorded: connects prefill, kvstore and decode over UCX (a short prompt
    # published, then read back).
    wseed=$((900000 + seed))
    ttft "$wseed" $((prefix_words / 10 + 20)) 0 >/dev/null
    sleep 0.5
    ttft "$wseed" $((prefix_words / 10 + 20)) 4 >/dev/null
    hits=() colds=()
    for r in $(seq "$REPEAT"); do
      seed=$((seed + 1))
      ttft "$seed" "$prefix_words" 0 >/dev/null  # publishes the prefix
      last=-1
      for _ in $(seq 600); do  # until the store's block count settles
        n=$(metric_sum "http://127.0.0.1:$mport/metrics" "tandem_kvstore_tier_blocks")
        [ "$n" = "$last" ] && [ "$n" != 0 ] && break
        last=$n
        sleep 0.3
      done
      h0=$(metric_sum "http://127.0.0.1:$pm/metrics" "tandem_prefix_cache_hits_total")
      read -r ms toks < <(ttft "$seed" "$prefix_words" "$tail_words")
      h1=$(metric_sum "http://127.0.0.1:$pm/metrics" "tandem_prefix_cache_hits_total")
      onboard=$(python3 -c 'import json,sys; j=json.load(open(sys.argv[1])); print(j["timings"].get("server_ttft_ms", {}).get("prefix_onboarding", ""))' "$OUT/last.json")
      echo "tier $tier rep $r: ttft ${ms} ms (${toks} prompt tokens, $((h1 - h0)) blocks onboarded, server onboarding ${onboard} ms)"
      hits+=("$ms")
      seed=$((seed + 1))
      read -r ms toks < <(ttft "$seed" "$prefix_words" "$tail_words")
      echo "tier $tier rep $r: cold ttft ${ms} ms"
      colds+=("$ms")
    done
    TT[$tier]=$(median "${hits[@]}")
    TT[cold_$tier]=$(median "${colds[@]}")
    stop prefill-$tier
    stop kvstore-$tier
  done
  cold=$(median "${TT[cold_device]}" "${TT[cold_host]}" "${TT[cold_ssd]}")
  {
    echo "## TTFT, ${PROMPT_TOKENS}-token prompt, ${CACHED_FRAC} of it cached (median of $REPEAT)"
    echo
    echo "| prefix served from | TTFT (ms) | vs cold | target |"
    echo "| --- | ---: | ---: | --- |"
    echo "| cold (nothing cached) | $cold | 100% | |"
    for tier in device host ssd; do
      target=""
      [ $tier = host ] && target="<= 15%"
      [ $tier = ssd ] && target="<= 25%"
      pct=$(python3 -c "print(f'{100*${TT[$tier]}/$cold:.1f}%')")
      echo "| kvstore $tier tier | ${TT[$tier]} | $pct | $target |"
    done
    echo
  } >>"$RESULTS"
  stop decode
  stop router
fi

if [[ " $PARTS " == *" 2 "* ]]; then
  command -v fio >/dev/null || { echo "fio missing (scripts/setup.sh installs it)" >&2; exit 1; }
  mkdir -p "$SSD_DIR/bench"
  json() { python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print(eval(sys.argv[2], {}, {"d": d}))' "$@"; }
  gbps_med() { python3 -c 'import statistics,sys; print(f"{statistics.median(float(x) for x in sys.argv[1:]):.3f}")' "$@"; }
  tandem_ssd() {  # queue depth -> one JSON line
    "$BIN/tandem-kvstore" --dir "$SSD_DIR/bench/tandem" --ssd-bench-mb "$SSD_MB" --block-kb 1024 \
      --ssd-queue-depth "$1" 2>>"$LOGS/ssd-bench.log"
  }
  fio_gbps() {  # rw -> GB/s of one fio job: 1 MiB blocks, O_DIRECT, io_uring, depth SSD_QD
    fio --name="$1" --directory="$SSD_DIR/bench" --filename=fio.bin --rw="$1" --bs=1M \
      --iodepth="$SSD_QD" --ioengine=io_uring --direct=1 --size="${SSD_MB}M" \
      --output-format=json >"$LOGS/fio-$1.json" 2>>"$LOGS/ssd-bench.log"
    python3 -c 'import json,sys; j=json.load(open(sys.argv[1]))["jobs"][0][sys.argv[2]]; print(j["bw_bytes"]/1e9)' \
      "$LOGS/fio-$1.json" "$([ "$1" = write ] && echo write || echo read)"
  }
  # Rounds alternate tandem and fio, since a shared disk's bandwidth drifts; medians reported.
  tw=() tr=() fw=() fr=()
  for ((r = 0; r < SSD_ROUNDS; r++)); do
    j=$(tandem_ssd "$SSD_QD")
    tw+=("$(json "$j" 'd["write_gbps"]')") tr+=("$(json "$j" 'd["read_gbps"]')")
    fw+=("$(fio_gbps write)") fr+=("$(fio_gbps read)")
    rm -f "$SSD_DIR/bench/fio.bin"
  done
  j1=$(tandem_ssd 1)
  rm -rf "$SSD_DIR/bench"
  TW=$(gbps_med "${tw[@]}") TR=$(gbps_med "${tr[@]}") FW=$(gbps_med "${fw[@]}") FR=$(gbps_med "${fr[@]}")
  {
    echo "## SSD tier throughput, ${SSD_MB} MiB in 1 MiB blocks on \`$SSD_DIR\` (median of $SSD_ROUNDS alternating rounds)"
    echo
    echo "| | write GB/s | read GB/s |"
    echo "| --- | ---: | ---: |"
    echo "| tandem SSD tier, queue depth $SSD_QD (O_DIRECT, io_uring: $(json "$j" 'str(d["io_uring"]).lower()')) | $TW | $TR |"
    echo "| fio, one file, bs=1M, iodepth=$SSD_QD, io_uring, direct=1 | $FW | $FR |"
    echo "| tandem / fio | $(python3 -c "print(f'{$TW/$FW:.2f}')") | $(python3 -c "print(f'{$TR/$FR:.2f}')") |"
    echo "| tandem SSD tier, queue depth 1 (one round) | $(json "$j1" 'd["write_gbps"]') | $(json "$j1" 'd["read_gbps"]') |"
    echo
    echo "(tandem writes one file per block, a temporary file then a rename, and checksums every"
    echo "block on both sides; fio streams one preallocated file. Rounds: ${tw[*]} / ${tr[*]} against ${fw[*]} / ${fr[*]}.)"
    echo
  } >>"$RESULTS"
fi

if [[ " $PARTS " == *" 3 "* ]]; then
  declare -A HR
  for policy in round-robin kv-aware; do
    ROUTER_PORT=$(start router-$policy tandem-router --model "$MODEL" --ctx-size "$CTX" --policy "$policy" \
      --reserve-lease-ms 600000)
    ROUTER=127.0.0.1:$ROUTER_PORT
    start decode-$policy tandem-decode --model "$MODEL" --router "$ROUTER" --threads 1 \
      --ctx-size "$CTX" --max-seqs 4 --kv-type "$KV_TYPE" --transport ucx >/dev/null
    mports=()
    for i in 0 1; do
      mp=$(free_port)
      mports+=("$mp")
      start prefill$i-$policy tandem-prefill --model "$MODEL" --router "$ROUTER" --threads 1 \
        --ctx-size "$CTX" --max-seqs 2 --kv-type "$KV_TYPE" --transport ucx \
        --worker-id "prefill-$i" --metrics-port "$mp" >/dev/null
    done
    sleep 1
    "$BIN/tandem" bench --router "$ROUTER" --workload multi-turn --turns "$TURNS" \
      --num-requests $((CONVS * TURNS)) --concurrency 2 --input-len "$TURN_TOKENS" \
      --output-len "$OUTPUT_LEN" --seed 7 --quiet --out "$OUT/bench-$policy.json" \
      >>"$LOGS/bench-$policy.log" 2>&1
    q=0 h=0
    for mp in "${mports[@]}"; do
      q=$((q + $(metric_sum "http://127.0.0.1:$mp/metrics" "tandem_prefix_cache_queries_total")))
      h=$((h + $(metric_sum "http://127.0.0.1:$mp/metrics" "tandem_prefix_cache_hits_total")))
    done
    HR[$policy]=$(python3 -c "print(f'{100*$h/$q:.1f}% ({$h}/{$q} blocks)' if $q else 'n/a')")
    echo "policy $policy: prefix hit rate ${HR[$policy]}"
    for i in 0 1; do stop prefill$i-$policy; done
    stop decode-$policy
    stop router-$policy
  done
  {
    echo "## Prefix hit rate, multi-turn ($CONVS conversations x $TURNS turns, $TURN_TOKENS new tokens a turn), 2 prefill workers"
    echo
    echo "| router policy | prefix cache hit rate (blocks) |"
    echo "| --- | ---: |"
    echo "| round-robin | ${HR[round-robin]} |"
    echo "| kv-aware | ${HR[kv-aware]} |"
    echo
  } >>"$RESULTS"
fi

cat "$RESULTS"
