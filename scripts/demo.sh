#!/usr/bin/env bash
# `make demo`: the main job on the embedded default model. Until a real trained model is given,
# that model is synthetic (random weights of the stories15M shape with a real Llama vocabulary),
# so the text it writes is gibberish by construction; the point is the pipeline and its speed.
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
echo "demo: NOTE the default model has RANDOM weights: expect gibberish text, real speed."
echo "demo: tandem generate --model $(basename "$model") --prompt 'Once upon a time' --max-tokens 48"
echo "----"
"$tandem" generate --model "$model" --prompt "Once upon a time" --max-tokens 48 \
  --temperature 0.8 --seed 42 --threads "$(nproc)"
echo "----"
shared="$here/../shared/models/stories260K/stories260K.gguf"
if [ -f "$shared" ]; then
  echo "demo: the real trained stories260K model from ../shared/models, greedy:"
  "$tandem" generate --model "$shared" --prompt "Once upon a time" --max-tokens 64 \
    --temperature 0 --threads 1
fi
