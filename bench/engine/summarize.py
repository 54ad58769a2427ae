#!/usr/bin/env python3
"""Summarises run.sh's raw.jsonl: medians, tandem/llama.cpp ratios and roofline fractions.

A pair is one tandem run and one llama.cpp run next to each other in time; the headline ratio is
the median of the per-pair ratios (robust to load drifting during the run). Load only ever slows
a run down, so the ratio of the best runs is printed too. The roofline of batch-1 decode is the
weight bytes one token reads times tokens per second over the measured read bandwidth: per
round over the membw taken just before that round of the decode case (the host's bandwidth
drifts between phases during a run), median over the rounds; without per-round samples, over the
median of the THREADS-thread membw medians taken during the run.
"""
import argparse
import json
import statistics
import sys
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the summary here as JSON too")
    a = ap.parse_args()

    rows = [json.loads(l) for l in open(a.raw) if l.strip()]
    bw = defaultdict(list)  # threads -> medians
    bw_best = defaultdict(float)
    runs = defaultdict(lambda: defaultdict(dict))  # (model, case) -> engine -> pair -> tps
    wbytes = {}
    bw_round = defaultdict(dict)  # model -> pair -> GB/s measured just before that round
    for r in rows:
        if r["case"] == "membw_round":
            bw_round[r["model"]][r["pair"]] = r["gb_per_s"]["median"]
            continue
        if r["case"] == "membw":
            bw[r["threads"]].append(r["gb_per_s"]["median"])
            bw_best[r["threads"]] = max(bw_best[r["threads"]], r["gb_per_s"]["best"])
            continue
        runs[(r["model"], r["case"])][r["engine"]][r["pair"]] = r["tokens_per_s"]
        if "weight_bytes_per_token" in r:
            wbytes[r["model"]] = r["weight_bytes_per_token"]

    bw_med = statistics.median(bw[a.threads]) if bw[a.threads] else 0.0
    out = {"bandwidth_gb_per_s": {str(t): {"median": statistics.median(v), "best": bw_best[t],
                                           "samples": v} for t, v in bw.items()},
           "cases": []}
    print("Read bandwidth (membw, GB/s): " + ", ".join(
        "%d thread(s) median %.1f best %.1f" % (t, statistics.median(v), bw_best[t])
        for t, v in sorted(bw.items(), reverse=True)))
    print()
    llamas = sorted({e for by in runs.values() for e in by if e != "tandem"})
    print("| model | case | tandem tok/s | " + " | ".join("%s tok/s" % e for e in llamas) + " | " +
          " | ".join("ratio vs %s (median of rounds; of bests)" % e for e in llamas) +
          " | tandem roofline | " + " | ".join("%s roofline" % e for e in llamas) + " |")
    print("|---" * (3 + 3 * len(llamas) + 1) + "|")
    for (model, case), by in runs.items():
        t = by.get("tandem", {})
        tm = statistics.median(t.values()) if t else 0
        entry = {"model": model, "case": case, "tandem": sorted(t.values()), "tandem_median": tm,
                 "vs": {}}
        cells_tps, cells_ratio, cells_roof = [], [], []
        gb = wbytes.get(model, 0) / 1e9
        roof = case == "decode" and gb > 0 and bw_med > 0

        def roofline(samples):  # pair -> tok/s
            per_round = [samples[p] * gb / bw_round[model][p]
                         for p in samples if p in bw_round[model]]
            if per_round:
                return statistics.median(per_round)
            return statistics.median(samples.values()) * gb / bw_med

        if roof and t:
            entry["tandem_roofline"] = roofline(t)
        for e in llamas:
            l = by.get(e, {})
            pairs = sorted(set(t) & set(l))
            ratios = [t[p] / l[p] for p in pairs if l[p] > 0]
            lm = statistics.median(l.values()) if l else 0
            rm = statistics.median(ratios) if ratios else 0
            rb = max(t.values()) / max(l.values()) if t and l and max(l.values()) > 0 else 0
            entry["vs"][e] = {"runs": sorted(l.values()), "median": lm, "pair_ratios": ratios,
                              "ratio_median": rm, "ratio_of_bests": rb}
            cells_tps.append("%.2f" % lm)
            cells_ratio.append("%.2fx; %.2fx" % (rm, rb))
            if roof and l:
                entry["vs"][e]["roofline"] = roofline(l)
                cells_roof.append("%.0f%% (%.1f GB/s)" % (100 * entry["vs"][e]["roofline"], lm * gb))
            else:
                cells_roof.append("")
        out["cases"].append(entry)
        roof_t = ("%.0f%% (%.1f GB/s)" % (100 * entry["tandem_roofline"], tm * gb)
                  if "tandem_roofline" in entry else "")
        print("| %s | %s | %.2f | %s | %s | %s | %s |" %
              (model, case, tm, " | ".join(cells_tps), " | ".join(cells_ratio), roof_t,
               " | ".join(cells_roof)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
