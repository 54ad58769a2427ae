#include "tests/fuzz/fuzz_model.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "tests/fakes/tiny_model.h"

namespace tandem::fuzz {

const router::RouterModel& FuzzModel() {
  static const router::RouterModel* model = [] {
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("tandem-fuzz-model-" + std::to_string(getpid()) + ".gguf"))
                                 .string();
    testing::TinyModelOptions o;
    absl::Status st = testing::WriteTinyModel(o, path);
    if (!st.ok()) {
      std::fprintf(stderr, "fuzz: writing %s: %s\n", path.c_str(), st.ToString().c_str());
      std::abort();
    }
    auto m = router::RouterModel::Load(path, "tiny", 0);
    std::filesystem::remove(path);
    if (!m.ok()) {
      std::fprintf(stderr, "fuzz: loading %s: %s\n", path.c_str(), m.status().ToString().c_str());
      std::abort();
    }
    return m->release();
  }();
  return *model;
}

}  // namespace tandem::fuzz
