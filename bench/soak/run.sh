#!/usr/bin/env bash
# Soak: steady open-loop load at 70% of saturation through a local cluster of real processes
# (`tandem cluster up`: router, prefill, decode and kvstore, KV over UCX), with shared prefixes
# and clients that hang up mid-stream, for MINUTES (default 30). Reports failed requests, the p99
# TTFT of the first and of the last 5 minutes, and each process's RSS after the warm-up (the
# first 5 minutes) and at the end (docs/perf/soak.md).
#
#   bench/soak/run.sh BUILD_DIR [MINUTES]
#   env: MODEL (default ../shared/models/stories260K/stories260K.gguf), POLICY (the router's,
#        default kv-aware: the one that keeps a prefix index), OUT (default a temp dir; kept:
#        cluster logs, one bench JSON per minute, rss.csv, index.csv, cancels.log), METRICS_PORT
#        (the router's /metrics, default 19190: its prefix index size goes into index.csv)
set -euo pipefail
build=${1:?usage: bench/soak/run.sh BUILD_DIR [MINUTES]}
minutes=${2:-30}
here=$(cd "$(dirname "$0")/../.." && pwd)
bin=$(cd "$build/bin" && pwd)
model=${MODEL:-$here/../shared/models/stories260K/stories260K.gguf}
out=${OUT:-$(mktemp -d /tmp/tandem-soak.XXXXXX)}
mkdir -p "$out"
tandem="$bin/tandem"
workload=(--workload shared-prefix --prefix-len 192 --input-len 48 --output-len 96)

"$tandem" cluster up --model "$model" --dir "$out/cluster" --prefill 1 --decode 1 --kvstore 1 \
  --threads 1 --policy "${POLICY:-kv-aware}" --router-arg="--metrics-port=${METRICS_PORT:-19190}" \
  >"$out/up.log" 2>&1
trap '"$tandem" cluster down --dir "$out/cluster" >/dev/null 2>&1 || true; kill $(jobs -p) 2>/dev/null || true' EXIT
router=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' \
  "$out/cluster/cluster.json")
echo "soak: cluster up, router $router; results in $out"

# Clients that hang up: one every 2 s, killed 0.2-0.8 s into a long stream.
(
  i=0
  while :; do
    i=$((i + 1))
    timeout -s TERM "0.$((2 + i % 7))" "$tandem" client --router "$router" \
      --prompt "Once upon a time, in a soak run, story $i" --max-tokens 400 >/dev/null 2>&1 || true
    echo "$(date +%s) cancel $i" >>"$out/cancels.log"
    sleep 2
  done
) &

# Saturation: the closed loop's throughput with more clients than the decode batch, with the
# hang-up clients already running (as in the soak), the median of 3 runs: one run alone moved
# by 10% between sessions on this VM, and 70% of a high one overloaded the decode pool.
for i in 1 2 3; do
  "$tandem" bench --router "$router" --concurrency 48 --num-requests 400 --seed "$((100 + i))" \
    --quiet "${workload[@]}" --out "$out/saturation-$i.json" >/dev/null
done
read -r sat rate < <(python3 -c 'import json,statistics,sys
xs = [json.load(open(f))["runs"][0] for f in sys.argv[1:]]
s = statistics.median(r["completed"] / r["duration_s"] for r in xs)
print(round(s, 2), round(0.7 * s, 2))' "$out"/saturation-{1,2,3}.json)
echo "soak: saturation $sat req/s (median of 3); soaking at $rate req/s"

# Each process's RSS every 10 s.
pids=$(python3 -c 'import json,sys
for p in json.load(open(sys.argv[1]))["processes"]: print(p["name"] + ":" + str(p["pid"]))' \
  "$out/cluster/cluster.json")
(
  echo "t,process,rss_kb"
  t0=$(date +%s)
  while :; do
    for np in $pids; do
      rss=$(ps -o rss= -p "${np#*:}" 2>/dev/null | tr -d ' ') || true
      echo "$(( $(date +%s) - t0 )),${np%%:*},${rss:-0}"
    done
    idx=$(curl -s "http://127.0.0.1:${METRICS_PORT:-19190}/metrics" |
      awk '/^tandem_prefix_index_blocks/ {print $2}') || true
    echo "$(( $(date +%s) - t0 )),${idx:-0}" >>"$out/index.csv"
    sleep 10
  done
) >"$out/rss.csv" &

# The load: one open-loop run per minute, back to back.
per_min=$(python3 -c "print(max(1, round($rate * 60)))")
for m in $(seq 1 "$minutes"); do
  "$tandem" bench --router "$router" --request-rate "$rate" --num-requests "$per_min" \
    --seed "$m" --quiet "${workload[@]}" --out "$out/minute-$(printf %02d "$m").json" >/dev/null
done
kill $(jobs -p) 2>/dev/null || true

python3 - "$out" "$minutes" <<'PY'
import csv, glob, json, sys
out, minutes = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f))["runs"][0] for f in sorted(glob.glob(f"{out}/minute-*.json"))]
def p99(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")
def ttfts(rs):
    return [q["ttft_ms"] for r in rs for q in r["requests"] if q["ok"]]
failed = sum(r["failed"] for r in runs)
done = sum(r["completed"] for r in runs)
errors = sorted({e for r in runs for e in r["errors"]})
first, last = p99(ttfts(runs[:5])), p99(ttfts(runs[-5:]))
print(f"requests: {done} completed, {failed} failed{': ' + '; '.join(errors) if errors else ''}")
print(f"p99 TTFT: first 5 min {first:.1f} ms, last 5 min {last:.1f} ms, drift {last / first - 1:+.1%}")
rss = {}
for row in csv.DictReader(open(f"{out}/rss.csv")):
    rss.setdefault(row["process"], []).append((int(row["t"]), int(row["rss_kb"])))
print("| process | RSS after warm-up (MiB) | RSS at the end (MiB) | growth |")
print("| --- | ---: | ---: | ---: |")
for name, xs in sorted(rss.items()):
    warm = next((v for t, v in xs if t >= 300), xs[0][1])
    end = xs[-1][1]
    print(f"| {name} | {warm / 1024:.1f} | {end / 1024:.1f} | {end / warm - 1:+.1%} |")
idx = [tuple(map(float, l.split(","))) for l in open(f"{out}/index.csv")] \
    if glob.glob(f"{out}/index.csv") else []
if idx:
    warm = next((v for t, v in idx if t >= 300), idx[0][1])
    print(f"router prefix index: {warm:.0f} hashes after warm-up, {idx[-1][1]:.0f} at the end, "
          f"{max(v for _, v in idx):.0f} at most")
cancels = sum(1 for _ in open(f"{out}/cancels.log")) if glob.glob(f"{out}/cancels.log") else 0
print(f"client hang-ups: {cancels}")
PY
