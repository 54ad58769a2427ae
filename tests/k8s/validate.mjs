// Validates rendered Kubernetes manifests (helm template output) against the Kubernetes
// OpenAPI schemas of the npm package kubernetes-models, and the CRDs the chart uses (KEDA
// ScaledObject, Prometheus Operator ServiceMonitor) against their @kubernetes-models siblings.
// Then checks what a schema cannot: references between the rendered objects (selectors match
// pod labels, Services and probes name ports the containers declare, autoscalers and PDBs
// point at workloads of this render, ConfigMaps referenced exist).
//
// Usage: node validate.mjs MODULES_DIR FILE.yaml...   (MODULES_DIR: where scripts/fetch_helm.sh
// installed tests/k8s/package.json, i.e. .cache/k8s-validate). Prints one line per object and
// every problem; exits 1 when there is any problem, 2 on bad usage.
import fs from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [modulesDir, ...files] = process.argv.slice(2);
if (!modulesDir || files.length === 0) {
  console.error("usage: node validate.mjs MODULES_DIR FILE.yaml...");
  process.exit(2);
}
const nm = path.resolve(modulesDir, "node_modules");
const yaml = (await import(pathToFileURL(path.join(nm, "js-yaml/dist/js-yaml.mjs")))).default;

// Where each apiVersion's models live: core and built-in groups in kubernetes-models, CRDs in
// their own packages. The file is <root>/<group>/<version>/<Kind>.js ("v1" has no group).
const roots = [
  "kubernetes-models",
  "@kubernetes-models/keda",
  "@kubernetes-models/prometheus-operator",
];
async function modelFor(apiVersion, kind) {
  for (const root of roots) {
    const file = path.join(nm, root, apiVersion, `${kind}.js`);
    if (fs.existsSync(file)) {
      const mod = await import(pathToFileURL(file));
      if (mod[kind]) return mod[kind];
    }
  }
  return null;
}

const problems = [];
const objects = [];
for (const file of files) {
  const docs = yaml.loadAll(fs.readFileSync(file, "utf8"));
  for (const doc of docs) {
    if (doc === null || doc === undefined) continue;
    const where = `${path.basename(file)}: ${doc.kind}/${doc.metadata?.name}`;
    if (!doc.apiVersion || !doc.kind) {
      problems.push(`${where}: missing apiVersion or kind`);
      continue;
    }
    const Model = await modelFor(doc.apiVersion, doc.kind);
    if (!Model) {
      problems.push(`${where}: no schema for ${doc.apiVersion} ${doc.kind}`);
      continue;
    }
    try {
      new Model(doc).validate();
    } catch (e) {
      problems.push(`${where}: ${e.message}`);
      continue;
    }
    const name = doc.metadata?.name ?? "";
    if (!/^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/.test(name) || name.length > 63) {
      problems.push(`${where}: metadata.name is not a DNS-1123 label`);
    }
    objects.push({ file, where, doc });
    console.log(`ok   ${where}`);
  }
}

// --- References between objects ------------------------------------------------------------
const workloads = objects.filter((o) =>
  ["Deployment", "StatefulSet", "DaemonSet"].includes(o.doc.kind));
const matches = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);
const podsSelectedBy = (selector) =>
  workloads.filter((w) => matches(selector, w.doc.spec.template.metadata?.labels));
const containerPorts = (w) => {
  const ports = new Map();
  for (const c of w.doc.spec.template.spec.containers) {
    for (const p of c.ports ?? []) {
      if (p.name) ports.set(p.name, p.containerPort);
      ports.set(p.containerPort, p.containerPort);
    }
  }
  return ports;
};
const configMaps = new Set(objects.filter((o) => o.doc.kind === "ConfigMap")
  .map((o) => o.doc.metadata.name));

for (const w of workloads) {
  const spec = w.doc.spec;
  if (!matches(spec.selector.matchLabels, spec.template.metadata?.labels)) {
    problems.push(`${w.where}: spec.selector does not match the pod template's labels`);
  }
  if (w.doc.kind === "StatefulSet" &&
      !objects.some((o) => o.doc.kind === "Service" && o.doc.metadata.name === spec.serviceName &&
                           o.doc.spec.clusterIP === "None")) {
    problems.push(`${w.where}: serviceName ${spec.serviceName} is not a headless Service here`);
  }
  const ports = containerPorts(w);
  const volumes = new Set((spec.template.spec.volumes ?? []).map((v) => v.name));
  for (const vct of spec.volumeClaimTemplates ?? []) volumes.add(vct.metadata.name);
  const all = [...(spec.template.spec.initContainers ?? []), ...spec.template.spec.containers];
  for (const c of all) {
    for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
      const p = c[probe];
      const port = p?.grpc?.port ?? p?.httpGet?.port ?? p?.tcpSocket?.port;
      if (p && !ports.has(port)) {
        problems.push(`${w.where}: ${c.name}.${probe} port ${port} is not a container port`);
      }
    }
    for (const m of c.volumeMounts ?? []) {
      if (!volumes.has(m.name)) problems.push(`${w.where}: ${c.name} mounts unknown volume ${m.name}`);
    }
    for (const e of c.envFrom ?? []) {
      const cm = e.configMapRef?.name;
      if (cm && !configMaps.has(cm)) problems.push(`${w.where}: ${c.name} reads unknown ConfigMap ${cm}`);
    }
  }
}

for (const o of objects) {
  const { doc, where } = o;
  if (doc.kind === "Service" && doc.spec.selector) {
    const pods = podsSelectedBy(doc.spec.selector);
    if (pods.length === 0) problems.push(`${where}: selects no workload of this render`);
    for (const p of doc.spec.ports ?? []) {
      const target = p.targetPort ?? p.port;
      for (const w of pods) {
        if (!containerPorts(w).has(target)) {
          problems.push(`${where}: targetPort ${target} is not a port of ${w.where}`);
        }
      }
    }
  }
  if (doc.kind === "PodDisruptionBudget" && podsSelectedBy(doc.spec.selector.matchLabels).length === 0) {
    problems.push(`${where}: selects no workload of this render`);
  }
  if (doc.kind === "NetworkPolicy" && podsSelectedBy(doc.spec.podSelector.matchLabels).length === 0) {
    problems.push(`${where}: selects no workload of this render`);
  }
  if (doc.kind === "HorizontalPodAutoscaler" || doc.kind === "ScaledObject") {
    const ref = doc.spec.scaleTargetRef;
    if (!workloads.some((w) => w.doc.kind === (ref.kind ?? "Deployment") &&
                               w.doc.metadata.name === ref.name)) {
      problems.push(`${where}: scaleTargetRef ${ref.kind}/${ref.name} is not in this render`);
    }
    const target = workloads.find((w) => w.doc.metadata.name === ref.name);
    if (target && target.doc.spec.replicas !== undefined) {
      problems.push(`${where}: ${target.where} sets spec.replicas, which fights the autoscaler`);
    }
  }
}

for (const p of problems) console.log(`FAIL ${p}`);
console.log(`${objects.length} objects valid, ${problems.length} problems`);
process.exit(problems.length === 0 ? 0 : 1);
