#!/usr/bin/env bash
# Multi-turn sessions on 1 prefill + 1 decode worker: the same conversations (greedy, so the same
# replies) sent with session ids to a cluster whose workers keep their prefix caches (and a
# kvstore, as `tandem cluster up` starts one), and to one with --no-prefix-cache on every worker
# and no kvstore (each turn's whole conversation prefilled and sent cold). Reports per turn: TTFT (median over the conversations), the prompt KV bytes
# prefill sent to decode, and the prompt tokens decode already held.
#
# usage: bench/sessions/run.sh [BUILD_DIR] [OUT_DIR]     (defaults: build, /tmp/tandem-sessions)
# env:   MODEL (default: a llama-1b-shaped Q4_0 synthetic model made with `tandem synth`),
#        SESSIONS (4 conversations), TURNS (6), FIRST (1024 tokens opening each conversation,
#        a character card), INPUT_LEN (64 tokens per user turn), OUTPUT_LEN (96 per reply),
#        THREADS (1 per worker), PIN (1: `cluster up --pin`), CTX (4096), SEED (1),
#        MODES ("sessions cold"), EXTRA (more `tandem cluster up` flags for both clusters),
#        SMOKE=1 (stories260K, 2 short conversations; seconds)
#
# Writes OUT_DIR/{sessions,cold}.json (tandem bench's) and OUT_DIR/results.md, and prints the
# table.
set -euo pipefail

here=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=${1:-$here/build}
OUT=${2:-${TMPDIR:-/tmp}/tandem-sessions}
TANDEM="$BUILD/bin/tandem"
[ -x "$TANDEM" ] || { echo "$TANDEM missing: build the tandem targets first" >&2; exit 1; }
mkdir -p "$OUT"

if [ "${SMOKE:-0}" = 1 ]; then
  MODEL=${MODEL:-$here/../shared/models/stories260K/stories260K.gguf}
  SESSIONS=${SESSIONS:-2}
  FIRST=${FIRST:-64}
  INPUT_LEN=${INPUT_LEN:-16}
  OUTPUT_LEN=${OUTPUT_LEN:-16}
  CTX=${CTX:-1024}
fi
SESSIONS=${SESSIONS:-4}
TURNS=${TURNS:-6}
FIRST=${FIRST:-1024}
INPUT_LEN=${INPUT_LEN:-64}
OUTPUT_LEN=${OUTPUT_LEN:-96}
THREADS=${THREADS:-1}
PIN=${PIN:-1}
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"
CTX=${CTX:-4096}
SEED=${SEED:-1}
MODES=${MODES:-sessions cold}
if [ -z "${MODEL:-}" ]; then
  MODEL=$OUT/llama-1b-q4_0.gguf
  [ -f "$MODEL" ] || "$TANDEM" synth --shape llama-1b --type q4_0 --out "$MODEL"
fi
[ -f "$MODEL" ] || { echo "model $MODEL missing" >&2; exit 1; }

RUN=$(mktemp -d)
cleanup() {
  for mode in $MODES; do
    [ -f "$RUN/$mode/cluster.json" ] && "$TANDEM" cluster down --dir "$RUN/$mode" --grace-ms 3000 >/dev/null 2>&1 || true
  done
  rm -rf "$RUN"
}
trap cleanup EXIT

run_mode() {  # mode, cluster-up flags...
  local mode=$1; shift
  local dir="$RUN/$mode"
  echo "== $mode: cluster up ($*)" >&2
  local pin=()
  [ "$PIN" = 1 ] && pin=(--pin)
  "$TANDEM" cluster up --model "$MODEL" --prefill 1 --decode 1 "$@" "${EXTRA_ARGS[@]}" \
    --dir "$dir" --router-port 0 --http-port 0 --threads "$THREADS" "${pin[@]}" \
    --ctx-size "$CTX" --timeout-ms 300000 >&2
  local router
  router=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["router"])' "$dir/cluster.json")
  # `cluster up` returns once the router serves; a large model's workers register seconds
  # later. One short request that succeeds says both are in.
  local tries=0
  until "$TANDEM" client --router "$router" --prompt warm --max-tokens 1 >/dev/null 2>&1; do
    tries=$((tries + 1))
    [ $tries -lt 120 ] || { echo "$mode: no request succeeded in 120 s" >&2; return 1; }
    sleep 1
  done
  # One conversation at a time (concurrency 1): each turn's TTFT is its own prefill's.
  "$TANDEM" bench --router "$router" --num-requests $((SESSIONS * TURNS)) --concurrency 1 \
    --workload multi-turn --sessions --turns "$TURNS" --first-turn-len "$FIRST" \
    --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --seed "$SEED" --quiet \
    --out "$OUT/$mode.json" >&2
  "$TANDEM" cluster down --dir "$dir" --grace-ms 3000 >&2
}

for mode in $MODES; do
  case $mode in
    sessions) run_mode sessions ;;
    cold) run_mode cold --kvstore 0 --worker-arg=--no-prefix-cache ;;
    *) echo "unknown mode $mode" >&2; exit 2 ;;
  esac
done

python3 - "$OUT" "$TURNS" $MODES <<'PY'
import json, statistics, sys
out, turns, modes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
runs = {}
for m in modes:
    with open(f"{out}/{m}.json") as f:
        runs[m] = json.load(f)["runs"][0]["requests"]
def per_turn(reqs, key):
    return [statistics.median(r[key] for r in reqs if r["ok"] and r["turn"] == t)
            for t in range(turns)]
lines = ["| turn | prompt tokens | " + " | ".join(
    f"{m} TTFT ms | {m} KV MB sent | {m} held tokens" for m in modes) + " |",
    "|---" * (2 + 3 * len(modes)) + "|"]
cols = {m: (per_turn(r, "ttft_ms"), per_turn(r, "kv_transfer_bytes"),
            per_turn(r, "decode_held_tokens")) for m, r in runs.items()}
prompt = per_turn(runs[modes[0]], "prompt_tokens")
for t in range(turns):
    row = [str(t + 1), f"{prompt[t]:.0f}"]
    for m in modes:
        ttft, kv, held = cols[m]
        row += [f"{ttft[t]:.0f}", f"{kv[t] / 1e6:.2f}", f"{held[t]:.0f}"]
    lines.append("| " + " | ".join(row) + " |")
if "sessions" in cols and "cold" in cols:
    s, c = cols["sessions"][0][-1], cols["cold"][0][-1]
    ks, kc = cols["sessions"][1][-1], cols["cold"][1][-1]
    lines.append("")
    lines.append(f"turn {turns}: TTFT {s:.0f} ms with sessions, {c:.0f} ms cold: "
                 f"{100 * s / c:.1f}% of cold; KV sent {ks / 1e6:.2f} MB against "
                 f"{kc / 1e6:.2f} MB ({100 * ks / kc:.1f}%)")
text = "\n".join(lines) + "\n"
with open(f"{out}/results.md", "w") as f:
    f.write(text)
print(text)
PY
