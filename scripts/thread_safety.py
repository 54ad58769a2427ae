#!/usr/bin/env python3
"""Clang's thread-safety analysis over the project's lock annotations (ABSL_GUARDED_BY & co).

The build uses GCC, which ignores the annotations. This script re-runs the build's own compile
commands (BUILD/compile_commands.json) through Debian's clang++ with -fsyntax-only and
-Werror=thread-safety, so a guarded member touched without its mutex, a lock-requiring function
called without the lock, or a lock leaked out of a scope fails the check. Other warnings are left
to the GCC build.

Checked: every translation unit whose own text names a lock annotation or an absl::Mutex, and for
each annotated project header none of those includes, one unit that includes it (a header's inline
code is analysed in every unit that includes it, so once is enough). --all checks every unit.

Usage: thread_safety.py BUILD_DIR [-j N] [--all]
Exit status: 0 clean, 1 findings (printed), 77 when no clang++ is installed (ctest: skipped).
"""
import argparse
import concurrent.futures
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

MARKERS = re.compile(r"ABSL_(GUARDED_BY|PT_GUARDED_BY|EXCLUSIVE_LOCKS_REQUIRED|"
                     r"SHARED_LOCKS_REQUIRED|LOCKS_EXCLUDED|ACQUIRED_AFTER|ACQUIRED_BEFORE|"
                     r"LOCKABLE|SCOPED_LOCKABLE|ASSERT_EXCLUSIVE_LOCK|NO_THREAD_SAFETY_ANALYSIS)|"
                     r"absl::(Mutex|MutexLock)\b")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
# Flags of the GCC build that clang does not take or that only produce output.
DROP_WITH_ARG = {"-o", "-MF", "-MT", "-MQ"}
DROP = {"-c", "-MD", "-MMD"}


def find_clang():
    for name in ["clang++"] + [f"clang++-{v}" for v in range(20, 13, -1)]:
        path = shutil.which(name)
        if path:
            return path
    return None


def read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def select_units(sources, root):
    """The translation units whose own text names a lock annotation, plus, for each annotated
    project header that none of them includes, one unit that does (its inline code is analysed
    there). A header's code is the same in every unit, so one check of it is enough."""
    chosen, includes = [], {}
    for src in sources:
        text = read(src)
        includes[src] = set(INCLUDE.findall(text))
        if MARKERS.search(text):
            chosen.append(src)
    covered = set().union(*(includes[src] for src in chosen)) if chosen else set()
    for src in sources:
        if src in chosen:
            continue
        for inc in includes[src] - covered:
            header = os.path.join(root, inc)
            if os.path.isfile(header) and MARKERS.search(read(header)):
                chosen.append(src)
                covered |= includes[src]
                break
    return chosen


def clang_command(entry, clang):
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    # Drop the launcher (ccache), if any, and the compiler itself.
    if os.path.basename(args[0]) == "ccache":
        args = args[1:]
    args = args[1:]
    out = [clang, "-fsyntax-only", "-Wno-everything", "-Wthread-safety",
           "-Werror=thread-safety"]
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in DROP_WITH_ARG:
            skip = True
            continue
        if a in DROP or (a.startswith("-W") and not a.startswith("-Wl,")):
            continue
        out.append(a)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("build")
    p.add_argument("-j", type=int, default=os.cpu_count() or 1)
    p.add_argument("--all", action="store_true", help="check every translation unit")
    a = p.parse_args()

    clang = find_clang()
    if clang is None:
        print("thread_safety: no clang++ installed (apt-get install clang); skipped")
        return 77
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    db = os.path.join(a.build, "compile_commands.json")
    with open(db, encoding="utf-8") as f:
        entries = json.load(f)
    build_abs = os.path.abspath(a.build)
    by_source = {}
    for e in entries:
        src = os.path.normpath(os.path.join(e["directory"], e["file"]))
        if not src.endswith(".cc") or not src.startswith(root + os.sep):
            continue
        if src.startswith(build_abs + os.sep):  # generated code (protobuf, gRPC stubs)
            continue
        by_source.setdefault(src, e)
    chosen = list(by_source) if a.all else select_units(list(by_source), root)
    units = [(src, by_source[src]) for src in chosen]
    if not units:
        print("thread_safety: no translation unit found in", db)
        return 1

    def check(unit):
        src, e = unit
        r = subprocess.run(clang_command(e, clang), cwd=e["directory"], capture_output=True,
                           text=True)
        return src, r.returncode, r.stderr

    failed = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=a.j) as pool:
        for src, rc, err in pool.map(check, units):
            if rc != 0:
                failed.append(os.path.relpath(src, root))
                sys.stdout.write(err)
    print(f"thread_safety: {os.path.basename(clang)} checked {len(units)} translation units, "
          f"{len(failed)} with findings{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
