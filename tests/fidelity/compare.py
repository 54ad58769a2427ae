#!/usr/bin/env python3
"""Compares tandem's greedy tokens with llama.cpp's (llama_ref) and prints the fidelity table.

Usage: compare.py MANIFEST
Each MANIFEST line is tab-separated: type, label, prompt, strict (1 or 0), ref.json, tandem.json.
A missing or unparsable JSON file is a FAIL for that row (its .err file, if any, is quoted).
Exit status: 0 when every row passes, 1 otherwise.

Rules (docs/fidelity.md explains them):
- The prompt tokenisations must be identical.
- strict rows (f32, f16, the real model) must match token for token.
- other rows (quantised weights) also pass as "near-tie" when the first divergence happens at a
  step where tandem picked a token whose llama.cpp logit is within max(ABS_GAP, REL_GAP *
  spread) of llama.cpp's best (llama_ref reports its 8 best ids and logits per step; with a
  128k vocabulary a near tie is often among more than two tokens). After that step the two texts have legitimately
  diverged, so nothing later is compared.
- mixture-of-experts rows also pass as "near-tie (routing)" when, at the diverging step, some
  token's router logits put its last chosen expert within ROUTER_GAP of the first unchosen one
  (llama_ref's router_gaps): there the two engines' rounding can pick different experts, which
  changes the output by far more than the output logits' own near-tie would.
"""
import json
import os
import sys

# Why these thresholds: with quantised weights both engines round the activations too (llama.cpp
# to Q8_0 or Q8_K blocks before its integer dot products), and a different but equally valid
# rounding or summation order moves every logit by an amount proportional to the logits'
# scale. The spread (max - min logit at that step) measures that scale; 1% of it is well above
# the observed rounding noise of 8-bit activation quantisation and well below the gap of a
# genuinely preferred token. The 0.05 floor covers steps with a tiny spread, where 1% would be
# below the noise that accumulates through the layers.
REL_GAP = 0.01
ABS_GAP = 0.05
# Routing margins, in router-logit units. The synthetic MoE models' router logits have a
# standard deviation of 2 (tools/tandem/model_tools.cc), so this is 2.5% of it: the same order as
# the activation-rounding differences ABS_GAP covers. A routing flip seen in the check (mixtral
# Q8_0) had a margin of 0.028.
ROUTER_GAP = 0.05


def load(path):
    """Returns (object, None) or (None, reason)."""
    try:
        # Text from a random-weight model can be any bytes; only the ids matter here.
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        return None, f"missing output ({e.strerror})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError:
        pass
    # Tolerate log lines around the object: take the last line that parses as a JSON object.
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line), None
            except json.JSONDecodeError:
                continue
    err = path[: -len(".json")] + ".err" if path.endswith(".json") else path + ".err"
    detail = ""
    if os.path.exists(err):
        with open(err, encoding="utf-8", errors="replace") as f:
            lines = [l.strip() for l in f if l.strip()]
        if lines:
            detail = ": " + lines[-1][:120]
    return None, "no JSON output" + detail


def compare(strict, ref, tan):
    """Returns (matched, result, detail)."""
    want = ref["tokens"]
    got = tan.get("tokens")
    if got is None:
        return 0, "FAIL", "tandem JSON has no tokens"
    if list(ref["prompt_tokens"]) != list(tan.get("prompt_tokens", [])):
        a, b = ref["prompt_tokens"], tan.get("prompt_tokens", [])
        return 0, "FAIL", f"prompt tokens differ: llama.cpp {a[:12]} vs tandem {b[:12]}"
    m = 0
    while m < len(want) and m < len(got) and want[m] == got[m]:
        m += 1
    if m == len(want) and m == len(got):
        return m, "PASS", ""
    if m == len(want):
        # llama.cpp stopped (end of generation) or was asked for fewer tokens.
        if ref.get("stopped") == "eog":
            return m, "PASS", "identical up to llama.cpp's end of generation"
        return m, "FAIL", f"tandem produced {len(got)} tokens, llama.cpp {len(want)}"
    if m == len(got):
        # tandem stopped early: fine only if it stopped on llama.cpp's final EOG token, which
        # it may leave out of its token list.
        if ref.get("stopped") == "eog" and m == len(want) - 1:
            return m, "PASS", "tandem omits the end-of-generation token"
        return m, "FAIL", f"tandem stopped after {len(got)} tokens, llama.cpp ran to {len(want)}"
    gap = ref["gaps"][m]
    spread = ref["spreads"][m]
    threshold = max(ABS_GAP, REL_GAP * spread)
    where = f"step {m}: llama.cpp {want[m]} (gap {gap:.4g}, spread {spread:.4g}), tandem {got[m]}"
    if strict:
        return m, "FAIL", "diverges at " + where
    top = ref.get("topk")
    if top is not None and m < len(top):
        best_logit = top[m][0][1]
        for tid, logit in top[m]:
            if tid == got[m] and best_logit - logit < threshold:
                return m, "PASS (near-tie)", where + f" (logit {best_logit - logit:.4g} below best)"
    elif gap < threshold and got[m] == ref["top2"][m]:
        return m, "PASS (near-tie)", where
    router_gaps = ref.get("router_gaps") or []
    if m < len(router_gaps) and router_gaps[m] < ROUTER_GAP:
        return m, "PASS (near-tie, routing)", where + f", routing margin {router_gaps[m]:.3g}"
    return m, "FAIL", "diverges at " + where


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    rows = []
    with open(sys.argv[1], encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            wtype, label, prompt, strict, ref_path, tan_path = line.split("\t")
            ref, why = load(ref_path)
            if ref is None:
                rows.append((wtype, label, prompt, "-", "FAIL", "llama_ref: " + why))
                continue
            tan, why = load(tan_path)
            if tan is None:
                rows.append((wtype, label, prompt, "-", "FAIL", "tandem: " + why))
                continue
            try:
                m, result, detail = compare(strict == "1", ref, tan)
            except (KeyError, IndexError, TypeError) as e:
                m, result, detail = 0, "FAIL", f"malformed JSON ({e!r})"
            rows.append((wtype, label, prompt, f"{m}/{len(ref['tokens'])}", result, detail))

    def short(p):
        p = p.replace("\n", " ")
        return (p[:28] + "...") if len(p) > 31 else (p or "(empty: BOS only)")

    header = ("type", "model", "prompt", "matched", "result")
    table = [header] + [(r[0], r[1], short(r[2]), r[3], r[4]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        print("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(row)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    details = [r for r in rows if r[5]]
    if details:
        print()
        for r in details:
            print(f"{r[0]} {r[1]} {short(r[2])!r}: {r[4]}: {r[5]}")
    failed = sum(1 for r in rows if r[4] == "FAIL")
    print(f"\nfidelity: {len(rows) - failed}/{len(rows)} passed")
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
