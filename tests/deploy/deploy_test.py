#!/usr/bin/env python3
"""The Helm chart as deployed: its rendered pods run by the pod harness (pod_harness.py), one
network namespace a pod, the real model from ../shared/models. CTest label `deploy`.

  deploy_test.py --repo DIR --bin DIR --scenario serve|scale|faults|partitions|variants|render
                [--keep DIR]

serve   router 2, prefill 2, decode 2, kvstore 1 with the chart's default values (plus the real
        model on a hostPath): every pod passes its own readiness probe; greedy text through the
        router Service equals `tandem generate` for 12 prompts over gRPC and over OpenAI HTTP
        (the official npm client); the KV crossed UCX over tcp between pods, never shm; a prompt
        sharing an 8-block prefix, served by the other prefill pod, onboards the prefix from the
        kvstore and gives the same text.
scale   with a closed-loop client running, prefill 2 -> 4 -> 1 and decode 2 -> 3 -> 1 by
        re-rendered values: 0 failed requests, routers route to a new pod within 5 s of it being
        ready, and stop routing to a removed pod before it exits.
faults  SIGKILL a decode pod mid-stream (streams complete by migration, tokens identical), SIGKILL
        a router pod (new requests succeed within 2 s; its own streams end UNAVAILABLE and their
        retries succeed), a decode pod's link down for 3 s mid-stream (streams complete), SIGKILL
        the kvstore pod (serving continues on the miss path; after its restart on the same claim,
        its SSD-tier blocks are served again); after each, every worker's KV blocks are back to
        their baseline.
partitions  silent network faults, each ending with every stream equal to the reference (no
        token lost or repeated) and every worker's KV blocks back to baseline, with its recovery
        time printed: a prefill pod cut off from both decode pods (its KV writes are lost on the
        wire; requests complete through the other prefill pod, and its KV flows again once
        healed); a decode pod cut off from the router pods mid-stream, both ways and one way
        (keepalive fails the streams, which migrate; the pod registers again once healed); a
        decode pod's link narrowed to 256 kbit/s (tc tbf) while streams run on it.
variants  the chart's other branches run: mTLS between every process, API keys, a DaemonSet
        kvstore on a hostPath, KV-aware routing, an f16 KV cache, the router's recommendation
        flags; text through the router equals `tandem generate --kv-type f16`.
render  values the binaries would refuse fail at `helm template`, naming the field.

Exits 0 on success, 1 on a failed check, 77 (CTest skip) with one line when network namespaces
cannot be made here (not root) or the model is absent. Prints the figures it measured.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pod_harness  # noqa: E402

SKIP = 77
STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the "
         "sun. One day, she saw a big red ball in the park. She ran to the ball and kicked it. ")
PROMPTS = [
    "Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a cat",
    "The sun was shining and", "There was a big tree", "Tim had a red ball",
    "Sue liked to sing", "The bird flew", "Mom said", "In the garden, a bunny",
    "The boy was sad because",
]
FAILURES = []


def check(cond, what):
    print(("PASS " if cond else "FAIL ") + what, flush=True)
    if not cond:
        FAILURES.append(what)
    return cond


class Env:
    def __init__(self, args):
        self.repo = os.path.abspath(args.repo)
        self.bin = os.path.abspath(args.bin)
        self.helm = os.path.join(self.repo, ".cache", "helm", "helm")
        self.chart = os.path.join(self.repo, "helm", "tandem")
        self.model_dir = os.path.abspath(os.path.join(self.repo, "..", "shared", "models",
                                                      "stories260K"))
        self.model = os.path.join(self.model_dir, "stories260K.gguf")
        self.openai_dir = os.path.join(self.repo, ".cache", "openai-client")
        self.keep = args.keep
        self.work = args.keep or tempfile.mkdtemp(prefix="tandem-deploy-")
        os.makedirs(self.work, exist_ok=True)

    def values(self, **overrides):
        """The chart's defaults plus replica counts and the real model on a hostPath."""
        v = {"model": {"source": "hostPath", "file": "stories260K.gguf",
                       "hostPath": {"path": self.model_dir}},
             "router.replicas": 2, "prefill.replicas": 2, "decode.replicas": 2,
             "kvstore.replicas": 1}
        v.update(overrides)
        return v

    def render(self, values):
        return pod_harness.render(self.helm, self.chart, "tandem", "serving", set_values=values)

    def harness(self, name):
        return pod_harness.PodHarness(
            bin_dir=self.bin, run_dir=os.path.join(self.work, name),
            # What deploy/docker/Dockerfile copies into the image besides the binaries.
            image_files={"/usr/share/tandem/vocab": os.path.join(self.repo, ".cache", "vocab")})

    def reference(self, prompt, max_tokens, ignore_eos=False, ctx=0, kv_type="f32"):
        """`tandem generate --json`, greedy, in one process on the host."""
        cmd = [os.path.join(self.bin, "tandem"), "generate", "--model", self.model, "--prompt",
               prompt, "--max-tokens", str(max_tokens), "--temperature", "0", "--seed", "0",
               "--threads", "1", "--json", "--kv-type", kv_type]
        if ignore_eos:
            cmd.append("--ignore-eos")
        if ctx:
            cmd += ["--ctx-size", str(ctx)]
        p = pod_harness._run(cmd, timeout=120)
        return json.loads(p.stdout)


def write_lines(path, lines):
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def generate(h, env, prompts, max_tokens, name, ignore_eos=False, progress=None, retry_ms=0,
             background=False, router="tandem-router:50051"):
    pf = os.path.join(env.work, f"{name}.prompts")
    out = os.path.join(env.work, f"{name}.json")
    write_lines(pf, prompts)
    argv = [h.tool_path(), "generate", "--router", router, "--prompts", pf,
            "--max-tokens", str(max_tokens), "--out", out, "--retry-ms", str(retry_ms)] + \
        h.tool_flags
    if ignore_eos:
        argv.append("--ignore-eos")
    if progress:
        argv += ["--progress", progress]
    if background:
        return h.client_popen(argv, os.path.join(env.work, f"{name}.log")), out
    h.client(argv, timeout=180, check=False)
    with open(out) as f:
        return json.load(f)


def check_streams(results, refs, what):
    """Every result succeeded with exactly its reference's tokens and text."""
    bad = [g for g in results if g["code"] != 0 or g["tokens"] != refs[g["prompt"]]["tokens"]
           or g["text"] != refs[g["prompt"]]["text"]]
    check(not bad and results, f"{what} ({len(results) - len(bad)}/{len(results)})")
    for g in bad:
        print(f"  {g['prompt']!r}: code {g['code']} {g['message']!r}, {len(g['tokens'])} tokens, "
              f"decode {g['decode_workers']}\n    got  {g['text'][:200]!r}\n"
              f"    want {refs[g['prompt']]['text'][:200]!r}")


def workers(h, router_pod=None):
    """Registry.ListWorkers of one router pod (default: each, merged by worker id)."""
    pods = [router_pod] if router_pod else h.pods_of("router")
    out = {}
    for r in pods:
        for w in h.tool_json("workers", "--router", f"{r.ip}:50051").get("workers", []):
            out[w["worker_id"]] = w
    return out


def numbers(d):
    """Proto JSON prints 64-bit integers as strings."""
    return {k: int(v) if isinstance(v, str) and v.lstrip("-").isdigit() else v
            for k, v in d.items()}


def worker_stats(h):
    """Each worker pod's own Stats, by pod name."""
    out = {}
    for role in ("prefill", "decode"):
        for p in h.pods_of(role):
            out[p.name] = numbers(h.tool_json("stats", "--worker", f"{p.ip}:50061", "--role",
                                              role))
    return out


def idle(stats):
    return all(s.get("running", 0) == 0 and s.get("waiting", 0) == 0 and
               s.get("reservations", 0) == 0 and s.get("kv_blocks_free") == s.get(
                   "kv_blocks_total") for s in stats.values())


def check_baseline(h, what, timeout=20):
    """Every worker pod idle with every KV block free (leases end within their own bound)."""
    end = time.time() + timeout
    stats = {}
    while time.time() < end:
        try:
            stats = worker_stats(h)
            if idle(stats):
                break
        except RuntimeError:
            pass
        time.sleep(0.25)
    busy = {k: {f: v.get(f) for f in ("running", "waiting", "reservations", "kv_blocks_free",
                                     "kv_blocks_total")}
            for k, v in stats.items() if not idle({k: v})}
    check(idle(stats) and stats, f"{what}: every worker's KV blocks back to baseline "
          f"({len(stats)} workers){'' if not busy else ' busy: ' + json.dumps(busy)}")


def bring_up(h, env, objects, timeout=90):
    t0 = time.time()
    h.start(objects)
    h.wait_ready(timeout)
    # Every router knows every worker.
    want = {p.name for role in ("prefill", "decode") for p in h.pods_of(role)}
    h.wait("every router lists every worker", lambda: all(
        set(workers(h, r)) >= want for r in h.pods_of("router")), 30)
    up = time.time() - t0
    print(f"figure: {len(h.pods)} pods ready and registered with every router in {up:.1f} s")
    return up


# ------------------------------------------------------------------------------------------
def scenario_serve(env):
    h = env.harness("serve")
    try:
        objects = env.render(env.values())
        bring_up(h, env, objects)
        pods = {c: h.pods_of(c) for c in ("router", "prefill", "decode", "kvstore")}
        check([len(pods[c]) for c in ("router", "prefill", "decode", "kvstore")] == [2, 2, 2, 1],
              "router 2, prefill 2, decode 2, kvstore 1 pods, each passed its readiness probe")
        check(all(p.ready for ps in pods.values() for p in ps), "every pod is ready")
        # The workers' liveness probe asks the health service their engine watchdog drives.
        workers = pods["prefill"] + pods["decode"]
        check(all(p.spec["containers"][0]["livenessProbe"].get("grpc", {}).get("service")
                  == "liveness" for p in workers),
              "the worker pods' liveness probe asks the \"liveness\" health service")
        every = [p for ps in pods.values() for p in ps]
        passed = lambda: [p.name for p in every
                          if p.probe_state.get("livenessProbe", {}).get("passes", 0) < 1]
        try:
            h.wait("every pod's liveness probe passed", lambda: not passed(), 30)
        except TimeoutError:
            pass
        check(not passed(), f"every pod's liveness probe passed (not yet: {passed()})")
        # Isolation: pods have no default route, and nothing of ours is on the host's network.
        routes = h.client(["ip", "route"]).stdout
        check("default" not in routes, "the pod network has no default route (no way off host)")
        check(not any(x.startswith("host link") for x in h.leftovers()),
              "no interface of the harness in the host's network namespace")

        refs = {p: env.reference(p, 24) for p in PROMPTS}
        got = generate(h, env, PROMPTS, 24, "serve-grpc")
        check_streams(got, refs, "gRPC through the router Service: greedy completions equal "
                      "`tandem generate`")
        routers_used = set()
        for r in pods["router"]:
            m = h.metrics(r, 9090)
            n = sum(v for k, v in m.items() if k.startswith("tandem_request_success_total"))
            if n > 0:
                routers_used.add(r.name)
        check(len(routers_used) == 2, f"both router pods served requests ({len(routers_used)})")

        pf = os.path.join(env.work, "serve-http.prompts")
        write_lines(pf, PROMPTS)
        node = shutil.which("node")
        if check(node is not None and os.path.isdir(env.openai_dir),
                 "node and the openai npm client are present"):
            p = h.client([node, os.path.join(env.repo, "tests", "deploy", "openai_completions.cjs"),
                          "http://tandem-router:8000/v1", pf, "24", env.openai_dir],
                         timeout=120, check=False)
            http = json.loads(p.stdout) if p.returncode == 0 else []
            if p.returncode != 0:
                print(p.stderr[-2000:])
            same = sum(1 for g in http if g["text"] == refs[g["prompt"]]["text"])
            check(same == len(PROMPTS), f"OpenAI HTTP (openai npm client) through the router "
                  f"Service: {same}/{len(PROMPTS)} equal `tandem generate`")

        # The KV path: UCX over tcp between pods, never shared memory.
        lanes = {}
        for role in ("prefill", "decode", "kvstore"):
            for p in pods[role]:
                port = 9101 if role == "kvstore" else 9100
                for k, v in h.metrics(p, port).items():
                    if k.startswith("tandem_kv_transport_bytes_total") and v > 0:
                        lane = k.split('lanes="')[1].split('"')[0] if 'lanes="' in k else "?"
                        lanes[lane] = lanes.get(lane, 0) + v
        print(f"figure: KV transport bytes by UCX lanes: {json.dumps(lanes)}")
        check(lanes.get("tcp", 0) > 0, "KV crossed UCX over tcp between pods")
        check(all(k == "tcp" for k in lanes), "no KV byte went over shared memory (posix, sysv, cma)")

        # Prefix onboarding from the kvstore on the other prefill pod.
        prefix = "Story one. " + STORY + STORY
        first = generate(h, env, [prefix + "The end."], 16, "serve-prefix-0")[0]
        check(first["code"] == 0, f"the prefix request succeeded ({first.get('message')})")
        owner = first["prefill_worker"]
        tokens = len(env.reference(prefix + "The end.", 1)["prompt_tokens"])
        print(f"figure: prefix prompt of {tokens} tokens, prefilled on {owner}")
        stats0 = worker_stats(h)
        h.wait("the prefix is published to the kvstore", lambda: worker_stats(h)[owner].get(
            "kvstore_published_blocks", 0) >= 8, 20)
        other = [p.name for p in pods["prefill"] if p.name != owner][0]
        before = worker_stats(h)[other]
        onboarded = None
        for i in range(12):
            prompt = prefix + f"Then number {i} came."
            g = generate(h, env, [prompt], 16, f"serve-prefix-{i + 1}")[0]
            if g["prefill_worker"] == other:
                onboarded = (prompt, g)
                break
        if check(onboarded is not None, f"a request sharing the prefix reached {other}"):
            prompt, g = onboarded
            after = worker_stats(h)[other]
            hit = int(after.get("prefix_cache_hit_blocks", 0)) - int(
                before.get("prefix_cache_hit_blocks", 0))
            ref = env.reference(prompt, 16)
            kv_hits = sum(v for k, v in h.metrics(pods["kvstore"][0], 9101).items()
                          if k.startswith("tandem_kvstore_tier_hits_total"))
            check(hit >= 8 and g["cached_prompt_tokens"] >= 128,
                  f"{other} onboarded {hit} blocks ({g['cached_prompt_tokens']} tokens) of the "
                  f"shared prefix from the kvstore (kvstore tier hits {kv_hits:.0f}, onboarding "
                  f"{json.dumps(g['onboarding_seconds'])} s)")
            check(kv_hits >= 8, "the kvstore's tier-hit counter saw the onboarding")
            check(g["tokens"] == ref["tokens"] and g["text"] == ref["text"],
                  "the onboarded request's text equals `tandem generate`")
        del stats0
        check_baseline(h, "serve")
    finally:
        h.close()
        left = h.leftovers()
        check(not left, f"the harness removed everything it made ({left})")


# ------------------------------------------------------------------------------------------
def scenario_scale(env):
    h = env.harness("scale")
    try:
        bring_up(h, env, env.render(env.values()))
        pf = os.path.join(env.work, "scale.prompts")
        write_lines(pf, PROMPTS)
        stop = os.path.join(env.work, "scale.stop")
        out = os.path.join(env.work, "scale.json")
        load = h.client_popen([h.tool_path(), "load", "--router", "tandem-router:50051",
                               "--prompts", pf, "--max-tokens", "24", "--concurrency", "4",
                               "--stop-file", stop, "--out", out],
                              os.path.join(env.work, "scale-load.log"))
        time.sleep(3)
        steps = [(4, 3), (1, 1)]
        removed, added = [], []
        for prefill, decode in steps:
            before = {p.name for c in ("prefill", "decode") for p in h.pods_of(c)}
            t = time.time()
            h.apply(env.render(env.values(**{"prefill.replicas": prefill,
                                             "decode.replicas": decode})))
            now = {p.name for c in ("prefill", "decode") for p in h.pods_of(c)}
            added += [p for c in ("prefill", "decode") for p in h.pods_of(c) if p.name not in before]
            gone = [p for p in h.gone + list(h.pods.values())
                    if p.name in before - now and p.terminating_since and p.terminating_since >= t]
            removed += gone
            h.wait_ready(90)
            for p in gone:
                h.wait_gone(p, 120)
            print(f"figure: scaled to prefill {prefill}, decode {decode} in {time.time() - t:.1f} s")
            time.sleep(6)  # traffic on the new shape
        open(stop, "w").close()
        load.wait(timeout=120)
        with open(out) as f:
            res = json.load(f)
        errors = [r for r in res["requests"] if r["code"] != 0]
        check(res["failed"] == 0 and res["total"] > 0,
              f"closed loop during scaling: {res['total']} requests, {res['failed']} failed"
              + (f" (first: {errors[0]['message']})" if errors else ""))
        # Routed to new pods within 5 s of readiness.
        lags = []
        for p in added:
            served = [r["start"] for r in res["requests"]
                      if p.name in (r["prefill_worker"],) or p.name in r["decode_workers"]]
            if not served or p.ready_at is None:
                lags.append((p.name, None))
                continue
            # A worker registers as soon as it serves, so traffic may come before the kubelet-
            # style readiness probe passes (negative lag, counted as 0).
            lags.append((p.name, max(0.0, min(served) - p.ready_at)))
            print(f"figure: {p.name}: process start -> first request routed to it "
                  f"{min(served) - p.started_at:.1f} s, readiness -> first request "
                  f"{min(served) - p.ready_at:+.1f} s")
        worst = max((x for _, x in lags if x is not None), default=None)
        check(all(x is not None for _, x in lags) and worst is not None and worst <= 5.0,
              f"every new pod got traffic within 5 s of being ready (worst {worst and round(worst, 2)} s"
              f" over {len(lags)} pods: {lags})")
        # Not routed to once terminating: a request that started after a removed pod's SIGTERM
        # (plus the deregistration's round trip) never landed on it.
        late = []
        for p in removed:
            sigterm = next((t for t, e in p.events if e == "SIGTERM"), None)
            exited = next((t for t, e in p.events if e.startswith("gone")), None)
            for r in res["requests"]:
                if sigterm and r["start"] > sigterm + 0.5 and (
                        p.name == r["prefill_worker"] or p.name in r["decode_workers"]):
                    late.append((p.name, round(r["start"] - sigterm, 2)))
            print(f"figure: {p.name} SIGTERM -> exit {exited - sigterm if exited and sigterm else -1:.1f} s")
        check(not late, f"no request was routed to a removed pod after its SIGTERM "
              f"({len(removed)} pods removed; late: {late[:5]})")
        check_baseline(h, "scale")
    finally:
        h.close()
        check(not h.leftovers(), "the harness removed everything it made")


# ------------------------------------------------------------------------------------------
def wait_progress(path, n, timeout=60):
    end = time.time() + timeout
    while time.time() < end:
        try:
            with open(path) as f:
                prog = json.load(f)
            if len(prog) == n and all(s["seen"] >= 20 or s["done"] for s in prog):
                return prog
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    raise TimeoutError("the streams did not start")


def busiest_decode(h, prog):
    """The decode pod running the most unfinished streams of a progress snapshot, and how many."""
    counts = {}
    for s in prog:
        if not s["done"]:
            counts[s["decode_worker"]] = counts.get(s["decode_worker"], 0) + 1
    name = max(counts, key=counts.get)
    return next(p for p in h.pods_of("decode") if p.name == name), counts[name]


def scenario_faults(env):
    ctx = 2048
    h = env.harness("faults")
    values = env.values(**{
        "config.ctxSize": ctx,
        # Every prefix hit is the store's, and the store's one 1 MiB device slot and no host tier
        # send each block on to SSD (so its SSD tier has something to serve after a restart).
        "prefill.extraArgs": ["--no-prefix-cache"],
        "kvstore.deviceMb": 1, "kvstore.hostMb": 0, "kvstore.ssdMb": 64,
        "kvstore.extraArgs": ["--ssd-min-hits=0"],
        "decode.quarantineMs": 500,
    })
    try:
        bring_up(h, env, env.render(values))
        # As long as the context allows: each fault below must land while streams run, and this
        # model decodes 1200 tokens in a fraction of a second of compute.
        n, tokens = 6, ctx - 100
        prompts = [f"Once upon a time, there was a little {x}"
                   for x in ("girl", "dog", "cat", "boy", "bird", "fish")]
        refs = {p: env.reference(p, tokens, ignore_eos=True, ctx=ctx) for p in prompts}

        def streams_check(res, what):
            check_streams(res, refs, f"{what}: streams complete with exactly the reference "
                          "tokens (none lost or repeated)")

        # 1. A decode pod SIGKILLed mid-stream.
        prog_path = os.path.join(env.work, "kill-decode.progress")
        proc, out = generate(h, env, prompts, tokens, "kill-decode", ignore_eos=True,
                             progress=prog_path, background=True)
        victim, on_victim = busiest_decode(h, wait_progress(prog_path, n))
        victim_name = victim.name
        h.sigkill(victim)
        killed = time.time()
        proc.wait(timeout=120)
        with open(out) as f:
            res = json.load(f)
        streams_check(res, f"decode pod SIGKILLed with {on_victim} of {n} streams on it")
        print(f"figure: the last stream ended {max(g['end'] for g in res) - killed:.1f} s "
              "after the decode pod's kill")
        # Streams still on the victim when it died must have moved to another decode pod.
        hit = [g for g in res if victim_name in g["decode_workers"] and g["end"] > killed]
        moved = [g for g in hit if g["decode_workers"][-1] != victim_name]
        check(len(hit) > 0 and len(moved) == len(hit),
              f"{len(moved)} of the {len(hit)} streams running on the killed decode pod migrated")
        h.wait_ready(60)
        print(f"figure: decode pod replaced and ready {time.time() - killed:.1f} s after the kill")
        check_baseline(h, "decode SIGKILL")

        # 2. A router pod SIGKILLed: its own streams end UNAVAILABLE; new requests succeed
        # within 2 s; the failed streams' retries succeed. Half the streams go to each router
        # pod by its IP, so both have some whatever the client's balancing did at the start.
        routers = h.pods_of("router")
        runs = []
        for i, r in enumerate(routers[:2]):
            name = f"kill-router-{i}"
            proc, out = generate(h, env, prompts[i::2], tokens, name, ignore_eos=True,
                                 progress=os.path.join(env.work, f"{name}.progress"),
                                 background=True, router=f"{r.ip}:50051")
            runs.append((proc, out))
        for i in range(2):
            wait_progress(os.path.join(env.work, f"kill-router-{i}.progress"), len(prompts[i::2]))
        h.sigkill(routers[0])
        killed = time.time()
        fresh = generate(h, env, ["Once upon a time"], 8, "after-router-kill", retry_ms=5000)
        # Timed from when the client sent it: on a loaded test host starting the client process
        # alone has taken 2 s, which says nothing of the cluster.
        sent = max(fresh[0]["start"], killed)
        first_ok = fresh[0]["end"] - sent if fresh[0]["code"] == 0 else None
        check(first_ok is not None and first_ok <= 2.0,
              f"a new request to the router Service succeeded {first_ok and round(first_ok, 2)} s "
              f"after it was sent, {sent - killed:.2f} s after a router pod was SIGKILLed "
              f"(attempts {fresh[0]['attempts']})")
        res = []
        for proc, out in runs:
            proc.wait(timeout=120)
            with open(out) as f:
                res.append(json.load(f))
        lost, kept = res
        # A stream that had already finished before the kill keeps its success; every one still
        # running then ends UNAVAILABLE, and at least one must have been running.
        done_before = [g for g in lost if g["code"] == 0 and g["end"] <= killed]
        lost = [g for g in lost if g not in done_before]
        check(lost and all(g["code"] == 14 for g in lost),
              f"the {len(lost)} streams on the killed router ended UNAVAILABLE "
              f"(codes {sorted({g['code'] for g in lost})}, the last after "
              f"{max((g['end'] for g in lost), default=killed) - killed:.2f} s; "
              f"{len(done_before)} had finished before the kill)")
        streams_check(kept, "streams through the surviving router")
        retried = generate(h, env, [g["prompt"] for g in lost], tokens, "router-retry",
                           ignore_eos=True)
        streams_check(retried, "the lost streams retried through the router Service")
        h.wait_ready(60)
        check_baseline(h, "router SIGKILL")

        # 3. A decode pod's link down for 3 s mid-stream.
        prog_path = os.path.join(env.work, "link.progress")
        proc, out = generate(h, env, prompts, tokens, "link", ignore_eos=True, progress=prog_path,
                             background=True)
        victim, on_victim = busiest_decode(h, wait_progress(prog_path, n))
        h.link(victim, up=False)
        time.sleep(3)
        h.link(victim, up=True)
        proc.wait(timeout=120)
        with open(out) as f:
            res = json.load(f)
        streams_check(res, f"{victim.name}'s link down 3 s with {on_victim} streams on it")
        check_baseline(h, "link down")

        # 4. The kvstore pod SIGKILLed.
        warm = "Story one. " + STORY + STORY
        ref = env.reference(warm, 16)
        g = generate(h, env, [warm], 16, "kv-warm")[0]
        check(g["code"] == 0 and g["tokens"] == ref["tokens"], "warm request")
        owner = g["prefill_worker"]
        h.wait("published", lambda: worker_stats(h)[owner].get("kvstore_published_blocks", 0) >= 8,
               20)
        pusher = generate(h, env, ["Story two. " + STORY + STORY], 16, "kv-pusher")[0]
        check(pusher["code"] == 0, "a second prompt pushes the first one's blocks to SSD")
        kv = h.pods_of("kvstore")[0]
        time.sleep(1)
        ssd = sum(v for k, v in h.metrics(kv, 9101).items()
                  if k.startswith("tandem_kvstore_tier_bytes") and 'tier="ssd"' in k)
        check(ssd > 0, f"the kvstore's SSD tier holds {ssd:.0f} bytes")
        h.sigkill(kv)
        down = []
        for i in range(4):
            p = warm if i == 0 else f"Story {i + 10}. " + STORY
            r = generate(h, env, [p], 16, f"kv-down-{i}")[0]
            down.append(r["code"] == 0 and r["tokens"] == env.reference(p, 16)["tokens"])
        check(all(down), f"with the kvstore down, {sum(down)}/{len(down)} requests completed "
              "with the reference tokens (miss path)")
        h.wait_ready(60)
        kv2 = h.pods_of("kvstore")[0]
        check(kv2.name == kv.name and kv2.volumes.get("ssd") == kv.volumes.get("ssd"),
              f"the kvstore came back as {kv2.name} on the same claim")
        hit = None
        end = time.time() + 20
        while time.time() < end and hit is None:
            r = generate(h, env, [warm], 16, "kv-again")[0]
            if r["code"] == 0 and r["cached_prompt_tokens"] >= 128:
                hit = r
            else:
                time.sleep(0.5)
        ssd_hits = sum(v for k, v in h.metrics(kv2, 9101).items()
                       if k.startswith("tandem_kvstore_tier_hits_total") and 'tier="ssd"' in k)
        check(hit is not None and hit["tokens"] == ref["tokens"] and ssd_hits > 0,
              f"after the restart the warmed prefix is onboarded again "
              f"({hit and hit['cached_prompt_tokens']} cached tokens, {ssd_hits:.0f} SSD hits)")
        check_baseline(h, "kvstore SIGKILL")
    finally:
        h.close()
        check(not h.leftovers(), "the harness removed everything it made")


def read_progress(path):
    with open(path) as f:
        return json.load(f)


def wait_resumed(path, victim, stalled, timeout=60):
    """Seconds until every stream that was on `victim` and unfinished in `stalled` (a progress
    snapshot) has finished or made progress on another decode pod."""
    t0 = time.time()
    want = {i: s["seen"] for i, s in enumerate(stalled)
            if s["decode_worker"] == victim and not s["done"]}
    while time.time() < t0 + timeout:
        try:
            prog = read_progress(path)
            if all(prog[i]["done"] or (prog[i]["decode_worker"] != victim and
                                       prog[i]["seen"] > seen) for i, seen in want.items()):
                return time.time() - t0
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    return None


def scenario_partitions(env):
    ctx = 2048
    h = env.harness("partitions")
    values = env.values(**{
        "config.ctxSize": ctx,
        # A KV write that cannot reach its decode pod gives up after 3 s (the chart's 30 s is
        # sized for real models' transfers), and the router moves the handoff on.
        "prefill.maxTransferMs": 3000,
        "decode.quarantineMs": 500,
    })
    try:
        bring_up(h, env, env.render(values))
        routers, prefills, decodes = h.pods_of("router"), h.pods_of("prefill"), h.pods_of("decode")
        n, tokens = 6, ctx - 100
        prompts = [f"Once upon a time, there was a little {x}"
                   for x in ("girl", "dog", "cat", "boy", "bird", "fish")]
        refs = {p: env.reference(p, tokens, ignore_eos=True, ctx=ctx) for p in prompts}
        # Prompts of several KV blocks, for the handoff case.
        short = [f"Story {i}. " + STORY for i in range(8)]
        short_refs = {p: env.reference(p, 32) for p in short}

        def streams_check(res, what, want=refs):
            check_streams(res, want, f"{what}: every stream completed with exactly the reference "
                          "tokens (none lost or repeated)")

        # 1. A prefill pod cut off from every decode pod. Its UCX connections to them were made
        # by the requests before; each KV write it starts now is lost on the wire until its
        # deadline, the router passes over the decode pod it was for, and the request completes
        # through the other prefill pod.
        p0 = prefills[0]
        streams_check(generate(h, env, short, 32, "pd-warm"), "before the partition", short_refs)
        before = worker_stats(h)
        for d in decodes:
            h.cut(p0, d)
        cut_at = time.time()
        res = generate(h, env, short, 32, "pd-cut")
        during = worker_stats(h)
        for d in decodes:
            h.heal(p0, d)
        asked = (during[p0.name].get("prefix_cache_query_blocks", 0) -
                 before[p0.name].get("prefix_cache_query_blocks", 0))
        via = sorted({g["prefill_worker"] for g in res})
        check(asked > 0 and p0.name not in via,
              f"{p0.name}, cut off from the decode pods, was asked to prefill ({asked} prompt "
              f"blocks looked up) and no request completed through it (prefilled by {via})")
        streams_check(res, f"{p0.name} partitioned from both decode pods", short_refs)
        print(f"figure: prefill-decode partition: every request done "
              f"{max(g['end'] for g in res) - cut_at:.1f} s after the cut (KV write deadline 3 s)")
        check_baseline(h, "prefill-decode partition")
        # Healed, its KV reaches the decode pods again: within a few rounds of requests one
        # completes through it.
        healed, through = time.time(), []
        for i in range(5):
            res = generate(h, env, short, 32, f"pd-healed-{i}")
            streams_check(res, f"after the heal, round {i + 1}", short_refs)
            through = [g for g in res if g["prefill_worker"] == p0.name and g["code"] == 0]
            if through:
                break
        check(through, f"after the heal {len(through)} requests completed through {p0.name} "
              f"within {time.time() - healed:.1f} s")
        check_baseline(h, "prefill-decode partition healed")

        # 2, 3. A decode pod cut off from the router pods mid-stream, both ways and then one way
        # (its packets to them lost, theirs to it delivered). Keepalive fails the streams on
        # both ends: the routers migrate them, the decode pod frees their KV; once healed the
        # pod registers again.
        for case, both in (("router-decode", True), ("decode-to-router one-way", False)):
            tag = "rd" if both else "oneway"
            prog_path = os.path.join(env.work, f"{tag}.progress")
            proc, out = generate(h, env, prompts, tokens, tag, ignore_eos=True,
                                 progress=prog_path, background=True)
            victim, on_victim = busiest_decode(h, wait_progress(prog_path, n))
            for r in routers:
                h.cut(victim, r, both_ways=both)
            cut_at = time.time()
            resumed = wait_resumed(prog_path, victim.name, read_progress(prog_path))
            proc.wait(timeout=120)
            for r in routers:
                h.heal(victim, r)
            with open(out) as f:
                res = json.load(f)
            streams_check(res, f"{case} partition with {on_victim} of {n} streams on "
                          f"{victim.name}")
            hit = [g for g in res if victim.name in g["decode_workers"] and g["end"] > cut_at]
            moved = [g for g in hit if g["decode_workers"][-1] != victim.name]
            check(hit and len(moved) == len(hit),
                  f"{case}: {len(moved)} of the {len(hit)} streams cut off on {victim.name} "
                  "migrated to the other decode pod")
            check(resumed is not None, f"{case}: the cut-off streams resumed")
            print(f"figure: {case} partition: the cut-off streams resumed {resumed or -1:.1f} s "
                  f"after the cut (keepalive: a ping every 5 s, 5 s for its ack)")
            h.wait("the cut-off decode pod registered again with every router",
                   lambda: all(victim.name in workers(h, r) for r in routers), 30)
            check_baseline(h, f"{case} partition")

        # 4. A narrow link: one decode pod's link at 256 kbit/s both ways while streams run on
        # it and new KV arrives through it. Its streams take longer (each token is a message of
        # its own); none fails, and none loses or repeats a token.
        victim = decodes[0]
        want = {p: env.reference(p, 400, ignore_eos=True) for p in prompts}

        def on_victim(res):
            return max((g["end"] - g["start"] for g in res if victim.name in g["decode_workers"]),
                       default=0)

        wide = generate(h, env, prompts, 400, "wide", ignore_eos=True)
        streams_check(wide, "at full speed", want)
        # The routers pick a decode pod by the free KV blocks of its last heartbeat: until
        # every router has heard both idle, the wide run's last streams still weigh on one.
        names = {d.name for d in decodes}
        h.wait("every router has heard every decode pod idle",
               lambda: all(idle({w: numbers(i.get("stats", {})) | {"kv_blocks_total":
                                                                   i["kv_blocks_total"]}
                                 for w, i in workers(h, r).items() if w in names})
                           for r in routers), 30)
        h.shape(victim, "256kbit")
        try:
            narrow = generate(h, env, prompts, 400, "narrow", ignore_eos=True)
        finally:
            h.shape(victim, None)
        streams_check(narrow, f"{victim.name}'s link at 256 kbit/s", want)
        on = sum(victim.name in g["decode_workers"] for g in narrow)
        check(on > 0 and on_victim(narrow) > 2 * on_victim(wide),
              f"{on} of the {n} streams ran on the narrowed pod and took "
              f"{on_victim(narrow):.1f} s, against {on_victim(wide):.1f} s at full speed")
        print(f"figure: slow link: the streams on {victim.name} took {on_victim(narrow):.1f} s "
              f"with its link at 256 kbit/s, {on_victim(wide):.1f} s at full speed")
        check_baseline(h, "slow link")
    finally:
        h.close()
        check(not h.leftovers(), "the harness removed everything it made")


# ------------------------------------------------------------------------------------------
def make_pki(d, name):
    """A CA and one certificate for `name`, good for servers and clients (the chart mounts one
    certificate in every pod)."""
    os.makedirs(d, exist_ok=True)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    pod_harness._run(["openssl", "req", "-x509"] + ec + ["-keyout", f"{d}/ca.key", "-out",
                      f"{d}/ca.crt", "-days", "2", "-subj", "/CN=tandem-deploy-test-ca"])
    pod_harness._run(["openssl", "req"] + ec + ["-keyout", f"{d}/tls.key", "-out",
                      f"{d}/tls.csr", "-subj", f"/CN={name}"])
    with open(f"{d}/ext", "w") as f:
        f.write(f"subjectAltName=DNS:{name}\nextendedKeyUsage=serverAuth,clientAuth\n")
    pod_harness._run(["openssl", "x509", "-req", "-in", f"{d}/tls.csr", "-CA", f"{d}/ca.crt",
                      "-CAkey", f"{d}/ca.key", "-CAcreateserial", "-out", f"{d}/tls.crt",
                      "-days", "2", "-extfile", f"{d}/ext"])
    return {k: open(f"{d}/{k}").read() for k in ("ca.crt", "tls.crt", "tls.key")}


def scenario_variants(env):
    """The chart's other branches, run: mTLS everywhere, API keys, a DaemonSet kvstore on a
    hostPath, KV-aware routing, an f16 KV cache and the router's recommendation flags."""
    name = "tandem.serving.internal"
    pki_dir = os.path.join(env.work, "pki")
    pki = make_pki(pki_dir, name)
    values = env.values(**{
        "tls": {"enabled": True, "cert": pki["tls.crt"], "key": pki["tls.key"],
                "ca": pki["ca.crt"], "mutual": True, "serverName": name},
        "apiKeys": {"enabled": True, "keys": ["sk-deploy-1 tenant-a"]},
        "kvstore.kind": "DaemonSet",
        "kvstore.hostPath.path": os.path.join(env.work, "node-ssd"),
        "router.policy": "kv-aware",
        "router.recommendation": {"sloTtftMs": 500, "sloItlMs": 50, "prefillCapacityTps": 2000,
                                  "decodeCapacityTps": 500},
        "config.kvType": "f16",
    })
    h = env.harness("variants")
    h.tool_flags = ["--tls-ca", f"{pki_dir}/ca.crt", "--tls-cert", f"{pki_dir}/tls.crt",
                    "--tls-key", f"{pki_dir}/tls.key", "--server-name", name]
    try:
        objects = env.render(values)
        check(any(o.get("kind") == "DaemonSet" for o in objects), "the kvstore is a DaemonSet")
        bring_up(h, env, objects)
        check(all(p.ready for c in ("router", "prefill", "decode", "kvstore")
                  for p in h.pods_of(c)), "every pod passed its (TCP, with TLS) probes")
        prompts = PROMPTS[:4]
        refs = {p: env.reference(p, 16, kv_type="f16") for p in prompts}
        got = generate(h, env, prompts, 16, "variants", retry_ms=0)
        check(all(g["code"] == 16 for g in got),
              f"without an API key the routers refuse with UNAUTHENTICATED "
              f"(codes {sorted({g['code'] for g in got})})")
        h.tool_flags.append("--api-key=sk-deploy-1")
        got = generate(h, env, prompts, 16, "variants-key")
        check_streams(got, refs, "over mTLS with an API key: greedy completions equal "
                      "`tandem generate --kv-type f16`")
        plain = h.client([h.tool_path(), "workers", "--router",
                          f"{h.pods_of('router')[0].ip}:50051"], check=False)
        check(plain.returncode != 0, "a plaintext client is refused")
        rec = [k for k in h.metrics(h.pods_of("router")[0], 9090)
               if k.startswith("tandem_recommended_replicas")]
        check(len(rec) >= 2, f"the router publishes recommended_replicas ({len(rec)} series)")
        long = " ".join(PROMPTS)  # several full KV blocks (the others are shorter than one)
        got = generate(h, env, [long, long], 4, "variants-long")
        indexed = sum(v for r in h.pods_of("router") for k, v in h.metrics(r, 9090).items()
                      if k.startswith("tandem_prefix_index_blocks"))
        check(all(g["code"] == 0 for g in got) and indexed > 0,
              f"the kv-aware routers indexed a long prompt's blocks ({indexed:.0f} hashes)")
        check(os.path.isdir(os.path.join(env.work, "node-ssd")) and
              os.stat(os.path.join(env.work, "node-ssd")).st_uid == 10001,
              "the DaemonSet's init container gave the hostPath SSD folder to the pod's user")
        check_baseline(h, "variants")
    finally:
        h.close()
        check(not h.leftovers(), "the harness removed everything it made")


# ------------------------------------------------------------------------------------------
def scenario_render(env):
    """Values a binary would refuse fail `helm template`, naming the field; each case's flag is
    also given to the binary, which must refuse it too (so the schema mirrors the binaries)."""
    m = ["--model", env.model, "--port", "0"]
    with open(os.path.join(env.work, "one-key"), "w") as f:
        f.write("sk-no-tenant\n")
    kv = ["--port", "0", "--host-mb", "0", "--ssd-mb", "0", "--transport", "none"]
    cases = [
        ({"config.kvType": "bf16"}, "kvType", ["tandem-decode", "--kv-type", "bf16"] + m),
        ({"config.blockSize": 0}, "blockSize", ["tandem-prefill", "--block-size", "0"] + m),
        ({"config.ucxTls": "tcp;rm -rf"}, "ucxTls",
         ["tandem-decode", "--ucx-tls", "tcp;rm -rf"] + m),
        ({"router.policy": "random"}, "policy", ["tandem-router", "--policy", "random", "--port", "0"]),
        ({"router.maxMigrations": -1}, "maxMigrations",
         ["tandem-router", "--max-migrations", "-1", "--port", "0"]),
        ({"router.prefillRetries": -2}, "prefillRetries",
         ["tandem-router", "--prefill-retries", "-2", "--port", "0"]),
        ({"prefill.threads": 0}, "threads", ["tandem-prefill", "--threads", "0"] + m),
        ({"decode.maxSeqs": 0}, "maxSeqs", ["tandem-decode", "--max-seqs", "0"] + m),
        ({"kvstore.blockKb": 131072}, "blockKb",
         ["tandem-kvstore", "--block-kb", "131072", "--device-mb", "0", "--transport", "ucx",
          "--port", "0", "--host-mb", "0", "--ssd-mb", "0"]),
        ({"kvstore.deviceMb": 1, "kvstore.blockKb": 2048}, "deviceMb",
         ["tandem-kvstore", "--device-mb", "1", "--block-kb", "2048"] + kv),
        ({"router.grpcPort": 70000}, "grpcPort", ["tandem-router", "--port", "70000"]),
        ({"apiKeys": {"enabled": True, "keys": ["sk-no-tenant"]}}, "apiKeys.keys",
         ["tandem-router", "--api-keys", os.path.join(env.work, "one-key"), "--port", "0"]),
        ({"decode.terminationGracePeriodSeconds": 3}, "terminationGracePeriodSeconds", None),
        ({"gpu.enabled": True, "gpu.kvTransport": "cuda_ipc", "gpu.hostIPC": False},
         "gpu.hostIPC", None),
    ]
    for values, field, argv in cases:
        try:
            env.render(env.values(**values))
            check(False, f"helm template refuses {values}")
        except pod_harness.RenderError as e:
            lines = [x for x in str(e).splitlines() if field in x]
            check(bool(lines), f"helm template refuses {values}, naming {field}: "
                  f"{lines[0][:160] if lines else str(e)[:160]}")
        if argv is not None:
            try:
                p = pod_harness._run([os.path.join(env.bin, argv[0])] + argv[1:], check=False,
                                     timeout=20)
                check(p.returncode != 0, f"{argv[0]} refuses it too (exit {p.returncode}: "
                      f"{(p.stderr or p.stdout).strip().splitlines()[-1][:120] if (p.stderr or p.stdout).strip() else ''})")
            except subprocess.TimeoutExpired:
                check(False, f"{' '.join(argv)} refuses it too (it kept running)")
    # And what they accept renders.
    for values in ({"config.kvType": "fp8"}, {"config.kvType": "int8"},
                   {"kvstore.deviceMb": 0}, {"router.replicas": 3}):
        try:
            env.render(env.values(**values))
            check(True, f"helm template accepts {values}")
        except pod_harness.RenderError as e:
            check(False, f"helm template accepts {values}: {e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--scenario", required=True, choices=["serve", "scale", "faults", "partitions", "variants",
                                                     "render"])
    ap.add_argument("--keep", help="work folder to keep (logs of every pod)")
    args = ap.parse_args()
    env = Env(args)
    if not os.access(env.helm, os.X_OK):
        print(f"SKIP: helm is not in {env.helm} (scripts/fetch_helm.sh fetches it)")
        return SKIP
    if args.scenario != "render":
        why = pod_harness.available()
        if why:
            print(f"SKIP: the pod harness cannot run here: {why}")
            return SKIP
        if not os.path.exists(env.model):
            print(f"SKIP: no real model at {env.model}")
            return SKIP
    t0 = time.time()
    try:
        {"serve": scenario_serve, "scale": scenario_scale, "faults": scenario_faults,
         "partitions": scenario_partitions, "variants": scenario_variants,
         "render": scenario_render}[args.scenario](env)
    except Exception as e:  # a harness error is a failed check with its logs
        import traceback
        traceback.print_exc()
        FAILURES.append(f"{type(e).__name__}: {e}")
    print(f"figure: scenario {args.scenario} took {time.time() - t0:.1f} s")
    if FAILURES:
        print(f"{len(FAILURES)} check(s) failed; pod logs in {env.work}")
        return 1
    if not env.keep:
        shutil.rmtree(env.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
