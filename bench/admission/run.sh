#!/usr/bin/env bash
# SLO admission against plain admission, on one trace at twice the measured saturation rate.
#
# 1P+1D (`tandem cluster up --pin --threads 1`), a long-prompt workload (INPUT_LEN fresh tokens,
# OUTPUT_LEN out). First the saturation rate: the request throughput of a closed loop of
# SAT_CONCURRENCY clients. Then the same open-loop trace (Poisson at RATE_FACTOR x saturation,
# NUM_REQUESTS requests, a class mix with per-class TTFT targets) twice, each on a fresh cluster:
#   plain: the router as deployed by default, the targets only judge goodput (--no-send-targets);
#   slo:   the router with --max-prefill-backlog-ms BACKLOG_MS, the targets sent with requests.
#
# usage: bench/admission/run.sh [BUILD_DIR] [OUT_DIR]    (defaults: build, /tmp/tandem-admission)
# env:   MODEL (default: a stories15M-shaped synthetic model made with `tandem synth`),
#        INPUT_LEN (384), OUTPUT_LEN (32), NUM_REQUESTS (400), SAT_CONCURRENCY (16),
#        RATE_FACTOR (2), BACKLOG_MS (200), SEED (5), KV_BLOCKS (1024: decode's pool, so decode
#        KV is not what binds), MIX (interactive:1:ttft=600,standard:2:ttft=2000,batch:1:ttft=10000)
#
# Writes OUT_DIR/{saturation,plain,slo}.json (tandem bench's own) and OUT_DIR/results.md.
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$here/build}
OUT=${2:-${TMPDIR:-/tmp}/tandem-admission}
TANDEM="$BUILD/bin/tandem"
[ -x "$TANDEM" ] || { echo "$TANDEM missing: build the tandem targets first" >&2; exit 1; }
mkdir -p "$OUT"

INPUT_LEN=${INPUT_LEN:-384}
OUTPUT_LEN=${OUTPUT_LEN:-32}
NUM_REQUESTS=${NUM_REQUESTS:-400}
SAT_CONCURRENCY=${SAT_CONCURRENCY:-16}
RATE_FACTOR=${RATE_FACTOR:-2}
BACKLOG_MS=${BACKLOG_MS:-200}
SEED=${SEED:-5}
KV_BLOCKS=${KV_BLOCKS:-1024}
MIX=${MIX:-interactive:1:ttft=600,standard:2:ttft=2000,batch:1:ttft=10000}
if [ -z "${MODEL:-}" ]; then
  MODEL=$OUT/stories15M-f32.gguf
  [ -f "$MODEL" ] || "$TANDEM" synth --shape stories15M --type f32 --out "$MODEL"
fi
[ -f "$MODEL" ] || { echo "model $MODEL missing" >&2; exit 1; }
CTX=$(( (INPUT_LEN + OUTPUT_LEN + 127) / 128 * 128 ))

RUN=$(mktemp -d)
cleanup() {
  [ -f "$RUN/cluster/cluster.json" ] && "$TANDEM" cluster down --dir "$RUN/cluster" --grace-ms 3000 >/dev/null 2>&1 || true
  rm -rf "$RUN"
}
trap cleanup EXIT

up() {  # extra router flags...
  rm -rf "$RUN/cluster"
  local args=()
  for a in "$@"; do args+=(--router-arg="$a"); done
  "$TANDEM" cluster up --model "$MODEL" --prefill 1 --decode 1 --dir "$RUN/cluster" \
    --router-port 0 --threads 1 --pin --ctx-size "$CTX" --kv-blocks "$KV_BLOCKS" --max-seqs 32 \
    --timeout-ms 120000 ${args[@]+"${args[@]}"} >&2
  ROUTER=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' "$RUN/cluster/cluster.json")
  # Warm up: the workers fit their step cost from these and report it with their heartbeats.
  "$TANDEM" bench --router "$ROUTER" --num-requests 20 --concurrency 1 --input-len "$INPUT_LEN" \
    --output-len "$OUTPUT_LEN" --seed 99 --quiet >/dev/null
}
down() { "$TANDEM" cluster down --dir "$RUN/cluster" --grace-ms 3000 >/dev/null 2>&1; }

up
"$TANDEM" bench --router "$ROUTER" --num-requests 100 --concurrency "$SAT_CONCURRENCY" \
  --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed "$SEED" --quiet --out "$OUT/saturation.json"
down
RATE=$(python3 -c 'import json,sys; print(round(float(sys.argv[2]) * json.load(open(sys.argv[1]))["request_throughput"], 2))' "$OUT/saturation.json" "$RATE_FACTOR")
echo "== saturation x $RATE_FACTOR: $RATE req/s" >&2

trace=(--num-requests "$NUM_REQUESTS" --request-rate "$RATE" --input-len "$INPUT_LEN"
       --output-len "$OUTPUT_LEN" --seed "$SEED" --quiet --mix "$MIX")
up
"$TANDEM" bench --router "$ROUTER" "${trace[@]}" --no-send-targets --out "$OUT/plain.json"
down
up "--max-prefill-backlog-ms=$BACKLOG_MS"
"$TANDEM" bench --router "$ROUTER" "${trace[@]}" --out "$OUT/slo.json"
down

python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
sat = json.load(open(f"{out}/saturation.json"))
rows = ["| run | req/s offered | done | refused | goodput (req/s) | class | done | refused | goodput | TTFT p50 | TTFT p90 | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
good = {}
for name in ("plain", "slo"):
    j = json.load(open(f"{out}/{name}.json"))
    r = j["runs"][0]
    good[name] = r["goodput"]
    refused = sum(c["refused"] for c in r["classes"])
    for i, c in enumerate(r["classes"]):
        head = (f"| {name} | {r['request_rate']} | {r['completed']} | {refused} | {r['goodput']:.2f} "
                if i == 0 else "| | | | | ")
        rows.append(head + f"| {c['name']} | {c['completed']} | {c['refused']} | {c['goodput']:.2f} "
                    f"| {c['ttft_ms']['p50']:.0f} | {c['ttft_ms']['p90']:.0f} | {c['ttft_target_ms']:.0f} |")
table = "\n".join(rows)
ratio = good["slo"] / good["plain"] if good["plain"] > 0 else float("inf")
text = (f"saturation: {sat['request_throughput']:.2f} req/s (closed loop)\n\n{table}\n\n"
        f"goodput ratio slo / plain: {ratio:.2f}\n")
open(f"{out}/results.md", "w").write(text)
print(text)
PY
