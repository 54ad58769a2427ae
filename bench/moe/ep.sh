#!/usr/bin/env bash
# Expert parallelism against one process: a colocated worker as an EP group of 2 processes of
# one compute thread each, against one process of 2 threads (the same cores), on the same MoE
# GGUF. Per round and config: batch-1 decode tok/s (128 tokens) and the time to first token of
# a 512-token prompt (prefill), from `tandem client`; configs alternate within each round.
#
#   bench/moe/ep.sh BUILD_DIR MODEL.gguf [ROUNDS]
# CONFIGS lists NAME:EP:THREADS triples (default "ep1:1:2 ep2:2:1"; threads are per process).
# Prints one line per run and a median table; the clusters' logs stay under $OUT.
set -euo pipefail
build=${1:?build dir}
model=${2:?model gguf}
rounds=${3:-3}
bin="$build/bin"
out=${OUT:-$(mktemp -d /tmp/tandem-ep-bench.XXXXXX)}
mkdir -p "$out"
long_prompt=$(python3 -c 'print(" ".join(["the quick brown fox jumps over the lazy dog"] * 60))')

run_config() {  # NAME EP THREADS ROUND
  local name=$1 ep=$2 threads=$3 round=$4 dir="$out/$1-r$4"
  rm -rf "$dir"
  "$bin/tandem" cluster up --model "$model" --prefill 0 --decode 0 --colocated 1 --ep "$ep" \
    --threads "$threads" --kvstore 0 --dir "$dir" --timeout-ms 600000 > "$dir.up.log" 2>&1
  local router
  router=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' \
    "$dir/cluster.json")
  # Warm-up, then the measured runs.
  "$bin/tandem" client --router "$router" --prompt "Once upon a time" --max-tokens 8 \
    --temperature 0 > /dev/null 2>&1
  local dec ttft line
  line=$("$bin/tandem" client --router "$router" --prompt "Once upon a time" --max-tokens 128 \
    --temperature 0 2>&1 >/dev/null | tail -1)
  echo "$name round $round: $line" >> "$out/client.log"
  dec=$(sed -n 's/.*decode \([0-9.]*\) tok\/s.*/\1/p' <<< "$line")
  line=$("$bin/tandem" client --router "$router" --prompt "$long_prompt" --max-tokens 1 \
    --temperature 0 2>&1 >/dev/null | tail -1)
  echo "$name round $round: $line" >> "$out/client.log"
  ttft=$(sed -n 's/.*ttft \([0-9.]*\) ms.*/\1/p' <<< "$line")
  "$bin/tandem" cluster down --dir "$dir" > /dev/null 2>&1
  echo "$name round $round: decode $dec tok/s, prefill-512 ttft $ttft ms"
  echo "$name $dec $ttft" >> "$out/results"
}

: > "$out/results"
for r in $(seq 1 "$rounds"); do
  for c in ${CONFIGS:-ep1:1:2 ep2:2:1}; do
    IFS=: read -r name ep threads <<< "$c"
    run_config "$name" "$ep" "$threads" "$r"
  done
done
python3 - "$out/results" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, dec, ttft = line.split()
    rows.setdefault(name, []).append((float(dec), float(ttft)))
med = {n: (statistics.median(d for d, _ in v), statistics.median(t for _, t in v))
       for n, v in rows.items()}
print("| config | decode tok/s (median) | prefill-512 TTFT ms (median) |")
print("|---|---:|---:|")
for n, (d, t) in med.items():
    print(f"| {n} | {d:.2f} | {t:.0f} |")
for n in med:
    if n != "ep1" and "ep1" in med:
        print(f"{n} / ep1: decode {med[n][0] / med['ep1'][0]:.2f}x, "
              f"prefill time {med[n][1] / med['ep1'][1]:.2f}x")
PY
