#!/usr/bin/env bash
# Compares tandem's UCX KvTransport (kv_transfer_bench) with ucx_perftest (Debian ucx-utils)
# between two processes on loopback, at the same message sizes, alternating the two tools
# REPEATS times and printing medians and ratios. Results feed docs/perf/kv-transfer.md.
#
# usage: bench/kv_transfer/run.sh [BUILD_DIR]       (default BUILD_DIR: build)
# env:   REPEATS (3), SIZES ("65536 ... 67108864"), BYTES_PER_SIZE (1 GiB), CONFIGS
#        ("shm_put shm_put_1op shm_am tcp_am"; add tcp_put for the emulated-put reference),
#        PORT (first TCP port for ucx_perftest's rendezvous, default 13500)
#
# Configurations (ours vs ucx_perftest):
#   shm_put      receiver region from AllocateRegion (shared memory): ucp_put + flush,
#                up to 64 ops per WriteAsync         vs ucp_put_bw, UCX_TLS=posix,sysv,cma
#   shm_put_1op  same, one op per WriteAsync         vs ucp_put_bw, UCX_TLS=posix,sysv,cma
#   shm_am       caller-allocated region: active messages received into it (rendezvous, cma)
#                                                    vs ucp_am_bw,  UCX_TLS=posix,sysv,cma
#   tcp_am       active messages over TCP            vs ucp_am_bw,  UCX_TLS=tcp
#   tcp_put      puts forced over TCP (emulated)     vs ucp_put_bw, UCX_TLS=tcp
set -euo pipefail

BUILD=${1:-build}
BENCH="$BUILD/bin/kv_transfer_bench"
REPEATS=${REPEATS:-3}
SIZES=${SIZES:-"65536 262144 1048576 4194304 16777216 67108864"}
BYTES_PER_SIZE=${BYTES_PER_SIZE:-1073741824}
CONFIGS=${CONFIGS:-"shm_put shm_put_1op shm_am tcp_am"}
PORT=${PORT:-13500}

command -v ucx_perftest >/dev/null || { echo "ucx_perftest missing: apt-get install ucx-utils" >&2; exit 1; }
[ -x "$BENCH" ] || { echo "$BENCH missing: ninja -C $BUILD kv_transfer_bench" >&2; exit 1; }

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
SIZES_CSV=$(echo $SIZES | tr ' ' ',')

config_args() {  # ours: kv_transfer_bench flags
  case $1 in
    shm_put)     echo "--tls shm --alloc 1 --ops-per-write 0" ;;
    shm_put_1op) echo "--tls shm --alloc 1 --ops-per-write 1 --kv 0" ;;
    shm_am)      echo "--tls shm --alloc 0 --ops-per-write 0" ;;
    tcp_am)      echo "--tls tcp --alloc 0 --ops-per-write 0" ;;
    tcp_put)     echo "--tls tcp --alloc 0 --mode put --ops-per-write 0 --kv 0" ;;
  esac
}
perftest_args() {  # UCX_TLS and test name
  case $1 in
    shm_put|shm_put_1op) echo "posix,sysv,cma ucp_put_bw" ;;
    shm_am)              echo "posix,sysv,cma ucp_am_bw" ;;
    tcp_am)              echo "tcp ucp_am_bw" ;;
    tcp_put)             echo "tcp ucp_put_bw" ;;
  esac
}

run_ours() {  # config
  # shellcheck disable=SC2046
  "$BENCH" $(config_args "$1") --sizes "$SIZES_CSV" --bytes-per-size "$BYTES_PER_SIZE" \
      2>/dev/null | grep '^RESULT' | while read -r line; do
    size=$(sed -n 's/.* size=\([0-9]*\).*/\1/p' <<<"$line")
    gbps=$(sed -n 's/.* gbps=\([0-9.]*\).*/\1/p' <<<"$line")
    if grep -q 'pattern=kv' <<<"$line"; then
      echo "$gbps $(sed -n 's/.* lat_ms=\([0-9.]*\).*/\1/p' <<<"$line")" >>"$OUT/ours_$1_kv"
    else
      echo "$gbps" >>"$OUT/ours_$1_$size"
    fi
  done
}

run_perftest() {  # config
  read -r tls test < <(perftest_args "$1")
  for size in $SIZES; do
    n=$((BYTES_PER_SIZE / size)); [ $n -gt 4000 ] && n=4000; [ $n -lt 16 ] && n=16
    w=$((n / 10 + 2))
    PORT=$((PORT + 1))
    UCX_TLS=$tls ucx_perftest -p $PORT >/dev/null 2>&1 &
    srv=$!
    sleep 0.4
    mibs=$(UCX_TLS=$tls timeout 120 ucx_perftest 127.0.0.1 -p $PORT -t "$test" -s "$size" \
               -n $n -w $w 2>/dev/null | awk '/Final:/ {print $7}')
    wait $srv 2>/dev/null || true
    # ucx_perftest prints MB/s with MB = 2^20 bytes; we report GB/s = 1e9 bytes/s.
    [ -n "$mibs" ] && awk -v m="$mibs" 'BEGIN {printf "%.3f\n", m * 1048576 / 1e9}' \
        >>"$OUT/perftest_$1_$size"
  done
}

median() { sort -n "$1" | awk '{v[NR]=$1} END {if (NR==0) print "-"; else if (NR%2) print v[(NR+1)/2]; else printf "%.3f\n", (v[NR/2]+v[NR/2+1])/2}'; }

echo "# $(date -u +%Y-%m-%dT%H:%MZ) $(uname -n) $(nproc) cores, load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "# UCX $(ucx_info -v | sed -n 's/# Version //p'), repeats=$REPEATS, bytes per size=$BYTES_PER_SIZE"
for r in $(seq 1 "$REPEATS"); do
  for c in $CONFIGS; do
    if [ $((r % 2)) -eq 1 ]; then run_ours "$c"; run_perftest "$c"
    else run_perftest "$c"; run_ours "$c"; fi
    echo "# repeat $r/$REPEATS $c done" >&2
  done
done

printf "\n%-12s %10s %12s %14s %7s\n" config size "ours GB/s" "perftest GB/s" ratio
for c in $CONFIGS; do
  for size in $SIZES; do
    [ -f "$OUT/ours_${c}_$size" ] || continue
    o=$(median "$OUT/ours_${c}_$size")
    p=$([ -f "$OUT/perftest_${c}_$size" ] && median "$OUT/perftest_${c}_$size" || echo -)
    ratio=$(awk -v o="$o" -v p="$p" 'BEGIN {if (p+0 > 0) printf "%.2f", o/p; else print "-"}')
    printf "%-12s %10s %12s %14s %7s\n" "$c" "$size" "$o" "$p" "$ratio"
  done
done
echo
LARGEST=$(echo $SIZES | tr ' ' '\n' | sort -n | tail -1)
printf "%-12s %s\n" config "KV handoff (16 layers x K,V x 16 blocks x 64 KiB = 32 MiB, scattered over 128 MiB pools): median GB/s, median latency ms"
for c in $CONFIGS; do
  f="$OUT/ours_${c}_kv"
  [ -f "$f" ] || continue
  g=$(awk '{print $1}' "$f" >"$f.g"; median "$f.g")
  l=$(awk '{print $2}' "$f" >"$f.l"; median "$f.l")
  # Scattered blocks miss the caches, so the fair reference is the largest (DRAM-bound) size,
  # not perftest's 64 KiB figure, which reuses one cache-resident buffer.
  p=$([ -f "$OUT/perftest_${c}_$LARGEST" ] && median "$OUT/perftest_${c}_$LARGEST" || echo -)
  ratio=$(awk -v o="$g" -v p="$p" 'BEGIN {if (p+0 > 0) printf "%.2f", o/p; else print "-"}')
  printf "%-12s %s GB/s, %s ms (ratio to ucx_perftest at %s B: %s)\n" "$c" "$g" "$l" "$LARGEST" "$ratio"
done
