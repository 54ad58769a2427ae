#!/usr/bin/env bash
# `make tsan`: a ThreadSanitizer build of tandem in build-tsan/ and a run of its unit, component
# and fault tests (README.md, "make tsan").
#
# Every lock in tandem is an absl::Mutex, which lives in libabsl_synchronization.so. Debian builds
# abseil without TSan, so TSan would see none of its happens-before edges and report every
# guarded access. This script therefore first builds Debian's own abseil source package (the
# installed version, its patches, so the same ABI and SONAMEs) with -fsanitize=thread into
# build-tsan/abseil, and runs the tests with it first on LD_LIBRARY_PATH: tandem and gRPC (whose
# gpr_mu is an absl::Mutex too) both use it. The tandem objects compile against the installed
# headers, which are the same source.
#
#   scripts/tsan.sh [CTEST_ARGS...]     (default: -L 'unit|component|fault')
#   scripts/tsan.sh --abseil-only       (step 1 only)
# env: TSAN_BUILD (default build-tsan), JOBS (default nproc)
# Reports: each process writes build-tsan/reports/tsan.PID on a race; any report fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${TSAN_BUILD:-build-tsan}
jobs=${JOBS:-$(nproc)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
absl_lib=$out/abseil/lib

# 1. abseil, from the Debian source package of the installed libabsl.
absl_version=$(dpkg-query -W -f '${source:Version}' libabsl-dev)
if [ ! -f "$out/abseil/.version" ] || [ "$(cat "$out/abseil/.version")" != "$absl_version" ]; then
  src=$out/abseil-src
  rm -rf "$src" "$out/abseil-build" "$out/abseil"
  mkdir -p "$src/apt/lists/partial" "$src/apt/cache"
  # A private apt state with the deb-src lines of the system's own suites: nothing of the
  # system's apt configuration changes.
  codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
  printf 'deb-src http://deb.debian.org/debian %s main\ndeb-src http://deb.debian.org/debian-security %s-security main\n' \
    "$codename" "$codename" >"$src/apt/sources.list"
  apt_opts=(-o Dir::Etc::SourceList="$src/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
            -o Dir::State::Lists="$src/apt/lists" -o Dir::Cache="$src/apt/cache"
            -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq
  (cd "$src" && apt-get "${apt_opts[@]}" source --download-only -qq "abseil=$absl_version")
  tar -xf "$src"/abseil_*.orig.tar.* -C "$src"
  tree=$(find "$src" -mindepth 1 -maxdepth 1 -type d -name 'abseil-[0-9]*' | head -1)
  tar -xf "$src"/abseil_*.debian.tar.* -C "$tree"
  while read -r p; do
    case "$p" in ''|'#'*) continue ;; esac
    patch -s -d "$tree" -p1 <"$tree/debian/patches/$p"
  done <"$tree/debian/patches/series"
  launcher=()
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cmake -S "$tree" -B "$out/abseil-build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF \
    -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
    -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread -DCMAKE_INSTALL_PREFIX="$out/abseil" \
    -DCMAKE_INSTALL_LIBDIR=lib "${launcher[@]}" >/dev/null
  ninja -C "$out/abseil-build" -j "$jobs" install >/dev/null
  echo "$absl_version" >"$out/abseil/.version"
fi

[ "${1:-}" = "--abseil-only" ] && exit 0

# 2. tandem with -fsanitize=thread (no CUDA: TSan does not see device work).
if [ ! -f "$out/tandem/build.ninja" ]; then
  cmake -S "$root" -B "$out/tandem" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DTANDEM_SANITIZE=thread -DTANDEM_ENABLE_CUDA=OFF >/dev/null
fi
cmake --build "$out/tandem" -j "$jobs"

# 3. The tests, every process on the instrumented abseil, reports to files.
rm -rf "$out/reports"
mkdir -p "$out/reports"
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(-L 'unit|component|fault')
export LD_LIBRARY_PATH=$absl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# UCX's memory hooks (it patches mmap/munmap relocations to track registered memory) crash
# under TSan's own interceptors: every UCX process died with SIGSEGV at start. Off, UCX runs.
export UCX_MEM_EVENTS=no
export TSAN_OPTIONS="suppressions=$root/tests/tsan.supp log_path=$out/reports/tsan second_deadlock_stack=1 history_size=4 ${TSAN_OPTIONS:-}"
status=0
ctest --test-dir "$out/tandem" --output-on-failure -j "$jobs" --timeout 900 "${args[@]}" || status=$?
reports=$(find "$out/reports" -type f | wc -l)
if [ "$reports" -gt 0 ]; then
  echo "tsan: $reports process(es) reported; first warnings:" >&2
  grep -h -A12 "^WARNING: ThreadSanitizer" "$out"/reports/* | head -80 >&2
  status=1
fi
[ "$status" -eq 0 ] && echo "tsan: clean"
exit "$status"
