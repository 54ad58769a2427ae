#!/usr/bin/env bash
# `make demo`: the main job on the embedded default model. Until a real trained model is given,
# that model is synthetic (random weights of the stories15M shape with a real Llama vocabulary),
# so the text it writes is gibberish by construction; the point is the pipeline and its speed.
#
# 1. In-process generation (`tandem generate`), for reference.
# 2. A disaggregated cluster of real processes on loopback: router, 1 prefill and 1 decode worker
#    (`tandem cluster up`); one streaming request through it (`tandem client`), whose KV cache
#    goes from the prefill to the decode worker over the KV transport; TTFT and inter-token
#    latency; then the cluster is stopped (always, even on failure or Ctrl-C).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$here/build}
tandem="$build/bin/tandem"
models="$here/.cache/models"
model="$models/default-stories15M-q8_0.gguf"
mkdir -p "$models"
if [ ! -f "$model" ]; then
  echo "demo: making the default synthetic model (tandem synth --shape stories15M --type q8_0)"
  "$tandem" synth --shape stories15M --type q8_0 --seed 1 --out "$model"
fi
threads=$(( $(nproc) / 2 ))
[ "$threads" -ge 1 ] || threads=1
prompt="Once upon a time"
echo "demo: NOTE the default model has RANDOM weights: expect gibberish text, real speed."
echo "demo: tandem generate --model $(basename "$model") --prompt '$prompt' --max-tokens 48"
echo "----"
"$tandem" generate --model "$model" --prompt "$prompt" --max-tokens 48 \
  --temperature 0.8 --seed 42 --threads "$(nproc)"
echo "----"

run_dir=$(mktemp -d "${TMPDIR:-/tmp}/tandem-demo.XXXXXX")
stop_cluster() {
  "$tandem" cluster down --dir "$run_dir" >/dev/null 2>&1 || true
}
trap stop_cluster EXIT
trap 'exit 130' INT TERM
echo "demo: tandem cluster up --prefill 1 --decode 1 (router, prefill and decode processes)"
"$tandem" cluster up --model "$model" --prefill 1 --decode 1 --dir "$run_dir" \
  --router-port 0 --http-port 0 --threads "$threads"
router=$(sed -n 's/^  "router": "\(.*\)",$/\1/p' "$run_dir/cluster.json")
echo "demo: tandem client --router $router --prompt '$prompt' --max-tokens 48 (streamed)"
echo "----"
"$tandem" client --router "$router" --prompt "$prompt" --max-tokens 48 \
  --temperature 0.8 --seed 42
echo "----"
"$tandem" cluster status --dir "$run_dir"
echo "demo: logs in $run_dir; stopping the cluster"
stop_cluster
trap - EXIT

shared="$here/../shared/models/stories260K/stories260K.gguf"
if [ -f "$shared" ]; then
  echo "----"
  echo "demo: the real trained stories260K model from ../shared/models, greedy:"
  "$tandem" generate --model "$shared" --prompt "Once upon a time" --max-tokens 64 \
    --temperature 0 --threads 1
fi
