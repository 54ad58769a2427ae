#!/usr/bin/env python3
"""Summarises spec_bench.sh's raw.jsonl into the tables of docs/perf/speculative.md."""
import json
import statistics
import sys
from collections import defaultdict


def main(path):
    rows = [json.loads(line) for line in open(path) if line.strip()]
    ngram = defaultdict(lambda: defaultdict(list))  # case -> variant -> [(tps, accept)]
    verify = defaultdict(list)  # k -> [ms]
    batch = defaultdict(list)  # variant -> [tok/s]
    selfd = defaultdict(list)  # variant -> [(decode tok/s, verify steps, accepted, drafted)]
    steps = defaultdict(lambda: defaultdict(list))  # model -> decode/prefill -> [tok/s]
    draftkv = {}  # (mode, len, conc) -> tandem bench JSON
    for r in rows:
        res = r["result"]
        if r["case"].startswith("ngram"):
            spec = res.get("speculative", {})
            ngram[r["case"]][r["variant"]].append(
                (res["timings"]["decode_tokens_per_s"], spec.get("mean_accept_length", 0.0),
                 spec.get("steps", 0), len(res["tokens"])))
        elif r["case"] == "verify":
            for s in res["verify"]["steps"]:
                verify[s["k"]].append(s["step_ms"]["median"])
        elif r["case"] == "batch32":
            batch[r["variant"]].append(res["batch"]["tokens_per_s"]["median"])
        elif r["case"] == "self":
            b = res["batch"]
            selfd[r["variant"]].append((b["decode_phase_tokens_per_s"]["median"],
                                        b["spec_steps"], b["spec_accepted_tokens"], b["steps"]))
        elif r["case"] == "draftkv":
            mode, length, conc = r["variant"].split("-")
            draftkv[(mode, int(length), int(conc[1:]))] = res
        elif r["case"] == "steps":
            steps[r["variant"]]["decode"].append(res["decode"]["tokens_per_s"]["median"])
            steps[r["variant"]]["prefill"].append(res["prefill"]["tokens_per_s"]["median"])

    med = statistics.median
    if ngram:
        print("| prompt | off tok/s | ngram tok/s | ratio | mean tokens per verify step | "
              "steps off / ngram |")
        print("|---|---|---|---|---|---|")
        for case in sorted(ngram):
            off, on = ngram[case]["off"], ngram[case]["ngram"]
            t_off, t_on = med(x[0] for x in off), med(x[0] for x in on)
            print(f"| {case} | {t_off:.0f} | {t_on:.0f} | {t_on / t_off:.2f}x | "
                  f"{med(x[1] for x in on):.2f} | {off[0][2]} / {on[0][2]} |")
        print()
    if verify:
        base = med(verify[0])
        print("| k | step ms (median of runs) | ratio to a 1-token step |")
        print("|---|---|---|")
        for k in sorted(verify):
            print(f"| {k} | {med(verify[k]):.2f} | {med(verify[k]) / base:.3f} |")
        print()
    if batch:
        base = med(batch["off-gate8"]) if "off-gate8" in batch else None
        print("| batch 32 variant | tok/s (median) | ratio to off |")
        print("|---|---|---|")
        for v in sorted(batch):
            m = med(batch[v])
            print(f"| {v} | {m:.1f} | {m / base:.3f} |" if base else f"| {v} | {m:.1f} | - |")
        print()
    if selfd:
        base = med(x[0] for x in selfd["off"])
        print("| batch 1, llama-1b Q8_0 | decode tok/s (median) | ratio to off | verify steps | "
              "drafts kept per verify step | engine steps |")
        print("|---|---|---|---|---|---|")
        for v in sorted(selfd):
            xs = selfd[v]
            m = med(x[0] for x in xs)
            vs = xs[0][1]
            kept = f"{xs[0][2] / vs:.2f}" if vs else "-"
            print(f"| {v} | {m:.1f} | {m / base:.3f} | {vs} | {kept} | {xs[0][3]} |")
        print()
    if steps:
        print("| model | decode tok/s | prefill 128 tok/s |")
        print("|---|---|---|")
        for m in sorted(steps):
            print(f"| {m} | {med(steps[m]['decode']):.1f} | {med(steps[m]['prefill']):.1f} |")

    if draftkv:
        print()
        print("| prompt | concurrency | draft K/V from | TTFT p50 ms | TPOT p50 ms | ITL p99 ms | "
              "E2E p50 ms | output tok/s |")
        print("|---|---|---|---|---|---|---|---|")
        for (mode, length, conc) in sorted(draftkv, key=lambda k: (k[1], k[2], k[0])):
            b = draftkv[(mode, length, conc)]
            print(f"| {length} | {conc} | {mode} | {b['ttft_ms']['p50']:.0f} | "
                  f"{b['tpot_ms']['p50']:.1f} | {b['itl_ms']['p99']:.0f} | "
                  f"{b['e2e_ms']['p50']:.0f} | {b['output_token_throughput']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1])
