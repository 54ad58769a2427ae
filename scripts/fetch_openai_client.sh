#!/usr/bin/env bash
# Installs the real clients the HTTP and gRPC conformance tests drive (the official `openai`
# package, the Vercel AI SDK, LangChain, `buf curl`) and the schema tooling (ts-json-schema-
# generator, ajv) into .cache/openai-client (git-ignored), at the versions pinned in
# tests/integration/openai_client/package.json and package-lock.json (`npm ci`). The versions
# are the newest that run on the Node 20 these machines have.
# Idempotent; scripts/setup.sh (and so `make test`) calls it. The tests skip what is absent.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
src="$here/tests/integration/openai_client"
dest="$here/.cache/openai-client"
stamp="$dest/.complete-$(cat "$src/package.json" "$src/package-lock.json" | sha256sum | cut -c1-16)"
[ -f "$stamp" ] && exit 0
command -v npm >/dev/null || { echo "fetch_openai_client: npm is not installed" >&2; exit 1; }

mkdir -p "$dest"
cp "$src/package.json" "$src/package-lock.json" "$dest/"
echo "fetch_openai_client: npm ci (tests/integration/openai_client) into $dest"
# No install scripts: @bufbuild/buf's only checks that its platform package is present.
(cd "$dest" && npm ci --silent --no-audit --no-fund --ignore-scripts >/dev/null)
rm -f "$dest"/.complete-*
touch "$stamp"
