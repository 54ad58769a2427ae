#!/usr/bin/env bash
# The helm chart's acceptance test (ctest helm_chart_test, label k8s):
#   1. `helm lint --strict` with the defaults and with every helm/tandem/ci/*.yaml;
#   2. `helm template` of each of those, validated against the Kubernetes schemas (and the KEDA
#      and Prometheus Operator CRD schemas) plus cross-object references (validate.mjs);
#   3. the validator itself rejects a broken manifest (so step 2 can fail);
#   4. values.schema.json rejects typos and bad values (each case must fail, naming the key);
#   5. facts the templates compute: --grace-ms from the termination grace, nvidia.com/gpu only
#      with gpu.enabled, replicas left to the autoscaler, KEDA replacing the HPAs;
#   6. several routers: the headless router Service the workers register through, and a PDB.
# Whether the rendered flags work is proven by running the pods (tests/deploy, label deploy).
# Usage: chart_test.sh REPO_ROOT [BIN_DIR]. Exits 77 (ctest SKIP_RETURN_CODE) when helm, node or
# the validator modules are absent: scripts/fetch_helm.sh (run by scripts/setup.sh) fetches them.
set -uo pipefail
root=${1:?usage: chart_test.sh REPO_ROOT [BIN_DIR]}
bin_dir=${2:-}
chart="$root/helm/tandem"
helm="$root/.cache/helm/helm"
modules="$root/.cache/k8s-validate"
validate="$root/tests/k8s/validate.mjs"

if [ ! -x "$helm" ] || ! command -v node >/dev/null || [ ! -d "$modules/node_modules/kubernetes-models" ]; then
  echo "SKIP: helm (.cache/helm/helm), node or the schema models (.cache/k8s-validate) are absent;" \
       "run scripts/fetch_helm.sh"
  exit 77
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
passes=0
pass() { passes=$((passes + 1)); echo "PASS $*"; }
fail() { failures=$((failures + 1)); echo "FAIL $*"; }

# 1 and 2: lint and validate every values set.
value_sets=("" "$chart"/ci/*.yaml)
for vs in "${value_sets[@]}"; do
  name=${vs:+$(basename "$vs" .yaml)}
  name=${name:-chart-defaults}
  args=()
  [ -n "$vs" ] && args=(-f "$vs")
  if out=$("$helm" lint --strict "$chart" "${args[@]}" 2>&1); then
    pass "helm lint --strict ($name)"
  else
    fail "helm lint --strict ($name)"; echo "$out"
  fi
  if "$helm" template tandem "$chart" --namespace serving "${args[@]}" >"$tmp/$name.yaml" 2>"$tmp/err"; then
    if out=$(node "$validate" "$modules" "$tmp/$name.yaml" 2>&1); then
      pass "helm template + schema validation ($name): $(echo "$out" | tail -1)"
    else
      fail "schema validation ($name)"; echo "$out" | grep -v '^ok'
    fi
  else
    fail "helm template ($name)"; cat "$tmp/err"
  fi
done
for want in default-values gpu-values keda-values minimal-values; do
  [ -f "$chart/ci/$want.yaml" ] || fail "helm/tandem/ci/$want.yaml is missing"
done

# 3: the validator catches a schema error and a dangling reference.
cat >"$tmp/broken.yaml" <<'EOF'
apiVersion: apps/v1
kind: Deployment
metadata: {name: broken}
spec:
  selector: {matchLabels: {app: broken}}
  template:
    metadata: {labels: {app: broken}}
    spec:
      containers:
        - name: c
          image: x
          ports: [{name: grpc, containerPort: "not-a-number"}]
---
apiVersion: v1
kind: Service
metadata: {name: dangling}
spec:
  selector: {app: nobody}
  ports: [{port: 80}]
EOF
out=$(node "$validate" "$modules" "$tmp/broken.yaml" 2>&1)
if [ $? -ne 0 ] && grep -q "containerPort must be integer" <<<"$out" && grep -q "dangling: selects no workload" <<<"$out"; then
  pass "the validator rejects a schema error and a dangling selector"
else
  fail "the validator accepted a broken manifest"; echo "$out"
fi

# 4: typos and bad values are rejected by values.schema.json, naming the offending key.
expect_reject() {  # expect_reject WHAT EXPECTED_MESSAGE_PART helm-args...
  local what=$1 expect=$2; shift 2
  if out=$("$helm" template tandem "$chart" "$@" 2>&1); then
    fail "values schema accepted $what"
  elif grep -qF -- "$expect" <<<"$out"; then
    pass "values schema rejects $what"
  else
    fail "values schema rejected $what without naming it"; echo "$out"
  fi
}
cat >"$tmp/typo.yaml" <<'EOF'
decode:
  replcias: 3
EOF
expect_reject "a misspelt key in a values file (decode.replcias)" "Additional property replcias is not allowed" -f "$tmp/typo.yaml"
expect_reject "a misspelt top-level key" "Additional property kvStore is not allowed" --set kvStore.enabled=false
expect_reject "a misspelt nested key" "Additional property sotrageClassName is not allowed" --set kvstore.persistence.sotrageClassName=fast
expect_reject "a misspelt key in a list item" "Additional property traget is not allowed" \
  --set prefill.autoscaling.metrics[0].name=queueDepth --set prefill.autoscaling.metrics[0].traget=3
expect_reject "a decode-only signal on the prefill pool" "prefill.autoscaling.metrics.0.name" \
  --set prefill.autoscaling.metrics[0].name=kvUsage
expect_reject "an unknown model source" "model.source" --set model.source=s3
expect_reject "a port out of range" "router.grpcPort" --set router.grpcPort=70000
expect_reject "both minAvailable and maxUnavailable" "decode.pdb" --set decode.pdb.minAvailable=1
expect_reject "a bad resource quantity" "decode.resources.requests.cpu" --set decode.resources.requests.cpu=lots
expect_reject "a grace period shorter than the preStop sleep" "terminationGracePeriodSeconds" \
  --set router.preStopSleepSeconds=30 --set router.terminationGracePeriodSeconds=20
expect_reject "a PVC model source without a claim" "claimName is required" --set model.source=persistentVolumeClaim

# 5: what the templates compute.
render() { "$helm" template tandem "$chart" --namespace serving "$@" 2>&1; }
decode_doc() {  # the decode Deployment of a render on stdin
  python3 -c 'import sys; print("".join(d for d in sys.stdin.read().split("\n---\n")
                                       if "\nkind: Deployment\n" in d and "\n  name: tandem-decode\n" in d))'
}
out=$(render --set decode.terminationGracePeriodSeconds=120 --set decode.preStopSleepSeconds=3 | decode_doc)
if grep -q -- "--grace-ms=112000" <<<"$out" && grep -q 'command: \["sleep", "3"\]' <<<"$out"; then
  pass "decode --grace-ms = (terminationGracePeriodSeconds - preStop - 5 s), preStop sleeps"
else
  fail "decode --grace-ms or preStop"; grep -n "grace-ms\|sleep" <<<"$out"
fi
if grep -q "nvidia.com/gpu:" "$tmp/chart-defaults.yaml"; then fail "CPU defaults request nvidia.com/gpu"; else pass "CPU defaults request no GPU"; fi
out=$(cat "$tmp/gpu-values.yaml")
if [ "$(grep -c 'nvidia.com/gpu: 1' <<<"$out")" -eq 4 ] && grep -q 'image: ghcr.io/tandem/tandem:.*-cuda' <<<"$out"; then
  pass "GPU values: prefill and decode request and limit nvidia.com/gpu, the -cuda image"
else
  fail "GPU values: nvidia.com/gpu or the -cuda image"; grep -n "nvidia.com/gpu\|image:" <<<"$out"
fi
dep=$(decode_doc <<<"$out")
if [ "$(grep -c '^kind: HorizontalPodAutoscaler' <<<"$out")" -eq 2 ] && ! grep -q '^kind: ScaledObject' <<<"$out" &&
   grep -q 'command: \["tandem-decode"\]' <<<"$dep" && ! grep -q '^  replicas:' <<<"$dep"; then
  pass "GPU values: two HPAs, no ScaledObject, no fixed decode replicas"
else
  fail "GPU values: HPAs / replicas"
fi
out=$(cat "$tmp/keda-values.yaml")
if [ "$(grep -c '^kind: ScaledObject' <<<"$out")" -eq 2 ] && ! grep -q '^kind: HorizontalPodAutoscaler' <<<"$out" &&
   grep -q 'tandem_recommended_replicas{namespace=\\"serving\\",role=\\"prefill\\"}' <<<"$out" &&
   grep -q 'tandem_kv_cache_usage_perc{namespace=\\"serving\\",role=\\"decode\\"}' <<<"$out"; then
  pass "KEDA values: two ScaledObjects on the pool signals, no HPA"
else
  fail "KEDA values: ScaledObjects"; grep -n "kind:\|query:" <<<"$out"
fi
out=$(cat "$tmp/gpu-values.yaml")
if [ "$(grep -c -- '- --tls-require-client-cert' <<<"$out")" -eq 4 ] && ! grep -q '^ *grpc:$' <<<"$out" &&
   [ "$(grep -c '^ *grpc:$' "$tmp/chart-defaults.yaml")" -gt 0 ] && ! grep -q -- '--tls-' "$tmp/chart-defaults.yaml"; then
  pass "mTLS values: --tls-* flags on all four components, TCP probes (kubelet's gRPC probe has no TLS)"
else
  fail "TLS flags or probes"
fi
out=$(render --set kvstore.kind=DaemonSet)
if grep -q '^kind: DaemonSet' <<<"$out" && ! grep -q '^kind: StatefulSet' <<<"$out" &&
   grep -q 'internalTrafficPolicy: Local' <<<"$out"; then
  pass "kvstore.kind=DaemonSet renders a DaemonSet with node-local traffic"
else
  fail "kvstore DaemonSet option"
fi

# 6: several routers, each worker registering with every one of them through the headless
# Service, and a PDB so that drains take one router at a time. Whether the flags work is proven
# by running the rendered pods (tests/deploy, CTest label deploy), not here.
out=$(render --set router.replicas=3)
if grep -q 'name: tandem-router-headless' <<<"$out" && grep -q 'publishNotReadyAddresses: true' <<<"$out" &&
   grep -q 'TANDEM_ROUTER_ADDR: "tandem-router-headless:50051"' <<<"$out" &&
   grep -A12 '^kind: PodDisruptionBudget' <<<"$out" | grep -q 'app.kubernetes.io/component: router'; then
  pass "router.replicas=3: workers register through the headless router Service; a router PDB"
else
  fail "several routers"
fi

echo "chart_test: $passes passed, $failures failed"
[ "$failures" -eq 0 ]
