#!/usr/bin/env bash
# Latency the router adds, against calling a worker directly: 1-token requests at RATE req/s.
#
# One colocated worker and a router (`tandem cluster up --prefill 0 --decode 0 --colocated 1 --kvstore 0 --pin --threads 1`: the
# router on one core, the worker on the other; the load generator shares them). The same
# Poisson trace goes ROUNDS times to each target in alternating rounds of SECONDS seconds:
# straight to the worker (DecodeWorker.Decode with prefill_locally, the call the router makes
# for a colocated worker) and through the router (Inference.Generate). See
# router_overhead_bench.cc.
#
# usage: bench/router_overhead/run.sh [BUILD_DIR] [OUT_DIR]  (defaults: build, /tmp/tandem-router-overhead)
# env:   MODEL (default: ../shared/models/stories260K/stories260K.gguf), RATE (1000),
#        SECONDS_PER_ROUND (10), ROUNDS (3), PROMPT_LEN (4), SEED (1),
#        LOADGEN_CPU (unset: the load generator is not pinned; a core number: pinned there)
# Writes OUT_DIR/result.json and prints the table.
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$here/build}
OUT=${2:-${TMPDIR:-/tmp}/tandem-router-overhead}
TANDEM="$BUILD/bin/tandem"
BENCH="$BUILD/bin/router_overhead_bench"
for b in "$TANDEM" "$BENCH"; do
  [ -x "$b" ] || { echo "$b missing: build it first" >&2; exit 1; }
done
MODEL=${MODEL:-$here/../shared/models/stories260K/stories260K.gguf}
[ -f "$MODEL" ] || { echo "model $MODEL missing" >&2; exit 1; }
RATE=${RATE:-1000}
SECONDS_PER_ROUND=${SECONDS_PER_ROUND:-10}
ROUNDS=${ROUNDS:-3}
PROMPT_LEN=${PROMPT_LEN:-4}
SEED=${SEED:-1}
mkdir -p "$OUT"

RUN=$(mktemp -d)
cleanup() {
  [ -f "$RUN/cluster/cluster.json" ] && "$TANDEM" cluster down --dir "$RUN/cluster" --grace-ms 3000 >/dev/null 2>&1 || true
  rm -rf "$RUN"
}
trap cleanup EXIT

"$TANDEM" cluster up --model "$MODEL" --prefill 0 --decode 0 --colocated 1 --kvstore 0 --dir "$RUN/cluster" --router-port 0 \
  --threads 1 --pin --timeout-ms 60000 >&2
read -r ROUTER WORKER < <(python3 - "$RUN/cluster/cluster.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
w = [p for p in c["processes"] if p["role"] == "colocated"][0]
print(c["router"], "127.0.0.1:%d" % w["port"])
PY
)
PIN=()
[ -n "${LOADGEN_CPU:-}" ] && PIN=(taskset -c "$LOADGEN_CPU")
"${PIN[@]}" "$BENCH" --router "$ROUTER" --worker "$WORKER" --rate "$RATE" --seconds "$SECONDS_PER_ROUND" \
  --rounds "$ROUNDS" --prompt-len "$PROMPT_LEN" --seed "$SEED" \
  --out "$OUT/result.json"
echo "wrote $OUT/result.json" >&2
