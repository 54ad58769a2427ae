// One request followed across the cluster in its traces: `tandem cluster up --trace-dir` starts
// router, kvstore, prefill and decode processes with --trace, a request with a known id goes
// through 1P+1D, the cluster stops, and then:
// - every process left a strict-JSON trace in the Trace Event Format (the form Perfetto and
//   chrome://tracing open), with the fields each phase needs;
// - `tandem trace merge` joins them with a pid per process;
// - the request's spans are in all three services (router Generate and its calls, prefill's
//   Prefill with its compute and KV transfer, decode's Decode and engine steps that name it),
//   and the kvstore served its Lookup;
// - one flow, keyed by the request id, runs router -> prefill -> decode in time order, each of
//   its points inside a slice of the same thread;
// - slices of one thread nest, as Perfetto's JSON importer requires;
// - the router admitted it in the class `tandem client --priority` asked for.
#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/trace/trace.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/fakes/shell_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using tandem::testing::Quote;
using tandem::testing::RunShell;
using tandem::testing::ShellResult;
using tandem::testing::Slurp;

const fs::path kModel = fs::path(TANDEM_SHARED_MODELS_DIR) / "stories260K" / "stories260K.gguf";
const std::string kTandem = std::string(TANDEM_BIN_DIR) + "/tandem";

ShellResult Tandem(const std::string& args) { return RunShell(kTandem + " " + args); }

// The services' logs, for a failure's message: what the router and the workers saw.
std::string Logs(const fs::path& dir) {
  std::string out;
  for (const char* name : {"router", "kvstore", "prefill-0", "decode-0"}) {
    absl::StrAppend(&out, "\n== ", name, ".log\n", Slurp(dir / absl::StrCat(name, ".log")));
  }
  return out;
}

struct Slice {
  int64_t begin, end;
  std::string name;
};

TEST(TraceTest, OneRequestIsFollowedAcrossRouterPrefillAndDecode) {
  if (!fs::exists(kModel)) GTEST_SKIP() << "no model at " << kModel;
  const fs::path root = fs::temp_directory_path() / absl::StrCat("tandem-trace-test-", getpid());
  fs::remove_all(root);
  const fs::path dir = root / "cluster", traces = root / "traces";
  ShellResult up = Tandem(absl::StrCat("cluster up --model ", Quote(kModel.string()), " --dir ",
                                       Quote(dir.string()), " --trace-dir ",
                                       Quote(traces.string()),
                                       " --ctx-size 512 --router-arg=--verbose"));
  ASSERT_EQ(up.exit_code, 0) << up.err;
  const json state = json::parse(Slurp(dir / "cluster.json"));
  // Three full 16-token blocks and more: the prefill worker looks them up in the kvstore.
  const std::string id = "trace-test-request-1";
  ShellResult client = Tandem(absl::StrCat(
      "client --router ", state["router"].get<std::string>(), " --request-id ", id,
      " --priority interactive --max-tokens 12 --prompt ",
      Quote("Once upon a time, there was a little girl named Lily. She loved to play outside in "
            "the sun. One day, she saw a big red ball in the park.")));
  ShellResult down = Tandem(absl::StrCat("cluster down --dir ", Quote(dir.string())));
  ASSERT_EQ(client.exit_code, 0) << client.err << Logs(dir);
  ASSERT_EQ(down.exit_code, 0) << down.err << Logs(dir);

  // Each process closed its file: strict JSON, an array of events.
  std::vector<std::string> files;
  for (const char* name : {"router", "kvstore", "prefill-0", "decode-0"}) {
    const fs::path f = traces / absl::StrCat(name, ".json");
    ASSERT_TRUE(fs::exists(f)) << f;
    const json events = json::parse(Slurp(f), nullptr, false);
    ASSERT_FALSE(events.is_discarded()) << f << " is not strict JSON";
    ASSERT_TRUE(events.is_array()) << f;
    files.push_back(Quote(f.string()));
  }
  const fs::path merged_path = root / "merged.json";
  ShellResult merge = Tandem(absl::StrCat("trace merge ", files[0], " ", files[1], " ", files[2],
                                          " ", files[3], " --out ", Quote(merged_path.string())));
  ASSERT_EQ(merge.exit_code, 0) << merge.err;
  const json merged = json::parse(Slurp(merged_path));
  const json& events = merged.at("traceEvents");

  std::map<int, std::string> process;  // pid -> process name
  for (const json& e : events) {
    if (e.at("ph") == "M" && e.at("name") == "process_name") {
      process[e.at("pid").get<int>()] = e.at("args").at("name");
    }
  }
  ASSERT_EQ(process.size(), 4u);
  std::set<std::string> names;
  for (const auto& [pid, name] : process) names.insert(name);
  EXPECT_EQ(names, (std::set<std::string>{"tandem-router", "tandem-kvstore", "tandem-prefill",
                                          "tandem-decode"}));

  // What each phase needs, and the request's events by process.
  std::map<std::string, std::multiset<std::string>> of_request;  // process -> names
  std::map<std::tuple<int, int>, std::vector<Slice>> slices;     // (pid, tid) -> X slices
  std::map<std::string, std::multiset<std::string>> all;         // process -> names
  struct FlowPoint {
    std::string phase, process;
    int pid, tid;
    int64_t ts;
  };
  std::vector<FlowPoint> flow;
  int steps_naming_it = 0;
  std::string admitted_as;  // the class the router admitted it in
  const uint64_t flow_id = tandem::trace::FlowId(id);
  for (const json& e : events) {
    ASSERT_TRUE(e.contains("name") && e.contains("ph") && e.contains("pid") && e.contains("tid"))
        << e;
    const std::string ph = e.at("ph");
    const std::string proc = process[e.at("pid").get<int>()];
    if (ph != "M") ASSERT_TRUE(e.contains("ts") && e.at("ts").is_number_integer()) << e;
    all[proc].insert(e.at("name").get<std::string>());
    if (ph == "X") {
      ASSERT_TRUE(e.contains("dur") && e.at("dur").get<int64_t>() >= 1) << e;
      const int64_t ts = e.at("ts");
      slices[{e.at("pid").get<int>(), e.at("tid").get<int>()}].push_back(
          {ts, ts + e.at("dur").get<int64_t>(), e.at("name")});
    }
    if ((ph == "b" || ph == "e") && !e.contains("id")) ADD_FAILURE() << "async without id: " << e;
    const json args = e.value("args", json::object());
    if (args.value("request_id", std::string()) == id) {
      of_request[proc].insert(e.at("name"));
      if (e.at("name") == "admission") admitted_as = args.value("priority", std::string());
    }
    if (ph == "X" && e.at("name") == "step" && args.contains("requests")) {
      const auto& r = args.at("requests");
      if (std::find(r.begin(), r.end(), id) != r.end() && proc == "tandem-decode") {
        ++steps_naming_it;
      }
    }
    if ((ph == "s" || ph == "t" || ph == "f") && e.at("id").get<uint64_t>() == flow_id) {
      flow.push_back({ph, proc, e.at("pid"), e.at("tid"), e.at("ts")});
    }
  }
  auto has = [&](const std::string& proc, const std::string& name) {
    return of_request[proc].contains(name);
  };
  for (const char* n : {"Generate", "admission", "call Reserve", "call Prefill", "call Decode"}) {
    EXPECT_TRUE(has("tandem-router", n)) << "router: " << n;
  }
  for (const char* n : {"Prefill", "kvstore Lookup", "queued", "compute", "kv_transfer"}) {
    EXPECT_TRUE(has("tandem-prefill", n)) << "prefill: " << n;
  }
  for (const char* n : {"Reserve", "Decode"}) EXPECT_TRUE(has("tandem-decode", n)) << n;
  EXPECT_EQ(admitted_as, "interactive") << "tandem client --priority reaches the admission queue";
  // 12 tokens: the first came from prefill, the others from decode steps that carried it.
  EXPECT_GE(steps_naming_it, 11);
  EXPECT_TRUE(all["tandem-kvstore"].contains("Lookup"));
  EXPECT_TRUE(all["tandem-prefill"].contains("step"));

  // The flow: router -> prefill -> decode, in time order, each point inside a slice of its
  // thread.
  std::sort(flow.begin(), flow.end(), [](const auto& a, const auto& b) { return a.ts < b.ts; });
  ASSERT_EQ(flow.size(), 3u);
  EXPECT_EQ(flow[0].phase + flow[0].process, "standem-router");
  EXPECT_EQ(flow[1].phase + flow[1].process, "ttandem-prefill");
  EXPECT_EQ(flow[2].phase + flow[2].process, "ftandem-decode");
  for (const FlowPoint& p : flow) {
    const std::vector<Slice>& on = slices[{p.pid, p.tid}];
    EXPECT_TRUE(std::any_of(on.begin(), on.end(),
                            [&](const Slice& s) { return s.begin <= p.ts && p.ts < s.end; }))
        << p.phase << " in " << p.process << " at " << p.ts << " lies in no slice of its thread";
  }

  // Slices of one thread nest: sorted by start (longest first on ties), each one either lies
  // inside the enclosing open slice or starts after it ends.
  for (auto& [track, list] : slices) {
    std::sort(list.begin(), list.end(), [](const Slice& a, const Slice& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end > b.end;
    });
    std::vector<Slice> open;
    for (const Slice& s : list) {
      while (!open.empty() && open.back().end <= s.begin) open.pop_back();
      if (!open.empty()) {
        EXPECT_LE(s.end, open.back().end)
            << s.name << " overlaps " << open.back().name << " on pid " << std::get<0>(track)
            << " tid " << std::get<1>(track);
      }
      open.push_back(s);
    }
  }
  fs::remove_all(root);
}

}  // namespace
