// A plain main() for the fuzz targets, so builds without libFuzzer (gcc) still exercise them:
//   <target>_corpus [--mutations=N] [--seed=S] PATH...
// Every PATH is a file, or a folder whose files are each fed once to LLVMFuzzerTestOneInput.
// With --mutations=N it then runs a short unguided fuzz pass: N inputs made from the corpus by
// random byte edits (flip, set to an edge value, insert, erase, duplicate a run, splice with
// another input), from a fixed seed so a failure reproduces. Before each mutated input runs it
// is written to <target>.last-input in the working folder, so a crash leaves it behind.
// Exits non-zero when an argument cannot be read or no input was found.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);
extern "C" __attribute__((weak)) int LLVMFuzzerInitialize(int* argc, char*** argv);

namespace {

using Bytes = std::vector<uint8_t>;

void RunOne(const Bytes& bytes) {
  // A copy of exactly the input's size, as libFuzzer passes it.
  Bytes copy = bytes;
  LLVMFuzzerTestOneInput(copy.empty() ? nullptr : copy.data(), copy.size());
}

Bytes Mutate(const std::vector<Bytes>& corpus, std::mt19937_64& rng) {
  auto pick = [&](size_t n) { return n == 0 ? size_t{0} : size_t(rng() % n); };
  Bytes b = corpus[pick(corpus.size())];
  static constexpr uint8_t kEdge[] = {0x00, 0x01, 0x7f, 0x80, 0xff, 0xfe, '{', '"', '\\', 0x0a};
  const int edits = 1 + int(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    switch (rng() % 6) {
      case 0:  // flip one bit
        if (!b.empty()) b[pick(b.size())] ^= uint8_t(1u << (rng() % 8));
        break;
      case 1:  // an edge value
        if (!b.empty()) b[pick(b.size())] = kEdge[pick(sizeof(kEdge))];
        break;
      case 2: {  // insert random bytes
        const size_t at = pick(b.size() + 1), n = 1 + pick(8);
        Bytes ins(n);
        for (uint8_t& x : ins) x = uint8_t(rng());
        b.insert(b.begin() + at, ins.begin(), ins.end());
        break;
      }
      case 3:  // erase a run
        if (!b.empty()) {
          const size_t at = pick(b.size());
          const size_t n = 1 + pick(std::min<size_t>(16, b.size() - at));
          b.erase(b.begin() + at, b.begin() + at + std::min(n, b.size() - at));
        }
        break;
      case 4:  // duplicate a run (lengths and counts past their bounds)
        if (!b.empty() && b.size() < (1u << 16)) {
          const size_t at = pick(b.size());
          const size_t n = 1 + pick(std::min<size_t>(64, b.size() - at));
          Bytes run(b.begin() + at, b.begin() + at + n);
          b.insert(b.begin() + at, run.begin(), run.end());
        }
        break;
      default: {  // splice: our head, another input's tail
        const Bytes& o = corpus[pick(corpus.size())];
        const size_t cut = pick(b.size() + 1), from = pick(o.size() + 1);
        b.resize(cut);
        b.insert(b.end(), o.begin() + from, o.end());
        break;
      }
    }
  }
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (LLVMFuzzerInitialize != nullptr) LLVMFuzzerInitialize(&argc, &argv);
  namespace fs = std::filesystem;
  long mutations = 0;
  uint64_t seed = 1;
  std::vector<fs::path> files;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--mutations=", 12) == 0) {
      mutations = std::strtol(argv[i] + 12, nullptr, 10);
      continue;
    }
    if (std::strncmp(argv[i], "--seed=", 7) == 0) {
      seed = std::strtoull(argv[i] + 7, nullptr, 10);
      continue;
    }
    std::error_code ec;
    if (fs::is_directory(argv[i], ec)) {
      for (const auto& e : fs::directory_iterator(argv[i])) {
        if (e.is_regular_file()) files.push_back(e.path());
      }
    } else if (fs::is_regular_file(argv[i], ec)) {
      files.emplace_back(argv[i]);
    } else {
      std::fprintf(stderr, "%s: cannot read %s\n", argv[0], argv[i]);
      return 2;
    }
  }
  if (files.empty()) {
    std::fprintf(stderr, "%s: no inputs\n", argv[0]);
    return 2;
  }
  std::vector<Bytes> corpus;
  for (const fs::path& p : files) {
    std::ifstream in(p, std::ios::binary);
    corpus.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    RunOne(corpus.back());
  }
  const std::string last = fs::path(argv[0]).filename().string() + ".last-input";
  std::mt19937_64 rng(seed);
  for (long m = 0; m < mutations; ++m) {
    const Bytes b = Mutate(corpus, rng);
    std::ofstream(last, std::ios::binary | std::ios::trunc)
        .write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
    RunOne(b);
  }
  if (mutations > 0) fs::remove(last);
  std::printf("%s: %zu corpus inputs and %ld mutated inputs (seed %llu) ran\n", argv[0],
              corpus.size(), mutations, static_cast<unsigned long long>(seed));
  return 0;
}
