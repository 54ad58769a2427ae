#!/usr/bin/env bash
# Fetches llama.cpp's vocabulary GGUFs and tokenizer test vectors from the source bundle shipped
# in the npm package node-llama-cpp, into .cache/vocab (git-ignored). Idempotent.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
version=3.21.1
cache="$here/.cache"
vocab="$cache/vocab"
stamp="$vocab/.complete-$version"
[ -f "$stamp" ] && exit 0

mkdir -p "$cache/npm"
tgz="$cache/npm/node-llama-cpp-$version.tgz"
if [ ! -f "$tgz" ]; then
  echo "fetch_vocab: npm pack node-llama-cpp@$version"
  (cd "$cache/npm" && npm pack --silent "node-llama-cpp@$version" >/dev/null)
fi
bundle="$cache/npm/gitRelease.bundle"
if [ ! -f "$bundle" ]; then
  tar -xzf "$tgz" -C "$cache/npm" package/llama/gitRelease.bundle
  mv "$cache/npm/package/llama/gitRelease.bundle" "$bundle"
  rm -rf "$cache/npm/package"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git clone -q --no-checkout "$bundle" "$tmp/src" 2>/dev/null
rev=$(git -C "$tmp/src" rev-parse HEAD)
mkdir -p "$vocab"
for f in $(git -C "$tmp/src" ls-tree --name-only "$rev" models/ | grep -E 'ggml-vocab-.*\.gguf(\.inp|\.out)?$'); do
  git -C "$tmp/src" show "$rev:$f" > "$vocab/$(basename "$f")"
done
touch "$stamp"
echo "fetch_vocab: $(ls "$vocab" | wc -l) files in $vocab"
