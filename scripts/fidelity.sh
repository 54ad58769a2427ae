#!/usr/bin/env bash
# `make fidelity`: tandem's greedy output must match the pinned llama.cpp token for token.
#
#   scripts/fidelity.sh [BUILD_DIR]
#
# For each weight type it synthesises a stories15M-shaped model with `tandem synth`, runs
# llama.cpp (tests/fidelity/llama_ref) and `tandem generate` greedily for a few prompts, and
# compares the token ids with tests/fidelity/compare.py (rules in docs/fidelity.md). The real
# stories260K model is checked too when ../shared/models holds it. Exits non-zero on any FAIL.
#
# Environment (all optional):
#   TANDEM_FIDELITY_TYPES   weight types (default "f32 f16 q8_0 q4_0 q4_K")
#   TANDEM_FIDELITY_N       tokens per prompt (default 64)
#   TANDEM_FIDELITY_THREADS threads for both engines (default 2)
#   TANDEM_FIDELITY_DIR     where models and outputs go (default BUILD_DIR/fidelity)
#   TANDEM_FIDELITY_KQUANT  K-quant types checked on the llama-1b shape (default "q4_K"); the
#                           stories15M width (288) is not a multiple of 256, so there most
#                           matrices of a q4_K file fall back to another type
#   TANDEM_FIDELITY_KQUANT_SHAPE  shape for that check (default llama-1b)
#   TANDEM_FIDELITY_MOE_SHAPES  mixture-of-experts shapes (default "qwen3moe-test
#                           qwen2moe-test mixtral-test": qwen3moe, qwen2moe and Mixtral)
#   TANDEM_FIDELITY_MOE_TYPES   their weight types (default "f32 q8_0 q4_K"; the router stays
#                           F32 in each, as llama.cpp's quantizer leaves it)
#   TANDEM_LLAMA_CACHE      llama.cpp build cache (see build_llama_cpp.sh)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$here/build}" && pwd)
tandem="$build/bin/tandem"
types=${TANDEM_FIDELITY_TYPES-"f32 f16 q8_0 q4_0 q4_K"}
n=${TANDEM_FIDELITY_N:-64}
threads=${TANDEM_FIDELITY_THREADS:-2}
work=${TANDEM_FIDELITY_DIR:-$build/fidelity}
shared_model="$here/../shared/models/stories260K/stories260K.gguf"

prompts=(
  "Once upon a time"
  "The little dog ran to the park and saw a big red ball."
  "Tom and Lily were friends. One day, they"
)

log() { echo "fidelity: $*" >&2; }

[ -x "$tandem" ] || { log "no $tandem; build tandem first (make build)"; exit 1; }
log "ensuring llama.cpp is built (first run: 10-20 minutes)"
ref=$("$here/scripts/build_llama_cpp.sh" | tail -n 1)
[ -x "$ref" ] || { log "llama_ref was not built ($ref)"; exit 1; }

mkdir -p "$work/models" "$work/out"
rm -f "$work/out"/*
manifest="$work/out/manifest.tsv"
: > "$manifest"

# run_case TYPE LABEL MODEL STRICT PROMPT_INDEX PROMPT
run_case() {
  local type=$1 label=$2 model=$3 strict=$4 i=$5 prompt=$6
  local base="$work/out/$label-$type-$i"
  # llama_ref: F32 KV cache and flash attention off by default (its closest path to tandem's).
  "$ref" --model "$model" --prompt "$prompt" --n "$n" --threads "$threads" \
    > "$base.ref.json" 2> "$base.ref.err" || true
  "$tandem" generate --model "$model" --prompt "$prompt" --max-tokens "$n" --temperature 0 \
    --seed 0 --threads "$threads" --json > "$base.tandem.json" 2> "$base.tandem.err" || true
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$type" "$label" "$prompt" "$strict" \
    "$base.ref.json" "$base.tandem.json" >> "$manifest"
}

# synth_model SHAPE TYPE: prints the path of the synthetic model, made (or remade whenever tandem
# is newer, since synth's output may have changed with it) under $work/models.
synth_model() {
  local model="$work/models/$1-$2.gguf"
  if [ ! -s "$model" ] || [ "$tandem" -nt "$model" ]; then
    log "synthesising $model"
    "$tandem" synth --shape "$1" --type "$2" --seed 1 --out "$model.tmp" >&2
    mv "$model.tmp" "$model"
  fi
  echo "$model"
}

for type in $types; do
  model=$(synth_model stories15M "$type")
  case "$type" in f32|F32|f16|F16) strict=1 ;; *) strict=0 ;; esac
  for i in "${!prompts[@]}"; do
    log "$type: prompt $i"
    run_case "$type" stories15M "$model" "$strict" "$i" "${prompts[$i]}"
  done
done

kquant_types=${TANDEM_FIDELITY_KQUANT-"q4_K"}
kquant_shape=${TANDEM_FIDELITY_KQUANT_SHAPE:-llama-1b}
for type in $kquant_types; do
  model=$(synth_model "$kquant_shape" "$type")
  log "$type ($kquant_shape): prompt 0"
  run_case "$type" "$kquant_shape" "$model" 0 0 "${prompts[0]}"
done

moe_shapes=${TANDEM_FIDELITY_MOE_SHAPES-"qwen3moe-test qwen2moe-test mixtral-test gpt-oss-test"}
moe_types=${TANDEM_FIDELITY_MOE_TYPES-"f32 q8_0 q4_K mxfp4"}
for shape in $moe_shapes; do
  for type in $moe_types; do
    model=$(synth_model "$shape" "$type")
    case "$type" in f32|F32|f16|F16) strict=1 ;; *) strict=0 ;; esac
    for i in "${!prompts[@]}"; do
      log "$type ($shape): prompt $i"
      run_case "$type" "$shape" "$model" "$strict" "$i" "${prompts[$i]}"
    done
  done
done

if [ -f "$shared_model" ]; then
  log "real model stories260K (f32)"
  run_case f32 stories260K "$shared_model" 1 0 "${prompts[0]}"
  run_case f32 stories260K "$shared_model" 1 bos ""
else
  log "skipping stories260K: $shared_model not found"
fi

python3 "$here/tests/fidelity/compare.py" "$manifest"
