#!/usr/bin/env python3
"""Static checks of deploy/docker (there is no Docker daemon on the build machines).

The build's bin list is the set of `add_executable(tandem...)` targets in services/ and tools/
(the binaries the build puts in build/bin). Checks:
  - both images are multi-stage and on the right bases (Debian bookworm slim; NVIDIA CUDA runtime);
  - each image builds, copies and scans exactly the build's binaries, and each exists in BIN_DIR
    when that is given and built;
  - every binary the helm chart runs (`command:`) and every role of entrypoint.sh is in the image;
  - the files the Dockerfiles use are not excluded by .dockerignore;
  - with BIN_DIR built: runtime_packages.sh maps every library the binaries load to a package.
Usage: docker_check.py REPO_ROOT [BIN_DIR]. Prints PASS/FAIL lines; exits 1 on any FAIL.
"""
import fnmatch
import os
import re
import subprocess
import sys

root = sys.argv[1]
bin_dir = sys.argv[2] if len(sys.argv) > 2 else ""
failures = 0
passes = 0


def check(ok, what, detail=""):
    global failures, passes
    if ok:
        passes += 1
        print(f"PASS {what}")
    else:
        failures += 1
        print(f"FAIL {what}" + (f": {detail}" if detail else ""))


def read(rel):
    with open(os.path.join(root, rel)) as f:
        return f.read()


built = set()
for sub in ("services", "tools"):
    for dirpath, _, files in os.walk(os.path.join(root, sub)):
        if "CMakeLists.txt" in files:
            with open(os.path.join(dirpath, "CMakeLists.txt")) as f:
                built |= set(re.findall(r"add_executable\((tandem[\w-]*)", f.read()))
check({"tandem", "tandem-router", "tandem-prefill", "tandem-decode", "tandem-kvstore"} <= built,
      "the build's bin list has the five binaries of the contract", sorted(built))

for df, base_re, runtime_re in (
        ("deploy/docker/Dockerfile", r"^FROM debian:\$\{DEBIAN_RELEASE\} AS build$",
         r"^FROM debian:\$\{DEBIAN_RELEASE\}-slim AS runtime$"),
        ("deploy/docker/Dockerfile.cuda", r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-devel-\$\{UBUNTU_RELEASE\} AS build$",
         r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-runtime-\$\{UBUNTU_RELEASE\} AS runtime$")):
    text = read(df)
    lines = text.replace("\\\n", " ").splitlines()
    check(re.search(base_re, text, re.M) and re.search(runtime_re, text, re.M)
          and len(re.findall(r"^FROM ", text, re.M)) == 2 and "COPY --from=build /out/usr /usr" in text,
          f"{df}: two stages, build then runtime on its base")
    if df.endswith("Dockerfile"):
        check(re.search(r"^ARG DEBIAN_RELEASE=bookworm$", text, re.M), f"{df}: Debian bookworm")
    else:
        # The CUDA image must build the CUDA paths (engine, cuda_ipc, NCCL), not the CPU engine.
        cfg = " ".join(l for l in lines if "cmake -S" in l)
        check(re.search(r"^ARG CUDA_VERSION=13\.", text, re.M), f"{df}: CUDA 13, as the GPU machines")
        check("-DTANDEM_ENABLE_CUDA=ON" in cfg and "-DCMAKE_CUDA_COMPILER=" in cfg
              and "TANDEM_ENGINE_CUDA" not in text, f"{df}: configures the CUDA build", cfg)
        check('grep -q "tandem: CUDA kernels for"' in text and
              'grep -q "tandem: NCCL transport enabled"' in text,
              f"{df}: fails when nvcc or NCCL is not configured")
    targets = set()
    for line in lines:
        m = re.search(r"--target ((?:[\w-]+ ?)+)", line)
        if m:
            targets |= set(m.group(1).split())
    copied = set(re.findall(r"build/bin/([\w-]+)", text))
    scanned = set(re.findall(r"/out/usr/local/bin/(tandem[\w-]*)", text)) - {"tandem-entrypoint"}
    check(targets == built, f"{df}: builds exactly the build's binaries", f"{sorted(targets)} vs {sorted(built)}")
    check(copied == built, f"{df}: copies exactly the build's binaries", f"{sorted(copied)} vs {sorted(built)}")
    check(scanned == built, f"{df}: scans every binary for its libraries", f"{sorted(scanned)}")
    check(re.search(r"^USER 10001:10001$", text, re.M), f"{df}: runs as the chart's non-root uid")
    check('ENTRYPOINT ["tandem-entrypoint"]' in text, f"{df}: the role-picking entrypoint")
    for used in sorted(set(re.findall(r"((?:deploy|scripts)/[\w./-]+\.sh)", text))):
        check(os.access(os.path.join(root, used), os.X_OK), f"{df}: {used} exists and is executable")

if bin_dir and all(os.path.exists(os.path.join(bin_dir, b)) for b in built):
    check(True, f"every binary the images copy is in {bin_dir}")
elif bin_dir:
    missing = sorted(b for b in built if not os.path.exists(os.path.join(bin_dir, b)))
    print(f"NOTE not built yet in {bin_dir}: {missing}")

# The chart runs these binaries; the image must hold each.
commands = set()
for t in os.listdir(os.path.join(root, "helm/tandem/templates")):
    text = read(f"helm/tandem/templates/{t}")
    for c in re.findall(r'command: \["([^"]+)"\]', text):
        if "{{ $role }}" in c:
            commands |= {c.replace("{{ $role }}", r) for r in ("prefill", "decode")}
        elif c != "sleep":
            commands.add(c)
check(commands and commands <= built, "every binary the helm chart runs is in the image", sorted(commands))

entry = read("deploy/docker/entrypoint.sh")
m = re.search(r"^\s+([\w|]+)\)\n\s+role=", entry, re.M)
roles = m.group(1).split("|") if m else []
check(roles and {f"tandem-{r}" for r in roles} <= built, "entrypoint.sh roles name built binaries", roles)

# .dockerignore must keep what the build stage needs.
patterns = [p.strip() for p in read(".dockerignore").splitlines() if p.strip() and not p.startswith("#")]
needed = ["CMakeLists.txt", "services/decode/main.cc", "scripts/fetch_vocab.sh",
          "deploy/docker/entrypoint.sh", "deploy/docker/runtime_packages.sh", "proto/tandem/v1/worker.proto"]
for path in needed:
    excluded = [p for p in patterns
                if fnmatch.fnmatch(path, p.rstrip("/")) or fnmatch.fnmatch(path, p.rstrip("/") + "/*")
                or path.startswith(p.rstrip("/") + "/")]
    check(not excluded, f".dockerignore keeps {path}", excluded)
for path in ("build/bin/tandem", "build-k8s/x", ".cache/vocab/a.gguf", ".git/HEAD"):
    check(any(path.startswith(p.rstrip("/") + "/") or fnmatch.fnmatch(path, p.rstrip("/") + "/*")
              for p in patterns), f".dockerignore drops {path.split('/')[0]}/")

# runtime_packages.sh against the real binaries (this machine is Debian bookworm, the CPU base).
if bin_dir and all(os.path.exists(os.path.join(bin_dir, b)) for b in built) and \
        subprocess.run(["sh", "-c", "command -v dpkg"], capture_output=True).returncode == 0:
    bins = [os.path.join(bin_dir, b) for b in sorted(built)]
    out = subprocess.run([os.path.join(root, "deploy/docker/runtime_packages.sh")] + bins,
                         capture_output=True, text=True)
    pkgs = set(out.stdout.split())
    ldd = subprocess.run(["ldd"] + bins, capture_output=True, text=True).stdout
    libs = sorted({m for m in re.findall(r"=> (/\S+)", ldd)})
    # Who owns each library, straight from dpkg's file lists (one pass for all of them).
    variants = {}
    for lib in libs:
        real = os.path.realpath(lib)
        short = real.removeprefix("/usr")
        variants[lib] = {short, "/usr" + short}
    lists = [os.path.join("/var/lib/dpkg/info", f) for f in os.listdir("/var/lib/dpkg/info")
             if f.endswith(".list")]
    found = subprocess.run(["grep", "-HxF", "-f", "/dev/stdin"] + lists, capture_output=True, text=True,
                           input="\n".join(sorted(set().union(*variants.values()))) + "\n").stdout
    owners = {}
    for line in found.splitlines():
        path_of_list, _, owned = line.partition(".list:")  # list names may hold ":arch"
        owners.setdefault(owned, set()).add(os.path.basename(path_of_list).split(":")[0])
    # A CUDA build's binaries also load the CUDA runtime (libcudart, libnccl), which the CUDA
    # image's base provides (Dockerfile.cuda filters those packages out); the CPU image is
    # built without CUDA and never loads them.
    cuda_runtime = re.compile(r"/lib(cudart|nccl|cublas|cublasLt)\.so")
    unowned = [lib for lib in libs
               if not cuda_runtime.search(lib)
               and not set().union(*(owners.get(v, set()) for v in variants[lib])) & pkgs]
    check(out.returncode == 0 and "libc6" in pkgs and any(p.startswith("libgrpc") for p in pkgs)
          and not unowned, f"runtime_packages.sh maps all {len(libs)} libraries to {len(pkgs)} packages",
          f"rc {out.returncode}, unmapped {unowned}, {sorted(pkgs)}")

print(f"docker_check: {passes} passed, {failures} failed")
sys.exit(1 if failures else 0)
