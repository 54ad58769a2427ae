#!/usr/bin/env bash
# Simulator accuracy: `tandem simulate` against measured `tandem bench` runs, 3 loads x 2
# topologies on this machine.
#
# For each topology (1P+1D, and 2 colocated workers; `tandem cluster up --pin --threads 1`):
#   1. warm up with a closed loop of one client (WARMUP requests); the workers fit their step
#      cost from these steps and report it with their heartbeats;
#   2. the saturation rate: the request throughput of a closed loop of SAT_CONCURRENCY clients;
#   3. the step costs the workers report now (`tandem simulate --cost-from`, saved once), and
#      two overheads the step model leaves out, each from one of those runs: the router to
#      first token path (the warm-up's mean TTFT minus its predicted prefill step), and, for
#      1P+1D, the prefill worker's time per prompt outside its steps (one over the saturation
#      throughput, minus the step cost per prompt of a full 2-prompt step);
#   4. three open-loop runs (Poisson; light, near saturation, overload: LOADS x saturation),
#      each on a fresh cluster, and `tandem simulate --trace` of each twice: with the costs of
#      step 3 (a prediction), and with the costs the workers fitted during that run (the
#      simulator's own error, given the step costs it ran under).
# Each simulated p50 / p90 of TTFT and TPOT and its goodput (SLO) is compared with the measured.
#
# usage: bench/simulator/run.sh [BUILD_DIR] [OUT_DIR]   (defaults: build, /tmp/tandem-simulator)
# env:   MODEL (default: a stories15M-shaped synthetic f32 model from `tandem synth`),
#        INPUT_LEN (256), OUTPUT_LEN (32), NUM_REQUESTS (200), WARMUP (30), SAT_CONCURRENCY (16),
#        LOADS ("0.3 0.85 1.5"), SLO (ttft:1500,tpot:150), SEED (11), MAX_SEQS (32),
#        KV_BLOCKS (1024), TOPOLOGIES ("1p1d col2")
# Writes OUT_DIR/<topology>/{warmup,saturation,costs,load-*,sim-*}.json and OUT_DIR/results.md.
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$here/build}
OUT=${2:-${TMPDIR:-/tmp}/tandem-simulator}
TANDEM="$BUILD/bin/tandem"
[ -x "$TANDEM" ] || { echo "$TANDEM missing: build the tandem targets first" >&2; exit 1; }
mkdir -p "$OUT"

INPUT_LEN=${INPUT_LEN:-256}
OUTPUT_LEN=${OUTPUT_LEN:-32}
NUM_REQUESTS=${NUM_REQUESTS:-200}
WARMUP=${WARMUP:-30}
SAT_CONCURRENCY=${SAT_CONCURRENCY:-16}
LOADS=${LOADS:-0.3 0.85 1.5}
SLO=${SLO:-ttft:1500,tpot:150}
SEED=${SEED:-11}
MAX_SEQS=${MAX_SEQS:-32}
KV_BLOCKS=${KV_BLOCKS:-1024}
TOPOLOGIES=${TOPOLOGIES:-1p1d col2}
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

workers() {  # topology -> cluster up / simulate worker flags
  case "$1" in
    1p1d) echo "--prefill 1 --decode 1" ;;
    col2) echo "--prefill 0 --decode 0 --colocated 2" ;;
    *) echo "unknown topology $1" >&2; exit 1 ;;
  esac
}
shape=(--max-seqs "$MAX_SEQS" --kv-blocks "$KV_BLOCKS" --ctx-size "$CTX")
up() {  # topology
  rm -rf "$RUN/cluster"
  # shellcheck disable=SC2046
  "$TANDEM" cluster up --model "$MODEL" $(workers "$1") --dir "$RUN/cluster" --router-port 0 \
    --threads 1 --pin "${shape[@]}" --timeout-ms 120000 >&2
  ROUTER=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' "$RUN/cluster/cluster.json")
  "$TANDEM" bench --router "$ROUTER" --num-requests "$WARMUP" --concurrency 1 \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed 99 --quiet --out "$DIR/warmup.json" >/dev/null
}
down() { "$TANDEM" cluster down --dir "$RUN/cluster" --grace-ms 3000 >/dev/null 2>&1; }

for topo in $TOPOLOGIES; do
  DIR=$OUT/$topo
  mkdir -p "$DIR"
  up "$topo"
  "$TANDEM" bench --router "$ROUTER" --num-requests 100 --concurrency "$SAT_CONCURRENCY" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed "$SEED" --quiet --out "$DIR/saturation.json" >/dev/null
  sleep 2  # a heartbeat with the latest fit
  # shellcheck disable=SC2046
  "$TANDEM" simulate --cost-from "$ROUTER" --save-cost "$DIR/costs-fitted.json" $(workers "$topo") \
    --rate 1 --num-requests 1 --quiet >/dev/null
  down
  # The overhead the step model leaves out, from the concurrency-1 warm-up.
  python3 - "$DIR" "$topo" "$INPUT_LEN" <<'PY'
import json, sys
d, topo, isl = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = json.load(open(f"{d}/costs-fitted.json"))
w = json.load(open(f"{d}/warmup.json"))
sat = json.load(open(f"{d}/saturation.json"))
role = c["prefill"] if topo != "col2" else c["colocated"]
step = role["intercept_s"] + role["prefill_token_s"] * isl
c["dispatch_s"] = max(0.0, w["ttft_ms"]["mean"] / 1000 - step)
c["transfer_s_per_token"] = 0.0
c["source"] += "; dispatch_s from the concurrency-1 warm-up (mean TTFT - predicted prefill step)"
if topo != "col2":
    per_prompt = (role["intercept_s"] + role["prefill_token_s"] * 2 * isl) / 2
    c["prefill_request_s"] = max(0.0, 1 / sat["request_throughput"] - per_prompt)
    c["source"] += "; prefill_request_s from the saturation run"
json.dump(c, open(f"{d}/costs.json", "w"), indent=2)
PY
  SAT=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["request_throughput"])' "$DIR/saturation.json")
  echo "== $topo: saturation $SAT req/s" >&2
  for f in $LOADS; do
    RATE=$(python3 -c "print(round($SAT * $f, 3))")
    up "$topo"
    "$TANDEM" bench --router "$ROUTER" --num-requests "$NUM_REQUESTS" --request-rate "$RATE" \
      --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed "$SEED" --slo "$SLO" --quiet \
      --out "$DIR/load-$f.json" >/dev/null
    sleep 2  # a heartbeat with the run's latest fit
    # shellcheck disable=SC2046
    "$TANDEM" simulate --cost-from "$ROUTER" --save-cost "$DIR/costs-run-$f.json" $(workers "$topo") \
      --rate 1 --num-requests 1 --quiet >/dev/null
    down
    python3 - "$DIR/costs.json" "$DIR/costs-run-$f.json" <<'PY'
import json, sys
base, run = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
for k in ("dispatch_s", "transfer_s_per_token", "prefill_request_s"):
    run[k] = base.get(k, 0.0)
json.dump(run, open(sys.argv[2], "w"), indent=2)
PY
    # shellcheck disable=SC2046
    "$TANDEM" simulate --cost "$DIR/costs.json" --trace "$DIR/load-$f.json" $(workers "$topo") \
      "${shape[@]}" --slo "$SLO" --quiet --out "$DIR/sim-$f.json" >/dev/null
    # shellcheck disable=SC2046
    "$TANDEM" simulate --cost "$DIR/costs-run-$f.json" --trace "$DIR/load-$f.json" $(workers "$topo") \
      "${shape[@]}" --slo "$SLO" --quiet --out "$DIR/sim-run-$f.json" >/dev/null
  done
done

python3 - "$OUT" "$SLO" "$TOPOLOGIES" "$LOADS" <<'PY'
import json, sys
out, slo, topos, loads = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
rows = ["| topology | load (x sat) | req/s | metric | measured | simulated | error | simulated, run's costs | error |",
        "|---|---|---|---|---|---|---|---|---|"]
worst, worst_run = {}, {}
for t in topos:
    for f in loads:
        m = json.load(open(f"{out}/{t}/load-{f}.json"))["runs"][0]
        s = json.load(open(f"{out}/{t}/sim-{f}.json"))["runs"][0]
        r = json.load(open(f"{out}/{t}/sim-run-{f}.json"))["runs"][0]
        get = {"TTFT p50 (ms)": lambda x: x["ttft_ms"]["p50"],
               "TTFT p90 (ms)": lambda x: x["ttft_ms"]["p90"],
               "TPOT p50 (ms)": lambda x: x["tpot_ms"]["p50"],
               "TPOT p90 (ms)": lambda x: x["tpot_ms"]["p90"],
               "goodput (req/s)": lambda x: x["goodput"]}
        for i, (name, g) in enumerate(get.items()):
            a, b, c = g(m), g(s), g(r)
            err = (b - a) / a * 100 if a else float("nan")
            err_run = (c - a) / a * 100 if a else float("nan")
            worst[name] = max(worst.get(name, 0), abs(err))
            worst_run[name] = max(worst_run.get(name, 0), abs(err_run))
            head = f"| {t} | {f} | {m['request_rate']} " if i == 0 else "| | | "
            rows.append(head + f"| {name} | {a:.2f} | {b:.2f} | {err:+.1f}% | {c:.2f} | {err_run:+.1f}% |")
text = (f"SLO for goodput: {slo}\n\n" + "\n".join(rows) +
        "\n\nlargest |error| per metric, costs fitted before the runs: " +
        ", ".join(f"{k} {v:.1f}%" for k, v in worst.items()) +
        "\nlargest |error| per metric, costs fitted in each run: " +
        ", ".join(f"{k} {v:.1f}%" for k, v in worst_run.items()) + "\n")
open(f"{out}/results.md", "w").write(text)
print(text)
PY
