#!/usr/bin/env bash
# Fetches the official `openai` npm package at a pinned version into .cache/openai-client
# (git-ignored) for tests/integration/openai_client. `npm pack` downloads only the package
# tarball, which is unpacked as node_modules/openai: openai 6 has no runtime dependencies.
# Version: the newest major needs Node 22; 6.30.1 runs on the Node 20 these machines have.
# Idempotent; scripts/setup.sh (and so `make test`) calls it. The test skips when the package
# is absent.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
version=$(sed -n 's/.*"openai": *"\([0-9.]*\)".*/\1/p' "$here/tests/integration/openai_client/package.json")
dest="$here/.cache/openai-client"
stamp="$dest/.complete-$version"
[ -f "$stamp" ] && exit 0
command -v npm >/dev/null || { echo "fetch_openai_client: npm is not installed" >&2; exit 1; }

mkdir -p "$dest"
tgz="$dest/openai-$version.tgz"
if [ ! -f "$tgz" ]; then
  echo "fetch_openai_client: npm pack openai@$version"
  (cd "$dest" && npm pack --silent "openai@$version" >/dev/null)
fi
rm -rf "$dest/node_modules/openai"
mkdir -p "$dest/node_modules/openai"
tar -xzf "$tgz" -C "$dest/node_modules/openai" --strip-components=1
touch "$stamp"
echo "fetch_openai_client: openai@$version in $dest/node_modules/openai"
