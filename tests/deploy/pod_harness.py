"""The pod harness: `helm template` output run as real processes, one network namespace a pod.

No Kubernetes API server, kubelet or container runtime can run on the machines tandem is tested
on, so this module plays their parts for the objects the chart renders:

- every replica of a Deployment, StatefulSet or DaemonSet becomes a pod: a network namespace
  with a veth to a bridge and its own IP, its own UTS and IPC namespaces (hostname = pod name),
  and a mount namespace holding its volumes at their mountPaths;
- the bridge lives in a namespace of its own ("the switch"): the host's network namespace has no
  interface on it, there is no default route and no NAT, so pods reach only each other and the
  harness's client namespace;
- each pod's /etc/netns/<ns>/hosts (bind-mounted over /etc/hosts by `ip netns exec`) resolves
  every Service name, in its short, namespaced and cluster-local forms, to the IPs of the ready
  pods the Service selects (every running pod for publishNotReadyAddresses), and a StatefulSet
  pod's stable name under its headless Service; the files are rewritten in place (same inode)
  whenever readiness changes;
- a container runs its manifest's command and args with the manifest's env (envFrom ConfigMaps,
  valueFrom fieldRef metadata.name / metadata.namespace / status.podIP, $(VAR) expansion), as
  runAsUser / runAsGroup with fsGroup, no new privileges, and the root filesystem read-only when
  readOnlyRootFilesystem says so;
- the image is this build: its binaries are on PATH (the Dockerfile installs them in
  /usr/local/bin) and IMAGE_FILES maps the other paths the Dockerfile copies;
- volumes: emptyDir is a fresh folder at each pod start; a StatefulSet's volumeClaimTemplates
  claim is a folder per pod that survives restarts and scale-down; hostPath is the host folder;
  configMap and secret volumes are files written from the rendered objects;
- startup, readiness and liveness probes (grpc, httpGet, tcpSocket, exec) run with the
  manifest's periods and thresholds, from inside the pod's network namespace against its IP
  (as a kubelet probes a pod IP); a failed liveness probe restarts the pod;
- a pod whose container exits is replaced the way its controller would: a Deployment's by a new
  pod (new name, new IP, fresh emptyDirs), a StatefulSet's by a pod of the same name on the same
  claim;
- scaling re-renders the chart and reconciles: new pods start at once; a removed pod leaves its
  Services' endpoints, runs its preStop hook, gets SIGTERM, and SIGKILL when its
  terminationGracePeriodSeconds run out;
- faults: SIGKILL a pod, take its link down and up, partition two pods silently (one way or
  both), narrow a pod's link (tc tbf).

Everything the harness makes (namespaces, veths, the bridge, /etc/netns folders, mount point
folders, processes) is removed by close(), after a failure too (also on SIGTERM/SIGINT and at
interpreter exit). Needs root; `available()` says why not otherwise.
"""

import atexit
import base64
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import threading
import time

import yaml

STATE_DIR = "/run/tandem-deploy"
SUBNET = "10.244"
# A locally administered MAC that no veth of a harness has (cut() sends frames there).
UNUSED_MAC = "02:00:5e:00:de:ad"
# A pod probe or exec waits at most this long for `ip netns exec` to start the command.
EXEC_SLACK_S = 2.0


def _run(cmd, check=True, **kw):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(shlex.quote, cmd))} failed ({p.returncode}): "
                           f"{p.stderr.strip()}")
    return p


def available():
    """None when network namespaces can be made here, else one line saying why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) or util-linux (unshare) is not installed"
    name = f"tdhcheck{os.getpid()}"
    p = _run(["ip", "netns", "add", name], check=False)
    if p.returncode != 0:
        return f"cannot create a network namespace: {p.stderr.strip()}"
    _run(["ip", "netns", "del", name], check=False)
    return None


def render(helm, chart, release, namespace, values_files=(), set_values=None):
    """`helm template` -> the list of rendered objects. Raises with helm's message on failure."""
    cmd = [helm, "template", release, chart, "--namespace", namespace]
    for f in values_files:
        cmd += ["-f", f]
    for k, v in (set_values or {}).items():
        cmd += ["--set-json", f"{k}={json.dumps(v)}"]
    p = _run(cmd, check=False)
    if p.returncode != 0:
        raise RenderError(p.stderr.strip())
    return [d for d in yaml.safe_load_all(p.stdout) if d]


class RenderError(Exception):
    pass


def _expand(s, env):
    """Kubernetes $(VAR) expansion: known variables are replaced, $$ is a literal $."""
    def sub(m):
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, str(s))


def _selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


class Pod:
    def __init__(self, harness, owner, name, ordinal, template):
        self.h = harness
        self.owner = owner  # the controller object (Deployment, StatefulSet, DaemonSet)
        self.kind = owner["kind"]
        self.name = name
        self.ordinal = ordinal
        self.template = template
        self.spec = template["spec"]
        self.labels = dict(template.get("metadata", {}).get("labels", {}))
        self.ip = None
        self.netns = None
        self.veth = None
        self.dir = None
        self.procs = {}  # container name -> Popen
        self.phase = "Pending"  # Pending, Running, Terminating, Gone
        self.started = False  # startup probe passed (or none)
        self.ready = False
        self.ready_at = None
        self.started_at = None
        self.terminating_since = None
        self.exit_codes = {}
        self.events = []
        self.probe_state = {}
        self.lock = threading.Lock()

    # -- identity ---------------------------------------------------------------------------
    def __repr__(self):
        return f"Pod({self.name} {self.ip} {self.phase} ready={self.ready})"

    def log_path(self, container):
        return os.path.join(self.dir, f"{container}.log")

    def log(self, container=None):
        c = container or self.spec["containers"][0]["name"]
        try:
            with open(self.log_path(c), errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def pid(self, container=None):
        c = container or self.spec["containers"][0]["name"]
        p = self.procs.get(c)
        return p.pid if p is not None else None

    def alive(self):
        return any(p.poll() is None for p in self.procs.values())

    def event(self, what):
        self.events.append((time.time(), what))
        self.h.record(f"{self.name}: {what}")


class PodHarness:
    """One rendered release run as pods. Not thread-safe for callers: drive it from one thread
    (its own controller thread only reads what the caller's calls set up)."""

    def __init__(self, *, bin_dir, run_dir, namespace="serving", image_files=None, claims=None,
                 extra_path=()):
        self.bin_dir = bin_dir
        self.run_dir = run_dir
        self.namespace = namespace
        self.image_files = dict(image_files or {})
        self.claims = dict(claims or {})
        self.extra_path = list(extra_path)
        self.run_id = f"{os.getpid() % 100000:05d}"
        self.prefix = f"tdh{self.run_id}"
        self.switch = f"{self.prefix}-sw"
        self.objects = []
        self.pods = {}  # name -> Pod (every pod not yet Gone)
        self.gone = []  # pods that ended, for their logs
        self.services = []
        self.next_ip = 10
        self.next_veth = 0
        self.pod_serial = 0
        self.created_dirs = []
        self.mount_lock = None
        self.closed = False
        self.mu = threading.RLock()
        self.log_lines = []
        self.stop = threading.Event()
        self.loop_thread = None
        self.client_ns = None
        self.client_ip = None
        # Appended to every deploy_tool call that dials gRPC (TLS flags when the release uses TLS).
        self.tool_flags = []
        os.makedirs(run_dir, exist_ok=True)
        os.makedirs(STATE_DIR, exist_ok=True)
        self._cleanup_stale()
        with open(os.path.join(STATE_DIR, f"{self.prefix}.pid"), "w") as f:
            f.write(str(os.getpid()))
        atexit.register(self.close)
        for sig in (signal.SIGTERM, signal.SIGINT):
            prev = signal.getsignal(sig)

            def handler(signum, frame, prev=prev):
                self.close()
                if callable(prev):
                    prev(signum, frame)
                raise SystemExit(128 + signum)
            signal.signal(sig, handler)

    # -- bookkeeping --------------------------------------------------------------------------
    def record(self, line):
        stamp = time.strftime("%H:%M:%S", time.localtime()) + f".{int(time.time() * 1000) % 1000:03d}"
        with self.mu:
            self.log_lines.append(f"{stamp} {line}")
        with open(os.path.join(self.run_dir, "harness.log"), "a") as f:
            f.write(f"{stamp} {line}\n")

    @staticmethod
    def _cleanup_stale():
        """Removes what an earlier harness left when it was SIGKILLed (its pid is gone)."""
        try:
            names = os.listdir(STATE_DIR)
        except OSError:
            return
        live = set(_run(["ip", "netns", "list"], check=False).stdout.split())
        for n in names:
            if not n.endswith(".pid"):
                continue
            prefix = n[:-4]
            try:
                pid = int(open(os.path.join(STATE_DIR, n)).read())
                os.kill(pid, 0)
                continue  # still running
            except (OSError, ValueError):
                pass
            for ns in live:
                if ns.startswith(prefix + "-"):
                    for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except OSError:
                            pass
                    _run(["ip", "netns", "del", ns], check=False)
                    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
            try:
                os.unlink(os.path.join(STATE_DIR, n))
            except OSError:
                pass

    # -- network ------------------------------------------------------------------------------
    def _alloc_ip(self):
        n = self.next_ip
        self.next_ip += 1
        return f"{SUBNET}.{n // 250}.{n % 250 + 2}"

    def _make_netns(self, short, ip):
        """A network namespace joined to the switch by a veth; returns (netns, veth)."""
        netns = f"{self.prefix}-{short}"
        veth = f"v{self.run_id}{self.next_veth:04d}"[:15]
        peer = f"p{self.run_id}{self.next_veth:04d}"[:15]
        self.next_veth += 1
        _run(["ip", "netns", "add", netns])
        _run(["ip", "-n", self.switch, "link", "add", veth, "type", "veth", "peer", "name", peer,
              "netns", netns])
        _run(["ip", "-n", self.switch, "link", "set", veth, "master", "br0", "up"])
        _run(["ip", "-n", netns, "link", "set", peer, "name", "eth0"])
        _run(["ip", "-n", netns, "addr", "add", f"{ip}/16", "dev", "eth0"])
        _run(["ip", "-n", netns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", netns, "link", "set", "lo", "up"])
        os.makedirs(f"/etc/netns/{netns}", exist_ok=True)
        return netns, veth

    def _drop_netns(self, netns):
        _run(["ip", "netns", "del", netns], check=False)
        shutil.rmtree(f"/etc/netns/{netns}", ignore_errors=True)
        shutil.rmtree(os.path.join(STATE_DIR, "stage", netns), ignore_errors=True)

    def start(self, objects):
        """Creates the switch and the client namespace, then reconciles `objects`."""
        _run(["ip", "netns", "add", self.switch])
        _run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        _run(["ip", "-n", self.switch, "link", "set", "lo", "up"])
        self.client_ip = self._alloc_ip()
        self.client_ns, _ = self._make_netns("client", self.client_ip)
        self._prepare_mount_points(objects)
        self.apply(objects)
        self.loop_thread = threading.Thread(target=self._loop, name="pod-harness", daemon=True)
        self.loop_thread.start()

    def _prepare_mount_points(self, objects):
        """Container paths that do not exist on the host get an empty folder as a mount point.
        Bind mounts onto them live in the pods' mount namespaces only; the folders go at close()
        (unless another harness run holds the lock)."""
        paths = set(self.image_files)
        for o in objects:
            for spec in self._pod_specs(o):
                for c in spec.get("initContainers", []) + spec.get("containers", []):
                    for m in c.get("volumeMounts", []):
                        paths.add(m["mountPath"])
        self.mount_lock = open(os.path.join(STATE_DIR, "mountpoints.lock"), "w")
        fcntl.flock(self.mount_lock, fcntl.LOCK_SH)
        for p in sorted(paths):
            if not os.path.exists(p):
                missing = []
                q = p
                while not os.path.exists(q):
                    missing.append(q)
                    q = os.path.dirname(q)
                os.makedirs(p)
                self.created_dirs.extend(missing)

    @staticmethod
    def _pod_specs(o):
        if o.get("kind") in ("Deployment", "StatefulSet", "DaemonSet"):
            return [o["spec"]["template"]["spec"]]
        return []

    # -- objects ------------------------------------------------------------------------------
    def _find(self, kind, name):
        for o in self.objects:
            if o.get("kind") == kind and o["metadata"]["name"] == name:
                return o
        return None

    def apply(self, objects):
        """Reconciles pods against `objects` (a new render): scale up at once, scale down
        gracefully in the background. Pod templates are taken from the new objects for new
        pods; running pods keep theirs."""
        with self.mu:
            self.objects = objects
            self.services = [o for o in objects if o.get("kind") == "Service"]
            for o in objects:
                kind = o.get("kind")
                if kind not in ("Deployment", "StatefulSet", "DaemonSet"):
                    continue
                want = 1 if kind == "DaemonSet" else int(o["spec"].get("replicas", 1))
                mine = sorted((p for p in self.pods.values()
                               if p.owner["metadata"]["name"] == o["metadata"]["name"]
                               and p.phase != "Terminating"),
                              key=lambda p: (p.ordinal, p.name))
                if len(mine) < want:
                    used = {p.ordinal for p in self.pods.values()
                            if p.owner["metadata"]["name"] == o["metadata"]["name"]}
                    for _ in range(want - len(mine)):
                        if kind == "StatefulSet":
                            ordinal = min(i for i in range(len(used) + 1) if i not in used)
                        else:
                            ordinal = self.pod_serial
                            self.pod_serial += 1
                        used.add(ordinal)
                        self._create_pod(o, ordinal)
                elif len(mine) > want:
                    # ReplicaSets remove not-ready pods first, then the newest; StatefulSets
                    # the highest ordinals.
                    if kind == "StatefulSet":
                        victims = sorted(mine, key=lambda p: -p.ordinal)
                    else:
                        victims = sorted(mine, key=lambda p: (p.ready, -p.ordinal))
                    for p in victims[:len(mine) - want]:
                        self.delete(p)
            self._write_hosts()

    def _pod_name(self, owner, ordinal):
        name = owner["metadata"]["name"]
        if owner["kind"] == "StatefulSet":
            return f"{name}-{ordinal}"
        tmpl = json.dumps(owner["spec"]["template"], sort_keys=True).encode()
        h = hashlib.sha256(tmpl).hexdigest()
        suffix = hashlib.sha256(f"{self.run_id}{ordinal}".encode()).hexdigest()[:5]
        return f"{name}-{h[:8]}-{suffix}"

    def _create_pod(self, owner, ordinal):
        name = self._pod_name(owner, ordinal)
        pod = Pod(self, owner, name, ordinal, owner["spec"]["template"])
        self.pods[name] = pod
        self._start_pod(pod)
        return pod

    def _start_pod(self, pod):
        pod.ip = self._alloc_ip()
        pod.netns, pod.veth = self._make_netns(f"{pod.name}"[:40], pod.ip)
        pod.dir = os.path.join(self.run_dir, "pods", f"{pod.name}-{int(time.time() * 1000)}")
        os.makedirs(pod.dir)
        pod.volumes = self._make_volumes(pod)
        pod.phase = "Pending"
        pod.started = False
        pod.ready = False
        pod.started_at = time.time()
        pod.probe_state = {}
        self._write_hosts()
        pod.event(f"created on {pod.ip} ({pod.netns})")
        threading.Thread(target=self._run_pod, args=(pod,), daemon=True).start()

    def _make_volumes(self, pod):
        """volume name -> host folder."""
        out = {}
        fs_group = pod.spec.get("securityContext", {}).get("fsGroup")
        for v in pod.spec.get("volumes", []):
            path = None
            if "emptyDir" in v:
                path = os.path.join(pod.dir, "volumes", v["name"])
                os.makedirs(path)
            elif "hostPath" in v:
                path = v["hostPath"]["path"]
                if not os.path.isdir(path):
                    if v["hostPath"].get("type") == "DirectoryOrCreate":
                        os.makedirs(path)
                    else:
                        raise RuntimeError(f"{pod.name}: hostPath {path} is not a folder")
                out[v["name"]] = path
                continue
            elif "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                if claim not in self.claims:
                    raise RuntimeError(f"{pod.name}: no folder for claim {claim}")
                out[v["name"]] = self.claims[claim]
                continue
            elif "configMap" in v or "secret" in v:
                path = os.path.join(pod.dir, "volumes", v["name"])
                os.makedirs(path)
                if "configMap" in v:
                    obj = self._find("ConfigMap", v["configMap"]["name"])
                    data = dict((obj or {}).get("data", {}))
                else:
                    obj = self._find("Secret", v["secret"]["secretName"])
                    data = {k: base64.b64decode(x).decode() for k, x in
                            (obj or {}).get("data", {}).items()}
                    data.update((obj or {}).get("stringData", {}))
                if obj is None:
                    raise RuntimeError(f"{pod.name}: volume {v['name']} names a missing object")
                for k, x in data.items():
                    with open(os.path.join(path, k), "w") as f:
                        f.write(x)
            else:
                raise RuntimeError(f"{pod.name}: unsupported volume {v}")
            if fs_group is not None:
                for root, dirs, files in os.walk(path):
                    for n in [root] + [os.path.join(root, d) for d in dirs] + \
                             [os.path.join(root, x) for x in files]:
                        os.chown(n, 0, fs_group)
                        os.chmod(n, 0o2775 if os.path.isdir(n) else 0o664)
            out[v["name"]] = path
        # StatefulSet claims: one folder per pod and claim, kept across restarts.
        if pod.kind == "StatefulSet":
            for t in pod.owner["spec"].get("volumeClaimTemplates", []):
                claim = f"{t['metadata']['name']}-{pod.name}"
                path = os.path.join(self.run_dir, "claims", claim)
                if not os.path.isdir(path):
                    os.makedirs(path)
                    if fs_group is not None:
                        os.chown(path, 0, fs_group)
                        os.chmod(path, 0o2775)
                out[t["metadata"]["name"]] = path
        return out

    # -- containers ---------------------------------------------------------------------------
    def _env(self, pod, c):
        env = {"PATH": ":".join([self.bin_dir] + self.extra_path +
                                ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin",
                                 "/sbin", "/bin"]),
               "HOSTNAME": pod.name, "HOME": "/"}
        for ef in c.get("envFrom", []):
            if "configMapRef" in ef:
                obj = self._find("ConfigMap", ef["configMapRef"]["name"])
                env.update({k: str(v) for k, v in (obj or {}).get("data", {}).items()})
            if "secretRef" in ef:
                obj = self._find("Secret", ef["secretRef"]["name"])
                env.update({k: base64.b64decode(v).decode()
                            for k, v in (obj or {}).get("data", {}).items()})
        fields = {"metadata.name": pod.name, "metadata.namespace": self.namespace,
                  "status.podIP": pod.ip, "spec.nodeName": "harness-node",
                  "status.hostIP": pod.ip}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = _expand(e["value"], env)
            elif "valueFrom" in e:
                vf = e["valueFrom"]
                if "fieldRef" in vf:
                    env[e["name"]] = fields[vf["fieldRef"]["fieldPath"]]
                elif "configMapKeyRef" in vf:
                    ref = vf["configMapKeyRef"]
                    env[e["name"]] = str(self._find("ConfigMap", ref["name"])["data"][ref["key"]])
                elif "secretKeyRef" in vf:
                    ref = vf["secretKeyRef"]
                    env[e["name"]] = base64.b64decode(
                        self._find("Secret", ref["name"])["data"][ref["key"]]).decode()
            else:
                env[e["name"]] = ""
        return env

    def _container_script(self, pod, c):
        """The shell run inside the pod's namespaces before exec: the volume and image mounts,
        a read-only root, then the manifest's user and command."""
        lines = ["set -e", f"hostname {shlex.quote(pod.name)}"]
        mounts = [(target, source, True) for target, source in sorted(self.image_files.items())]
        for m in c.get("volumeMounts", []):
            src = pod.volumes.get(m["name"])
            if src is None:
                raise RuntimeError(f"{pod.name}: volumeMount {m['name']} has no volume")
            if m.get("subPath"):
                src = os.path.join(src, m["subPath"])
            mounts.append((m["mountPath"], src, bool(m.get("readOnly"))))
        # Every source is bound to a staging folder first and moved into place after: a mount
        # onto /tmp would otherwise hide sources under /tmp from the mounts after it.
        stage = os.path.join(STATE_DIR, "stage", pod.netns, c["name"])
        for i, (target, source, ro) in enumerate(mounts):
            os.makedirs(os.path.join(stage, str(i)), exist_ok=True)
            lines.append(f"mount --bind {shlex.quote(source)} {shlex.quote(os.path.join(stage, str(i)))}")
        for i, (target, source, ro) in enumerate(mounts):
            lines.append(f"mount --move {shlex.quote(os.path.join(stage, str(i)))} {shlex.quote(target)}")
            if ro:
                lines.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        sc = dict(pod.spec.get("securityContext", {}))
        sc.update(c.get("securityContext", {}))
        if sc.get("readOnlyRootFilesystem"):
            lines.append("mount -o remount,bind,ro /")
        user = []
        uid, gid = sc.get("runAsUser"), sc.get("runAsGroup", sc.get("runAsUser"))
        if uid is not None and int(uid) != 0:
            groups = [str(pod.spec.get("securityContext", {}).get("fsGroup", gid))]
            user = ["setpriv", f"--reuid={uid}", f"--regid={gid}",
                    f"--groups={','.join(groups)}", "--inh-caps=-all"]
            if sc.get("allowPrivilegeEscalation") is False:
                user.append("--no-new-privs")
        elif uid is not None and sc.get("capabilities", {}).get("drop") == ["ALL"]:
            keep = ",".join(f"+{x.lower()}" for x in sc.get("capabilities", {}).get("add", []))
            user = ["setpriv", f"--inh-caps=-all{',' + keep if keep else ''}"]
        lines.append('exec ' + " ".join(map(shlex.quote, user)) + ' "$@"')
        return "\n".join(lines)

    def _argv(self, pod, c, env):
        argv = [_expand(x, env) for x in c.get("command", [])] + \
               [_expand(x, env) for x in c.get("args", [])]
        if not argv:
            raise RuntimeError(f"{pod.name}/{c['name']}: no command (the image has no entrypoint "
                               "in the harness)")
        return argv

    def _spawn(self, pod, c):
        env = self._env(pod, c)
        argv = self._argv(pod, c, env)
        script = self._container_script(pod, c)
        cmd = ["ip", "netns", "exec", pod.netns, "unshare", "--uts", "--ipc", "/bin/sh", "-c",
               script, "sh", "env", "-i"] + [f"{k}={v}" for k, v in env.items()] + argv
        logf = open(pod.log_path(c["name"]), "ab")
        logf.write(f"+ {' '.join(map(shlex.quote, argv))}\n".encode())
        logf.flush()
        p = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        logf.close()
        return p

    def _run_pod(self, pod):
        """Init containers in order, then the containers (the pod's own thread)."""
        try:
            for c in pod.spec.get("initContainers", []):
                delay = 0.5
                while True:
                    if pod.phase == "Terminating" or self.stop.is_set():
                        return
                    p = self._spawn(pod, c)
                    pod.procs[c["name"]] = p
                    rc = p.wait()
                    del pod.procs[c["name"]]
                    if rc == 0:
                        pod.event(f"init container {c['name']} done")
                        break
                    pod.event(f"init container {c['name']} exited {rc}; retrying")
                    time.sleep(delay)
                    delay = min(delay * 2, 10)
            with pod.lock:
                if pod.phase == "Terminating" or self.stop.is_set():
                    return
                for c in pod.spec["containers"]:
                    pod.procs[c["name"]] = self._spawn(pod, c)
                pod.phase = "Running"
                pod.event("running")
            with self.mu:
                self._write_hosts()  # publishNotReadyAddresses Services list it from now on
        except Exception as e:  # a pod that cannot start is an event, not a harness crash
            pod.event(f"failed to start: {e}")
            pod.phase = "Failed"

    # -- probes -------------------------------------------------------------------------------
    def _probe(self, pod, c, probe):
        timeout = float(probe.get("timeoutSeconds", 1))
        if "grpc" in probe:
            cmd = [self.tool_path(), "probe", "grpc", f"{pod.ip}:{probe['grpc']['port']}",
                   "--timeout-ms", str(int(timeout * 1000))]
            if probe["grpc"].get("service"):
                cmd += ["--service", probe["grpc"]["service"]]
        elif "httpGet" in probe:
            port = self._port(c, probe["httpGet"]["port"])
            cmd = [self.tool_path(), "probe", "http", f"{pod.ip}:{port}",
                   probe["httpGet"].get("path", "/"), "--timeout-ms", str(int(timeout * 1000))]
        elif "tcpSocket" in probe:
            port = self._port(c, probe["tcpSocket"]["port"])
            cmd = [self.tool_path(), "probe", "tcp", f"{pod.ip}:{port}",
                   "--timeout-ms", str(int(timeout * 1000))]
        elif "exec" in probe:
            return self.exec_in(pod, probe["exec"]["command"], timeout=timeout,
                                container=c["name"]).returncode == 0
        else:
            raise RuntimeError(f"{pod.name}: unsupported probe {probe}")
        try:
            return _run(["ip", "netns", "exec", pod.netns] + cmd, check=False,
                        timeout=timeout + EXEC_SLACK_S).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    @staticmethod
    def _port(c, port):
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
        raise RuntimeError(f"container {c['name']} has no port named {port}")

    def exec_in(self, pod, command, timeout=10.0, container=None):
        """Runs `command` inside a container's namespaces, as its user (kubectl exec)."""
        cname = container or pod.spec["containers"][0]["name"]
        pid = pod.pid(cname)
        c = next(x for x in pod.spec["containers"] if x["name"] == cname)
        sc = dict(pod.spec.get("securityContext", {}))
        sc.update(c.get("securityContext", {}))
        user = []
        if sc.get("runAsUser") not in (None, 0):
            user = ["setpriv", f"--reuid={sc['runAsUser']}",
                    f"--regid={sc.get('runAsGroup', sc['runAsUser'])}", "--clear-groups"]
        env = self._env(pod, c)
        cmd = ["nsenter", "-t", str(pid), "-m", "-n", "-u", "-i", "--"] + user + \
              ["env", "-i"] + [f"{k}={v}" for k, v in env.items()] + list(command)
        try:
            return _run(cmd, check=False, timeout=timeout + EXEC_SLACK_S)
        except subprocess.TimeoutExpired:
            return subprocess.CompletedProcess(cmd, 124, "", "timeout")

    def _probes_due(self, pod, now):
        """Starts the probes that are due, each on its own thread."""
        c = pod.spec["containers"][0]
        kinds = []
        if not pod.started:
            kinds = ["startupProbe"] if "startupProbe" in c else []
            if not kinds:
                pod.started = True
        if pod.started:
            kinds = [k for k in ("readinessProbe", "livenessProbe") if k in c]
            if "readinessProbe" not in c and not pod.ready:
                self._set_ready(pod, True)
        for kind in kinds:
            probe = c[kind]
            st = pod.probe_state.setdefault(kind, {"next": now + float(
                probe.get("initialDelaySeconds", 0)) + 0.3, "fails": 0, "busy": False})
            if st["busy"] or now < st["next"]:
                continue
            st["busy"] = True
            st["next"] = now + float(probe.get("periodSeconds", 10))
            threading.Thread(target=self._probe_once, args=(pod, c, kind, probe, st),
                             daemon=True).start()

    def _probe_once(self, pod, c, kind, probe, st):
        try:
            ok = self._probe(pod, c, probe)
        except Exception as e:
            pod.event(f"{kind} error: {e}")
            ok = False
        st["busy"] = False
        if pod.phase != "Running":
            return
        if ok:
            st["fails"] = 0
            st["passes"] = st.get("passes", 0) + 1
            if kind == "startupProbe":
                pod.started = True
                pod.event("started (startupProbe passed)")
                # Readiness is probed at once after startup, as the kubelet does.
                for k in ("readinessProbe", "livenessProbe"):
                    pod.probe_state.pop(k, None)
            elif kind == "readinessProbe" and not pod.ready:
                self._set_ready(pod, True)
            return
        st["fails"] += 1
        if st["fails"] < int(probe.get("failureThreshold", 3)):
            return
        if kind == "readinessProbe" and pod.ready:
            self._set_ready(pod, False)
        elif kind in ("livenessProbe", "startupProbe"):
            pod.event(f"{kind} failed {st['fails']} times: restarting")
            st["fails"] = 0
            self._kill(pod, signal.SIGKILL)

    def _set_ready(self, pod, ready):
        pod.ready = ready
        if ready:
            pod.ready_at = time.time()
        pod.event("ready" if ready else "not ready")
        with self.mu:
            self._write_hosts()

    # -- DNS ----------------------------------------------------------------------------------
    def endpoints(self, service):
        """IPs of the pods a Service selects (ready ones, or running ones with
        publishNotReadyAddresses)."""
        sel = service["spec"].get("selector", {})
        not_ready_ok = service["spec"].get("publishNotReadyAddresses", False)
        out = []
        for p in self.pods.values():
            if p.phase == "Running" and _selects(sel, p.labels) and (p.ready or not_ready_ok):
                out.append(p.ip)
        return sorted(out, key=lambda ip: tuple(int(x) for x in ip.split(".")))

    def _names(self, name):
        ns = self.namespace
        return [name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]

    def _write_hosts(self):
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        for s in self.services:
            for ip in self.endpoints(s):
                lines.append(f"{ip}\t" + " ".join(self._names(s["metadata"]["name"])))
        for p in self.pods.values():
            if p.kind == "StatefulSet" and p.phase == "Running":
                sub = p.owner["spec"].get("serviceName")
                if sub:
                    lines.append(f"{p.ip}\t" + " ".join(self._names(f"{p.name}.{sub}")))
        common = "\n".join(lines) + "\n"
        targets = [(self.client_ns, f"{self.client_ip}\tclient\n")] if self.client_ns else []
        targets += [(p.netns, f"{p.ip}\t{p.name}\n") for p in self.pods.values() if p.netns]
        for netns, own in targets:
            path = f"/etc/netns/{netns}/hosts"
            content = (common + own).encode()
            # In place: `ip netns exec` bind-mounted this inode over /etc/hosts of running pods.
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.write(fd, content)
                os.ftruncate(fd, len(content))
            finally:
                os.close(fd)

    # -- life cycle ---------------------------------------------------------------------------
    def _loop(self):
        while not self.stop.wait(0.1):
            with self.mu:
                now = time.time()
                for pod in list(self.pods.values()):
                    if pod.phase == "Running":
                        for name, p in list(pod.procs.items()):
                            rc = p.poll()
                            if rc is not None:
                                pod.exit_codes[name] = rc
                                pod.event(f"container {name} exited {rc}")
                                self._replace(pod)
                                break
                        else:
                            self._probes_due(pod, now)
                    elif pod.phase == "Failed":
                        self._replace(pod)

    def _replace(self, pod):
        """A pod that died: gone, and its controller makes another (StatefulSet: same name and
        claims; others: a new pod). Repeated crashes back off like CrashLoopBackOff."""
        self._teardown(pod, reason="died")
        owner = self._find(pod.owner["kind"], pod.owner["metadata"]["name"]) or pod.owner
        crashes = getattr(pod, "crashes", 0) + 1
        delay = 0 if crashes <= 1 else min(0.5 * 2 ** (crashes - 2), 10)

        def again():
            if self.stop.is_set():
                return
            with self.mu:
                if owner["kind"] == "StatefulSet":
                    q = Pod(self, owner, pod.name, pod.ordinal, owner["spec"]["template"])
                    self.pods[q.name] = q
                    self._start_pod(q)
                else:
                    q = self._create_pod(owner, self._next_serial())
                q.crashes = crashes
        if delay:
            threading.Timer(delay, again).start()
        else:
            again()

    def _next_serial(self):
        s = self.pod_serial
        self.pod_serial += 1
        return s

    def _teardown(self, pod, reason):
        for p in pod.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        for p in pod.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        pod.phase = "Gone"
        pod.ready = False
        self.pods.pop(pod.name, None)
        self.gone.append(pod)
        if pod.netns:
            self._drop_netns(pod.netns)
        pod.event(f"gone ({reason})")
        self._write_hosts()

    def _kill(self, pod, sig):
        for p in pod.procs.values():
            try:
                os.killpg(p.pid, sig)
            except OSError:
                pass

    def delete(self, pod):
        """Graceful deletion: out of the endpoints now, preStop, SIGTERM, SIGKILL at the end of
        terminationGracePeriodSeconds. Returns at once; wait_gone() waits."""
        if pod.phase in ("Terminating", "Gone"):
            return
        pod.phase = "Terminating"
        pod.terminating_since = time.time()
        pod.ready = False
        self._write_hosts()
        pod.event("terminating")
        threading.Thread(target=self._terminate, args=(pod,), daemon=True).start()

    def _terminate(self, pod):
        grace = float(pod.spec.get("terminationGracePeriodSeconds", 30))
        deadline = pod.terminating_since + grace
        c = pod.spec["containers"][0]
        hook = c.get("lifecycle", {}).get("preStop", {}).get("exec")
        if hook and pod.alive():
            self.exec_in(pod, hook["command"], timeout=max(0.0, deadline - time.time()))
            pod.event("preStop done")
        self._kill(pod, signal.SIGTERM)
        pod.event("SIGTERM")
        while time.time() < deadline and pod.alive():
            time.sleep(0.05)
        if pod.alive():
            pod.event("grace period over: SIGKILL")
        pod.exit_codes.update({n: p.poll() for n, p in pod.procs.items()})
        with self.mu:
            self._teardown(pod, reason="deleted")

    # -- queries and faults for tests ---------------------------------------------------------
    def pods_of(self, component):
        with self.mu:
            return sorted((p for p in self.pods.values()
                           if p.labels.get("app.kubernetes.io/component") == component
                           and p.phase != "Terminating"), key=lambda p: (p.ordinal, p.name))

    def all_ready(self):
        with self.mu:
            want = 0
            for o in self.objects:
                if o.get("kind") in ("Deployment", "StatefulSet"):
                    want += int(o["spec"].get("replicas", 1))
                elif o.get("kind") == "DaemonSet":
                    want += 1
            live = [p for p in self.pods.values() if p.phase != "Terminating"]
            return len(live) == want and all(p.ready for p in live)

    def wait(self, what, predicate, timeout):
        end = time.time() + timeout
        while time.time() < end:
            if predicate():
                return
            time.sleep(0.1)
        raise TimeoutError(f"{what}: not within {timeout:.0f} s\n{self.describe()}")

    def wait_ready(self, timeout=60):
        self.wait("every pod ready", self.all_ready, timeout)

    def wait_gone(self, pod, timeout=60):
        self.wait(f"{pod.name} gone", lambda: pod.phase == "Gone", timeout)

    def describe(self):
        with self.mu:
            rows = [f"  {p.name:48s} {p.ip:14s} {p.phase:12s} ready={p.ready}"
                    for p in self.pods.values()]
        return "pods:\n" + "\n".join(rows)

    def sigkill(self, pod):
        pod.event("fault: SIGKILL")
        self._kill(pod, signal.SIGKILL)

    def link(self, pod, up):
        pod.event(f"fault: link {'up' if up else 'down'}")
        _run(["ip", "-n", self.switch, "link", "set", pod.veth, "up" if up else "down"])

    def cut(self, a, b, both_ways=True):
        """A silent partition between pods a and b: a's packets to b are dropped (and b's to a,
        both_ways), with no RST and no ICMP, as when a link between two nodes fails, while each
        pod keeps its other links. a's neighbour entry for b's IP points at a MAC no port has;
        the bridge floods those frames and no pod takes them. heal() undoes it."""
        for x, y in [(a, b), (b, a)] if both_ways else [(a, b)]:
            x.event(f"fault: packets to {y.name} dropped")
            _run(["ip", "-n", x.netns, "neigh", "replace", y.ip, "lladdr", UNUSED_MAC, "nud",
                  "permanent", "dev", "eth0"])

    def heal(self, a, b):
        """Undoes cut(a, b) in both directions (a no-op for a direction that was not cut)."""
        for x, y in [(a, b), (b, a)]:
            x.event(f"fault: packets to {y.name} delivered again")
            _run(["ip", "-n", x.netns, "neigh", "del", y.ip, "dev", "eth0"], check=False)

    def shape(self, pod, rate):
        """The pod's link limited to `rate` (tc's units, e.g. "2mbit") each way by a token
        bucket filter, or restored with rate=None. netem is not available on these machines, so
        a slow link is a narrow one; its queue holds 200 ms of traffic."""
        pod.event(f"fault: link {'shaped to ' + rate if rate else 'unshaped'}")
        for ns, dev in ((self.switch, pod.veth), (pod.netns, "eth0")):
            if rate:
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                      "burst", "16kb", "latency", "200ms"])
            else:
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)

    def client(self, argv, timeout=120, check=True):
        """Runs argv in the client namespace (resolving Services like a pod)."""
        p = _run(["ip", "netns", "exec", self.client_ns] + list(argv), check=False,
                 timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"client {' '.join(argv[:3])}... exited {p.returncode}: "
                               f"{p.stderr.strip()[-2000:]}")
        return p

    def client_popen(self, argv, log):
        f = open(log, "wb")
        return subprocess.Popen(["ip", "netns", "exec", self.client_ns] + list(argv), stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def tool(self, *args, timeout=30, check=True):
        flags = self.tool_flags if args and args[0] in ("workers", "stats") else []
        return self.client([self.tool_path()] + list(args) + flags, timeout=timeout, check=check)

    def tool_path(self):
        return os.path.join(self.bin_dir, "deploy_tool")

    def tool_json(self, *args, timeout=30):
        return json.loads(self.tool(*args, timeout=timeout).stdout)

    def metrics(self, pod, port):
        """The pod's /metrics as {name{labels}: value}."""
        body = self.tool("get", f"{pod.ip}:{port}", "/metrics").stdout
        out = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                try:
                    out[k] = float(v)
                except ValueError:
                    pass
        return out

    # -- teardown -----------------------------------------------------------------------------
    def close(self):
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        with self.mu:
            pods = list(self.pods.values())
        for pod in pods:
            self._kill(pod, signal.SIGKILL)
        for pod in pods:
            for p in pod.procs.values():
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            if pod.netns:
                self._drop_netns(pod.netns)
        if self.client_ns:
            for pid in _run(["ip", "netns", "pids", self.client_ns], check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except OSError:
                    pass
            self._drop_netns(self.client_ns)
        # Processes anything else started in our namespaces, then the namespaces themselves.
        for ns in _run(["ip", "netns", "list"], check=False).stdout.split():
            if ns.startswith(self.prefix + "-"):
                for pid in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
                self._drop_netns(ns)
        if self.mount_lock is not None:
            try:
                fcntl.flock(self.mount_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                for d in sorted(self.created_dirs, key=len, reverse=True):
                    try:
                        os.rmdir(d)
                    except OSError:
                        pass
            except OSError:
                pass  # another harness run still uses the mount points
            self.mount_lock.close()
        try:
            os.unlink(os.path.join(STATE_DIR, f"{self.prefix}.pid"))
        except OSError:
            pass

    def leftovers(self):
        """What of ours still exists (for the test that checks the cleanup)."""
        out = [ns for ns in _run(["ip", "netns", "list"], check=False).stdout.split()
               if ns.startswith(self.prefix + "-")]
        out += [f"/etc/netns/{n}" for n in os.listdir("/etc/netns")
                if n.startswith(self.prefix + "-")] if os.path.isdir("/etc/netns") else []
        out += [d for d in self.created_dirs if os.path.exists(d)]
        links = _run(["ip", "-o", "link"], check=False).stdout
        out += [f"host link {v}" for v in re.findall(rf"\b[vp]{self.run_id}\d+", links)]
        return out
