#!/usr/bin/env bash
# Does the workers' MBU gauge agree with the roofline docs/perf/engine-cpu.md computes?
#
# Per round, side by side: `membw` (THREADS threads, the probe engine-cpu.md divides by) just
# before and just after `engine_bench --modes decode --mbu` on MODEL at batch 1, which reports
#   - the gauge's figure: the engine's step bytes (weights + K/V read) over its step time,
#     against the peak MeasureCpuPeaks measures as a worker does at start, and
#   - the weight bytes per token x tok/s that engine-cpu.md's roofline column uses,
# and prints the gauge, the engine-cpu.md figure (weight GB/s over the mean of membw's two
# medians, which bracket the worker-style probe in time: this host's bandwidth moves by tens of
# percent within seconds) and their ratio. Results: docs/perf/step-cost.md.
#
# Usage: bench/engine/mbu_check.sh BUILD_DIR MODEL [ROUNDS] [THREADS]
set -euo pipefail
build=${1:?build dir}
model=${2:?GGUF model}
rounds=${3:-5}
threads=${4:-2}
printf 'round\tmembw_gbs\tpeak_gbs\tweight_gbs\tstep_gbs\ttok_s\tgauge_mbu\tengine_cpu_mbu\tratio\n'
for r in $(seq 1 "$rounds"); do
  membw() {
    "$build/bin/membw" --threads "$threads" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["gb_per_s"]["median"])'
  }
  before=$(membw)
  out=$("$build/bin/engine_bench" --model "$model" -t "$threads" --modes decode --mbu -n 64 -r 3 \
    --kv-type f32)
  after=$(membw)
  bw=$(python3 -c "print(($before + $after) / 2)")
  echo "$out" | python3 -c '
import json, sys
r, bw = sys.argv[1], float(sys.argv[2])
d = json.load(sys.stdin)["decode"]
gauge = d["mbu"]["median"]
weights = d["weight_gb_per_s"]["median"]
step = d["engine_step_gb_per_s"]["median"]
tps = d["tokens_per_s"]["median"]
peak = d["peak_read_gbs"]
doc = weights / bw
print(f"{r}\t{bw:.1f}\t{peak:.1f}\t{weights:.1f}\t{step:.1f}\t{tps:.1f}\t{gauge:.3f}\t{doc:.3f}\t{gauge / doc:.3f}")
' "$r" "$bw"
done
