#!/usr/bin/env python3
"""Generates engine/tokenizer/unicode_data.cc from the Unicode Character Database.

The byte-level BPE pre-tokenizers split text by Unicode general category (\\p{L}, \\p{N}, ...)
and by White_Space. This script reduces UnicodeData.txt and PropList.txt to two compact range
tables: (first code point, category) for every run of code points sharing a category, and the
White_Space ranges. Unassigned code points (Cn) get the "undefined" category.

Input: the Debian package unicode-data (/usr/share/unicode). Run from anywhere:
    python3 scripts/gen_unicode_tables.py [--ucd /usr/share/unicode] [--out FILE]
The output is deterministic, so re-running it on the same data gives the same file.

llama.cpp's tables (which the tokenizer test vectors are checked against) are Unicode 15.1.
Debian bookworm ships 15.0, so for a 15.0 database the script overlays the 627 code points that
15.1 assigned (see UNICODE_15_1_ADDITIONS); with any other version it uses the data as is.
"""

import argparse
import os
import re
import sys

MAX_CODEPOINT = 0x110000

# Category codes; engine/tokenizer/unicode.h has the same numbering.
UNDEFINED, NUMBER, LETTER, SEPARATOR, MARK, PUNCTUATION, SYMBOL, CONTROL = range(8)
CATEGORY_NAMES = ["kUndefined", "kNumber", "kLetter", "kSeparator", "kMark", "kPunctuation",
                  "kSymbol", "kControl"]

# General category (first letter, plus Cn) -> code.
MAJOR = {"N": NUMBER, "L": LETTER, "Z": SEPARATOR, "M": MARK, "P": PUNCTUATION, "S": SYMBOL,
         "C": CONTROL}


# Code points assigned by Unicode 15.1 (https://www.unicode.org/versions/Unicode15.1.0/):
# ideographic description characters U+2FFC..U+2FFF and U+31EF (So), and CJK Unified
# Ideographs Extension I U+2EBF0..U+2EE5D (Lo).
UNICODE_15_1_ADDITIONS = [
    (0x2FFC, 0x2FFF, SYMBOL),
    (0x31EF, 0x31EF, SYMBOL),
    (0x2EBF0, 0x2EE5D, LETTER),
]


def read_categories(path):
    cats = bytearray([UNDEFINED]) * MAX_CODEPOINT
    range_start = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.rstrip("\n").split(";")
            if len(fields) < 3:
                continue
            cp = int(fields[0], 16)
            name, gc = fields[1], fields[2]
            code = UNDEFINED if gc == "Cn" else MAJOR[gc[0]]
            if name.endswith(", First>"):
                range_start = cp
                continue
            if name.endswith(", Last>"):
                assert range_start is not None, line
                for c in range(range_start, cp + 1):
                    cats[c] = code
                range_start = None
                continue
            cats[cp] = code
    return cats


def read_whitespace(path):
    ranges = []
    pat = re.compile(r"^([0-9A-F]+)(?:\.\.([0-9A-F]+))?\s*;\s*White_Space\b")
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = pat.match(line)
            if m:
                lo = int(m.group(1), 16)
                hi = int(m.group(2), 16) if m.group(2) else lo
                ranges.append((lo, hi))
    ranges.sort()
    return ranges


def read_version(ucd):
    with open(os.path.join(ucd, "PropList.txt"), encoding="utf-8") as f:
        m = re.search(r"PropList-([0-9.]+)\.txt", f.readline())
    return m.group(1) if m else "unknown"


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ucd", default="/usr/share/unicode")
    default_out = os.path.normpath(
        os.path.join(here, "..", "engine", "tokenizer", "unicode_data.cc"))
    ap.add_argument("--out", default=default_out)
    args = ap.parse_args()

    cats = read_categories(os.path.join(args.ucd, "UnicodeData.txt"))
    ws = read_whitespace(os.path.join(args.ucd, "PropList.txt"))
    version = read_version(args.ucd)
    ucd_version = version
    overlay = False
    if version == "15.0.0":
        for lo, hi, code in UNICODE_15_1_ADDITIONS:
            for cp in range(lo, hi + 1):
                assert cats[cp] == UNDEFINED, hex(cp)
                cats[cp] = code
        version = "15.1.0"
        overlay = True

    runs = [(0, cats[0])]
    for cp in range(1, MAX_CODEPOINT):
        if cats[cp] != runs[-1][1]:
            runs.append((cp, cats[cp]))

    out = []
    out.append("// GENERATED FILE, DO NOT EDIT. Regenerate with:")
    out.append("//   python3 scripts/gen_unicode_tables.py")
    out.append(f"// from the Unicode Character Database {ucd_version} of the Debian package unicode-data")
    out.append("// (/usr/share/unicode/UnicodeData.txt and PropList.txt)" +
               (", plus the code points Unicode 15.1" if overlay else "."))
    if overlay:
        out.append("// assigned (listed in the script), to match llama.cpp's 15.1 tables.")
    out.append("// Each category entry packs (first code point << 3) | category; an entry covers code")
    out.append("// points up to the next entry's first code point. Categories are numbered as in")
    names = [f"{i}={n[1:]}" for i, n in enumerate(CATEGORY_NAMES)]
    out.append("// unicode.h: " + ", ".join(names[:4]) + ",")
    out.append("// " + ", ".join(names[4:]) + ".")
    out.append("")
    out.append('#include "engine/tokenizer/unicode_data.h"')
    out.append("")
    out.append("namespace tandem::engine::unicode_data {")
    out.append("")
    out.append(f'const char kUnicodeVersion[] = "{version}";')
    out.append("")
    out.append(f"// {len(runs)} runs.")
    out.append("const uint32_t kCategoryRuns[] = {")
    per_line = 8
    for i in range(0, len(runs), per_line):
        chunk = runs[i:i + per_line]
        out.append("    " + " ".join(f"0x{(cp << 3) | c:07X}," for cp, c in chunk))
    out.append("};")
    out.append("const size_t kNumCategoryRuns = sizeof(kCategoryRuns) / sizeof(kCategoryRuns[0]);")
    out.append("")
    out.append(f"// {len(ws)} inclusive ranges.")
    out.append("const uint32_t kWhitespaceRanges[][2] = {")
    for i in range(0, len(ws), 4):
        out.append("    " + " ".join(f"{{0x{lo:04X}, 0x{hi:04X}}}," for lo, hi in ws[i:i + 4]))
    out.append("};")
    out.append("const size_t kNumWhitespaceRanges = "
               "sizeof(kWhitespaceRanges) / sizeof(kWhitespaceRanges[0]);")
    out.append("")
    out.append("}  // namespace tandem::engine::unicode_data")
    out.append("")

    with open(args.out, "w", encoding="utf-8") as f:
        f.write("\n".join(out))
    print(f"{args.out}: {len(runs)} category runs, {len(ws)} whitespace ranges, "
          f"Unicode {version} (database {ucd_version})", file=sys.stderr)


if __name__ == "__main__":
    main()
