#!/usr/bin/env bash
# `make tsan`: a ThreadSanitizer build of tandem in build-tsan/ and a run of its unit, component
# and fault tests (README.md, "make tsan").
#
# Every lock in tandem is an absl::Mutex, which lives in libabsl_synchronization.so, and every
# RPC hands its state between threads inside gRPC (completion queues, closures, call
# combiners). Debian builds both without TSan, so TSan would see none of their happens-before
# edges and report every guarded access and every handler. This script therefore first builds
# Debian's own source packages of the installed abseil and gRPC (same versions, same patches,
# so the same ABI and SONAMEs) with -fsanitize=thread into build-tsan/abseil/lib, and runs the
# tests with that first on LD_LIBRARY_PATH. The tandem objects compile against the installed
# headers, which are the same source.
#
#   scripts/tsan.sh [CTEST_ARGS...]     (default: -L 'unit|component|fault')
#   scripts/tsan.sh --deps-only         (steps 1 to 3 only)
# env: TSAN_BUILD (default build-tsan), JOBS (default nproc)
# Reports: each process writes build-tsan/reports/tsan.PID on a race; any report fails the run.
set -euo pipefail
shopt -s inherit_errexit  # a failing step inside $(...) stops the script too
cd "$(dirname "$0")/.."
root=$PWD
out=${TSAN_BUILD:-build-tsan}
jobs=${JOBS:-$(nproc)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
absl_lib=$out/abseil/lib

launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
tsan_flags="-fsanitize=thread -fno-omit-frame-pointer"

# Fetches Debian source package $1 at version $2 into $3 and applies Debian's patches; prints
# the unpacked tree. A private apt state with the deb-src lines of the system's own suites:
# nothing of the system's apt configuration changes.
debian_source() {
  local pkg=$1 version=$2 src=$3 codename tree p
  mkdir -p "$src/apt/lists/partial" "$src/apt/cache"
  codename=$(. /etc/os-release && echo "$VERSION_CODENAME")
  printf 'deb-src http://deb.debian.org/debian %s main\ndeb-src http://deb.debian.org/debian-security %s-security main\n' \
    "$codename" "$codename" >"$src/apt/sources.list"
  local apt_opts=(-o Dir::Etc::SourceList="$src/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
                  -o Dir::State::Lists="$src/apt/lists" -o Dir::Cache="$src/apt/cache"
                  -o APT::Sandbox::User=root)
  apt-get "${apt_opts[@]}" update -qq >&2
  (cd "$src" && apt-get "${apt_opts[@]}" source --download-only -qq "$pkg=$version" >&2)
  mkdir -p "$src/unpack"
  tar -xf "$src/${pkg}_${version%%-*}.orig.tar."* -C "$src/unpack"
  tree=$(find "$src/unpack" -mindepth 1 -maxdepth 1 -type d | head -1)
  tar -xf "$src/${pkg}_"*.debian.tar.* -C "$tree"
  while read -r p; do
    case "$p" in ''|'#'*) continue ;; esac
    patch -s -d "$tree" -p1 <"$tree/debian/patches/$p"
  done <"$tree/debian/patches/series"
  echo "$tree"
}

# 1. abseil, from the Debian source package of the installed libabsl.
absl_version=$(dpkg-query -W -f '${source:Version}' libabsl-dev)
if [ ! -f "$out/abseil/.version" ] || [ "$(cat "$out/abseil/.version")" != "$absl_version" ]; then
  rm -rf "$out/abseil-src" "$out/abseil-build" "$out/abseil"
  tree=$(debian_source abseil "$absl_version" "$out/abseil-src")
  cmake -S "$tree" -B "$out/abseil-build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_STANDARD=17 -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF \
    -DCMAKE_CXX_FLAGS="$tsan_flags" \
    -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread -DCMAKE_INSTALL_PREFIX="$out/abseil" \
    -DCMAKE_INSTALL_LIBDIR=lib "${launcher[@]}" >/dev/null
  ninja -C "$out/abseil-build" -j "$jobs" install >/dev/null
  echo "$absl_version" >"$out/abseil/.version"
fi

# 2. gRPC, the same way: its completion queues, closures, slices and call combiners hand work
# between threads through its own atomics, so an uninstrumented gRPC leaves TSan without the
# edges between a handler and the thread that completes its call, and every handler's state
# looks racy. Only the libraries tandem links are built; they go into the same lib/ (same
# SONAMEs as the installed libgrpc*), against the installed abseil, protobuf, c-ares, re2 and
# OpenSSL headers, the way Debian configures it. The installed grpc_cpp_plugin (same version)
# generates the reflection service: naming CMAKE_SYSTEM_NAME makes CMake treat the build as a
# cross build, gRPC's switch for a prebuilt plugin. Building gRPC's own would need libprotoc's
# headers, which nothing else here uses; its plugin-support library is configured (against the
# installed libprotoc) but never built.
grpc_version=$(dpkg-query -W -f '${source:Version}' libgrpc-dev)
if [ ! -f "$out/abseil/.grpc-version" ] || [ "$(cat "$out/abseil/.grpc-version")" != "$grpc_version" ]; then
  rm -rf "$out/grpc-src" "$out/grpc-build"
  tree=$(debian_source grpc "$grpc_version" "$out/grpc-src")
  # As Debian builds it (build type None: no NDEBUG, so the same debug-only members), at -O1
  # -g1, which takes a third less time than -O2 -g under TSan and keeps file:line in reports.
  cmake -S "$tree" -B "$out/grpc-build" -G Ninja -DCMAKE_BUILD_TYPE=None \
    -DCMAKE_C_FLAGS="-O1 -g1 $tsan_flags" -DCMAKE_CXX_FLAGS="-O1 -g1 $tsan_flags" -DCMAKE_CXX_STANDARD=17 \
    -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread -DBUILD_SHARED_LIBS=ON -DgRPC_BUILD_TESTS=OFF \
    -DgRPC_ABSL_PROVIDER=package -DgRPC_CARES_PROVIDER=package -DgRPC_PROTOBUF_PROVIDER=package \
    -DgRPC_RE2_PROVIDER=package -DgRPC_SSL_PROVIDER=package -DgRPC_ZLIB_PROVIDER=package \
    -DgRPC_BACKWARDS_COMPATIBILITY_MODE=OFF \
    -DgRPC_BUILD_GRPC_CSHARP_PLUGIN=OFF -DgRPC_BUILD_GRPC_NODE_PLUGIN=OFF \
    -DgRPC_BUILD_GRPC_OBJECTIVE_C_PLUGIN=OFF -DgRPC_BUILD_GRPC_PHP_PLUGIN=OFF \
    -DgRPC_BUILD_GRPC_PYTHON_PLUGIN=OFF -DgRPC_BUILD_GRPC_RUBY_PLUGIN=OFF \
    -DgRPC_BUILD_GRPC_CPP_PLUGIN=OFF -DCMAKE_SYSTEM_NAME=Linux \
    -DProtobuf_PROTOC_LIBRARY="$(ls /usr/lib/*/libprotoc.so.* | head -1)" "${launcher[@]}" >/dev/null
  ninja -C "$out/grpc-build" -j "$jobs" grpc grpc++ grpc++_reflection gpr upb address_sorting >/dev/null
  find "$out/grpc-build" -maxdepth 1 -name 'lib*.so.*' -exec cp -P {} "$absl_lib/" \;
  echo "$grpc_version" >"$out/abseil/.grpc-version"
fi

# 3. cpp-httplib, the same way (the router's HTTP front door runs tandem's handlers on its
# threads): Debian's source, its patches, split into httplib.h/.cc by its own split.py, built
# with the feature macros and SONAME of the installed library (pkg-config cpp-httplib). Its
# header must be the installed one, or the ABI could differ: checked.
httplib_version=$(dpkg-query -W -f '${source:Version}' libcpp-httplib-dev)
if [ ! -f "$out/abseil/.httplib-version" ] ||
   [ "$(cat "$out/abseil/.httplib-version")" != "$httplib_version" ]; then
  rm -rf "$out/httplib-src"
  mkdir -p "$out/httplib-src"
  tree=$(debian_source cpp-httplib "$httplib_version" "$out/httplib-src")
  (cd "$tree" && python3 ./split.py --out "$out/httplib-src/split" >/dev/null)
  cmp -s "$out/httplib-src/split/httplib.h" /usr/include/httplib.h ||
    { echo "tsan: cpp-httplib source does not match the installed httplib.h" >&2; exit 1; }
  soname=$(objdump -p "$(ls /usr/lib/*/libcpp-httplib.so.* | head -1)" | awk '/SONAME/ {print $2}')
  # shellcheck disable=SC2046
  c++ -std=c++11 -O1 -g1 -fPIC $tsan_flags -DCPPHTTPLIB_USE_POLL \
    $(pkg-config --cflags cpp-httplib) -I"$out/httplib-src/split" -shared -Wl,-soname,"$soname" \
    -o "$absl_lib/$soname" "$out/httplib-src/split/httplib.cc" -lssl -lcrypto -lz -lbrotlidec \
    -lbrotlienc -pthread
  echo "$httplib_version" >"$out/abseil/.httplib-version"
fi

[ "${1:-}" = "--deps-only" ] && exit 0

# 4. tandem with -fsanitize=thread (no CUDA: TSan does not see device work).
if [ ! -f "$out/tandem/build.ninja" ]; then
  cmake -S "$root" -B "$out/tandem" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DTANDEM_SANITIZE=thread -DTANDEM_ENABLE_CUDA=OFF >/dev/null
fi
cmake --build "$out/tandem" -j "$jobs"

# 5. The tests, every process on the instrumented libraries, reports to files.
rm -rf "$out/reports"
mkdir -p "$out/reports"
args=("$@")
export LD_LIBRARY_PATH=$absl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# UCX's memory hooks (it patches mmap/munmap relocations to track registered memory) crash
# under TSan's own interceptors: every UCX process died with SIGSEGV at start. Off, UCX runs.
export UCX_MEM_EVENTS=no
export TSAN_OPTIONS="suppressions=$root/tests/tsan.supp log_path=$out/reports/tsan second_deadlock_stack=1 history_size=4 ${TSAN_OPTIONS:-}"
status=0
if [ ${#args[@]} -gt 0 ]; then
  ctest --test-dir "$out/tandem" --output-on-failure -j "$jobs" --timeout 900 "${args[@]}" ||
    status=$?
else
  ctest --test-dir "$out/tandem" --output-on-failure -j "$jobs" --timeout 900 \
    -L 'unit|component' || status=$?
  # The fault tests run one at a time: each is a cluster of instrumented processes, and two
  # of them at once on a small machine starve each other's heartbeats and streams.
  ctest --test-dir "$out/tandem" --output-on-failure -j 1 --timeout 900 -L fault || status=$?
fi
reports=$(find "$out/reports" -type f | wc -l)
if [ "$reports" -gt 0 ]; then
  echo "tsan: $reports process(es) reported; first warnings:" >&2
  grep -h -A12 "^WARNING: ThreadSanitizer" "$out"/reports/* | head -80 >&2
  status=1
fi
[ "$status" -eq 0 ] && echo "tsan: clean"
exit "$status"
