#!/usr/bin/env bash
# Disaggregated (1 prefill + 1 decode worker) against colocated (2 workers that each prefill and
# decode: `tandem cluster up --colocated 2`, i.e. tandem-decode --role both) on a long-prompt chat
# workload, across open-loop arrival rates. Same model, same number of worker processes, each
# process pinned to its own core (`cluster up --pin`, 1 thread per worker; the router is pinned
# too, so 3 cores are needed for no sharing: on fewer, the pinning wraps round-robin).
#
# usage: bench/disagg/run.sh [BUILD_DIR] [OUT_DIR]     (defaults: build, /tmp/tandem-disagg)
# env:   MODEL (default: a stories15M-shaped synthetic model made with `tandem synth`),
#        RATES ("0.5,1,2,4" requests/s), NUM_REQUESTS (40 per rate), INPUT_LEN (384 fresh
#        tokens per turn), OUTPUT_LEN (64), TURNS (2), CTX (2048), ARRIVAL (poisson),
#        SLO ("ttft:2000,tpot:100"), SEED (1), SMOKE=1 (a short run on stories260K: a few
#        requests at one rate; under 20 s)
#
# Writes OUT_DIR/{disagg,colocated}.json and .png (tandem bench's own), OUT_DIR/compare.png
# (p50/p90 TTFT and TPOT and goodput against load, both modes) and OUT_DIR/results.md (a
# markdown table), and prints the table.
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$here/build}
OUT=${2:-${TMPDIR:-/tmp}/tandem-disagg}
TANDEM="$BUILD/bin/tandem"
[ -x "$TANDEM" ] || { echo "$TANDEM missing: build the tandem targets first" >&2; exit 1; }
mkdir -p "$OUT"

if [ "${SMOKE:-0}" = 1 ]; then
  MODEL=${MODEL:-$here/../shared/models/stories260K/stories260K.gguf}
  RATES=${RATES:-4}
  NUM_REQUESTS=${NUM_REQUESTS:-4}
  INPUT_LEN=${INPUT_LEN:-64}
  OUTPUT_LEN=${OUTPUT_LEN:-8}
  TURNS=${TURNS:-2}
  CTX=${CTX:-1024}
fi
RATES=${RATES:-0.5,1,2,4}
NUM_REQUESTS=${NUM_REQUESTS:-40}
INPUT_LEN=${INPUT_LEN:-384}
OUTPUT_LEN=${OUTPUT_LEN:-64}
TURNS=${TURNS:-2}
CTX=${CTX:-2048}
ARRIVAL=${ARRIVAL:-poisson}
SLO=${SLO:-ttft:2000,tpot:100}
SEED=${SEED:-1}
if [ -z "${MODEL:-}" ]; then
  MODEL=$OUT/stories15M-f32.gguf
  [ -f "$MODEL" ] || "$TANDEM" synth --shape stories15M --type f32 --out "$MODEL"
fi
[ -f "$MODEL" ] || { echo "model $MODEL missing" >&2; exit 1; }

RUN=$(mktemp -d)
cleanup() {
  for mode in disagg colocated; do
    [ -f "$RUN/$mode/cluster.json" ] && "$TANDEM" cluster down --dir "$RUN/$mode" --grace-ms 3000 >/dev/null 2>&1 || true
  done
  rm -rf "$RUN"
}
trap cleanup EXIT

run_mode() {  # mode, cluster-up worker flags...
  local mode=$1; shift
  local dir="$RUN/$mode"
  echo "== $mode: cluster up ($*)" >&2
  "$TANDEM" cluster up --model "$MODEL" "$@" --dir "$dir" --router-port 0 --http-port 0 \
    --threads 1 --pin --ctx-size "$CTX" --timeout-ms 120000 >&2
  local router
  router=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' "$dir/cluster.json")
  "$TANDEM" bench --router "$router" --num-requests "$NUM_REQUESTS" --request-rate "$RATES" \
    --arrival "$ARRIVAL" --workload multi-turn --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" \
    --turns "$TURNS" --slo "$SLO" --seed "$SEED" \
    --out "$OUT/$mode.json" --plot "$OUT/$mode.png"
  "$TANDEM" cluster down --dir "$dir" --grace-ms 3000 >&2
}

run_mode disagg --prefill 1 --decode 1
run_mode colocated --prefill 0 --decode 0 --colocated 2

# The comparison: a table and a plot of both modes against load.
python3 - "$OUT" <<'PY'
import json, os, subprocess, sys
out = sys.argv[1]
modes = ["disagg", "colocated"]
runs = {m: json.load(open(os.path.join(out, m + ".json")))["runs"] for m in modes}
rows = ["| mode | rate (req/s) | done | req/s | out tok/s | goodput | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | ITL p90 | E2E p90 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
for m in modes:
    with open(os.path.join(out, m + "-load.dat"), "w") as f:
        for r in runs[m]:
            rows.append("| %s | %g | %d/%d | %.2f | %.1f | %.2f | %.0f | %.0f | %.1f | %.1f | %.1f | %.0f |" % (
                m, r["request_rate"], r["completed"], r["completed"] + r["failed"],
                r["request_throughput"], r["output_token_throughput"], r["goodput"],
                r["ttft_ms"]["p50"], r["ttft_ms"]["p90"], r["tpot_ms"]["p50"], r["tpot_ms"]["p90"],
                r["itl_ms"]["p90"], r["e2e_ms"]["p90"]))
            f.write("%g %g %g %g %g %g\n" % (r["request_rate"], r["ttft_ms"]["p50"], r["ttft_ms"]["p90"],
                                             r["tpot_ms"]["p50"], r["tpot_ms"]["p90"], r["goodput"]))
table = "\n".join(rows) + "\n\nLatencies in ms. Workload: multi-turn chat, long prompts; see run.sh's header for the settings.\n"
open(os.path.join(out, "results.md"), "w").write(table)
print(table)
if subprocess.call("command -v gnuplot >/dev/null", shell=True) == 0:
    d = {m: os.path.join(out, m + "-load.dat") for m in modes}
    gp = f"""set terminal pngcairo size 1200,900 font 'sans,10'
set output '{os.path.join(out, "compare.png")}'
set multiplot layout 2,2 title 'disaggregated 1P+1D vs colocated 2x'
set grid; set key top left; set xlabel 'offered load (requests/s)'
set title 'TTFT p90 (ms)'; plot '{d["disagg"]}' u 1:3 w lp lw 2 t 'disagg', '{d["colocated"]}' u 1:3 w lp lw 2 t 'colocated'
set title 'TPOT p90 (ms)'; plot '{d["disagg"]}' u 1:5 w lp lw 2 t 'disagg', '{d["colocated"]}' u 1:5 w lp lw 2 t 'colocated'
set title 'TTFT p50 (ms)'; plot '{d["disagg"]}' u 1:2 w lp lw 2 t 'disagg', '{d["colocated"]}' u 1:2 w lp lw 2 t 'colocated'
set title 'goodput (req/s)'; plot '{d["disagg"]}' u 1:6 w lp lw 2 t 'disagg', '{d["colocated"]}' u 1:6 w lp lw 2 t 'colocated'
unset multiplot
"""
    subprocess.run(["gnuplot"], input=gp.encode(), check=True)
    print("plot:", os.path.join(out, "compare.png"))
else:
    print("gnuplot missing: compare.png skipped")
PY
