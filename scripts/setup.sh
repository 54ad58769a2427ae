#!/usr/bin/env bash
# Installs what tandem needs to build and test: Debian packages, then the llama.cpp vocabulary
# files used by the tokenizer tests and by `tandem synth`. Idempotent: a second run does nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)

pkgs=(cmake ninja-build ccache g++ clang pkg-config git
      libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev nlohmann-json3-dev
      libxxhash-dev libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
      libucx-dev ucx-utils prometheus-cpp-dev liburing-dev libcpp-httplib-dev libspdlog-dev
      gnuplot-nox python3-yaml iproute2 util-linux openssl
      fio)  # fio: the SSD tier's reference in bench/kv_tiers
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

# promtool, which the metrics tests pipe each service's /metrics output through, comes with
# Debian's prometheus package. Without recommends: the node exporter is not wanted.
if ! command -v promtool >/dev/null; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends prometheus
fi

command -v npm >/dev/null || missing_npm=1
if [ -n "${missing_npm:-}" ]; then
  DEBIAN_FRONTEND=noninteractive ${sudo_cmd:-} apt-get install -y -qq nodejs npm
fi

"$here/scripts/fetch_vocab.sh"
# The official openai npm client, which the HTTP front door's integration test drives.
"$here/scripts/fetch_openai_client.sh"
# helm and the Kubernetes schema validators the chart tests (tests/k8s) use.
"$here/scripts/fetch_helm.sh"
