#!/usr/bin/env python3
"""Drives a running llama-server with N concurrent /completion requests (stdlib only).

Each request carries its own random prompt as token ids (so no slot can reuse another's prefix),
asks for exactly --n-predict tokens (ignore_eos, greedy) and is sent from its own thread; all are
released together. Prints one JSON object: the wall time from release until the last response,
the generated tokens summed over the responses, and their ratio, the aggregate decode throughput
that engine_bench's batch mode reports for tandem's scheduler.

This llama-server runs every completion's text through its chat-output parser at the end, and the
gibberish of a random-weight model sometimes fails it with HTTP 500 "does not match the expected
Content-only format" after all tokens were generated. Such a request still did the full work
(ignore_eos, so exactly n_predict tokens); it is counted with n_predict tokens and reported in
parse_failures. Any other failure invalidates the run.
"""
import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request

PARSE_FAILURE = "does not match the expected"


def post(url, body, timeout):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(base, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except Exception:  # not up yet (connection refused, 503 while loading)
            pass
        time.sleep(0.5)
    return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:18080")
    ap.add_argument("--n", type=int, default=32, help="concurrent requests")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ready-timeout", type=float, default=300)
    ap.add_argument("--request-timeout", type=float, default=1800)
    a = ap.parse_args()

    if not wait_ready(a.url, a.ready_timeout):
        print("server_client: server not ready", file=sys.stderr)
        return 1
    rng = random.Random(a.seed)

    def body(n_predict):
        return {"prompt": [rng.randint(1000, 30000) for _ in range(a.prompt_len)],
                "n_predict": n_predict, "ignore_eos": True, "temperature": 0,
                "cache_prompt": False, "stream": False}

    post(a.url + "/completion", body(2), a.request_timeout)  # untimed warm-up

    bodies = [body(a.n_predict) for _ in range(a.n)]
    results = [None] * a.n
    errors = []
    parse_failures = [0]
    gate = threading.Barrier(a.n + 1)

    def worker(i):
        gate.wait()
        try:
            results[i] = post(a.url + "/completion", bodies[i], a.request_timeout)
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            if e.code == 500 and PARSE_FAILURE in text:
                parse_failures[0] += 1
                results[i] = {"tokens_predicted": a.n_predict}
            else:
                errors.append("HTTP %d: %s" % (e.code, text[:200]))
        except Exception as e:  # reported below; the run is then invalid
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(a.n)]
    for t in threads:
        t.start()
    gate.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        print("server_client: %d requests failed: %s" % (len(errors), errors[0]), file=sys.stderr)
        return 1
    generated = sum(r.get("tokens_predicted", r.get("timings", {}).get("predicted_n", 0))
                    for r in results)
    per_req = sorted(r.get("timings", {}).get("predicted_per_second", 0) for r in results)
    print(json.dumps({
        "tool": "llama-server-client", "n": a.n, "prompt_len": a.prompt_len,
        "n_predict": a.n_predict, "wall_s": wall, "generated": generated,
        "tokens_per_s": generated / wall,
        "median_request_predicted_per_s": per_req[len(per_req) // 2],
        "parse_failures": parse_failures[0],
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
