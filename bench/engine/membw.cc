// membw: a STREAM-like read-bandwidth probe, the roofline that batch-1 decode is measured against
// (decode reads every weight once per token and does little arithmetic per byte).
//
// Each of --threads threads first-touches and then repeatedly sums its own contiguous slice of
// one --mib MiB array (far larger than the last-level cache) with 256-bit integer adds in four
// independent chains, so neither the adder latency nor the page faults are measured. A pass is
// all threads reading their slice once, started together; the bandwidth of a pass is the whole
// array over the slowest thread's time. Prints one JSON object with every pass, the median and
// the best, in GB/s (1e9 bytes per second).
//
// --pages picks the memory the array lives in, since page size changes what the hardware
// prefetchers can do (they stop at 4 KiB page boundaries): `anon` (malloc'd, 4 KiB pages under
// THP=madvise), `thp` (anonymous, madvise(MADV_HUGEPAGE)), or `file:PATH` (a read-only mmap of
// PATH, as the engine maps GGUF weights; the array is then the file's first --mib MiB and is not
// written).
#include <immintrin.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

__attribute__((target("avx2"))) uint64_t SumAvx2(const uint8_t* p, size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 128 <= bytes; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  uint64_t lanes[4];
  std::memcpy(lanes, &s, sizeof(lanes));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 2;
  size_t mib = 1024;
  int passes = 10;
  std::string pages = "anon";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    if (f == "--threads") {
      threads = std::atoi(argv[i + 1]);
    } else if (f == "--mib") {
      mib = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (f == "--passes") {
      passes = std::atoi(argv[i + 1]);
    } else if (f == "--pages") {
      pages = argv[i + 1];
    } else {
      std::fprintf(stderr,
                   "usage: membw [--threads N] [--mib M] [--passes P] [--pages anon|thp|file:PATH]\n");
      return 2;
    }
  }
  if (threads < 1 || mib < 1 || passes < 1) {
    std::fprintf(stderr, "membw: --threads, --mib and --passes must be >= 1\n");
    return 2;
  }
  size_t bytes = mib << 20;
  uint8_t* data = nullptr;
  const bool from_file = pages.rfind("file:", 0) == 0;
  if (from_file) {
    const std::string path = pages.substr(5);
    const int fd = open(path.c_str(), O_RDONLY);
    struct stat st {};
    if (fd < 0 || fstat(fd, &st) != 0) {
      std::fprintf(stderr, "membw: cannot open %s\n", path.c_str());
      return 1;
    }
    bytes = std::min<size_t>(bytes, static_cast<size_t>(st.st_size) / 4096 * 4096);
    void* m = mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "membw: cannot map %s\n", path.c_str());
      return 1;
    }
    data = static_cast<uint8_t*>(m);
  } else if (pages == "anon") {
    data = static_cast<uint8_t*>(std::aligned_alloc(4096, bytes));
  } else if (pages == "thp") {
    data = static_cast<uint8_t*>(std::aligned_alloc(2 << 20, bytes));
    if (data != nullptr) madvise(data, bytes, MADV_HUGEPAGE);
  } else {
    std::fprintf(stderr, "membw: --pages is anon, thp or file:PATH\n");
    return 2;
  }
  if (data == nullptr) {
    std::fprintf(stderr, "membw: cannot allocate %zu MiB\n", mib);
    return 1;
  }
  const size_t slice = bytes / threads / 4096 * 4096;

  std::vector<double> secs(threads);
  std::atomic<uint64_t> sink{0};
  std::barrier sync(threads);
  std::vector<std::vector<double>> per_pass(passes, std::vector<double>(threads));
  auto worker = [&](int t) {
    uint8_t* mine = data + t * slice;
    if (!from_file) {  // first touch, from the thread that reads the slice
      for (size_t i = 0; i < slice; ++i) mine[i] = static_cast<uint8_t>(i * 7 + t);
    }
    (void)SumAvx2(mine, slice);  // warm the TLB and the pages once
    for (int p = 0; p < passes; ++p) {
      sync.arrive_and_wait();
      const auto t0 = Clock::now();
      sink += SumAvx2(mine, slice);
      per_pass[p][t] = std::chrono::duration<double>(Clock::now() - t0).count();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, t);
  for (auto& th : pool) th.join();

  std::vector<double> gbps;
  for (const auto& pass : per_pass) {
    const double slowest = *std::max_element(pass.begin(), pass.end());
    gbps.push_back(static_cast<double>(slice) * threads / slowest / 1e9);
  }
  std::printf("{\"tool\":\"membw\",\"threads\":%d,\"mib\":%zu,\"pages\":\"%s\",\"passes\":%d,"
              "\"gb_per_s\":{\"runs\":[",
              threads, bytes >> 20, from_file ? "file" : pages.c_str(), passes);
  for (size_t i = 0; i < gbps.size(); ++i) std::printf("%s%.3f", i ? "," : "", gbps[i]);
  std::printf("],\"median\":%.3f,\"best\":%.3f},\"checksum\":%llu}\n", Median(gbps),
              *std::max_element(gbps.begin(), gbps.end()),
              static_cast<unsigned long long>(sink.load() & 0xff));
  if (from_file) {
    munmap(data, bytes);
  } else {
    std::free(data);
  }
  return 0;
}
