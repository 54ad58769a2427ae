// A receiver in its own process for the transfer tests: the only honest way to test a dead or
// frozen UCX peer (in one process, cma "writes" to a destroyed peer still find mapped memory).
//
// Usage: transfer_test_peer --tls shm|tcp --bytes N [--alloc 1]
// Prints the hex-encoded RegionDescriptor of an N-byte registered region filled with bytes
// 0x5A, then serves commands on stdin, one per line:
//   hash  -> prints the FNV-1a 64 hash of the region in hex
//   quit  -> exits (so does end of input)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "common/transfer/ucx/ucx_transport.h"

namespace {

uint64_t Fnv1a(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace

int main(int argc, char** argv) {
  std::string tls = "shm";
  uint64_t bytes = 1 << 20;
  bool alloc = false;  // region from AllocateRegion (shared memory) instead of the heap
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--tls") == 0) tls = argv[i + 1];
    if (std::strcmp(argv[i], "--bytes") == 0) bytes = std::strtoull(argv[i + 1], nullptr, 10);
    if (std::strcmp(argv[i], "--alloc") == 0) alloc = std::strcmp(argv[i + 1], "1") == 0;
  }
  tandem::transfer::UcxTransportOptions opts;
  opts.transports = tls;
  auto t = tandem::transfer::CreateUcxTransport(opts);
  if (!t.ok()) {
    std::fprintf(stderr, "peer: %s\n", std::string(t.status().ToString()).c_str());
    return 1;
  }
  std::vector<uint8_t> heap;
  uint8_t* region = nullptr;
  absl::StatusOr<tandem::transfer::RegionDescriptor> d;
  if (alloc) {
    auto a = (*t)->AllocateRegion(bytes);
    if (a.ok()) {
      region = static_cast<uint8_t*>(a->base);
      d = a->descriptor;
    } else {
      d = a.status();
    }
  } else {
    heap.assign(bytes, 0);
    region = heap.data();
    d = (*t)->RegisterRegion(region, bytes);
  }
  if (!d.ok()) {
    std::fprintf(stderr, "peer: %s\n", std::string(d.status().ToString()).c_str());
    return 1;
  }
  std::memset(region, 0x5A, bytes);
  std::string wire = d->Serialize();
  std::string hex;
  static const char kHex[] = "0123456789abcdef";
  for (unsigned char c : wire) {
    hex.push_back(kHex[c >> 4]);
    hex.push_back(kHex[c & 15]);
  }
  std::printf("%s\n", hex.c_str());
  std::fflush(stdout);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "hash") {
      std::printf("%016llx\n",
                  static_cast<unsigned long long>(Fnv1a(region, bytes)));
      std::fflush(stdout);
    } else if (line == "quit") {
      break;
    }
  }
  return 0;
}
