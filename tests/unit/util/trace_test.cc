// The Chrome/Perfetto trace writer (common/trace/trace.h): the file it leaves is strict JSON in
// the Trace Event Format, its slices nest per thread, a file cut short by a crash is still read
// (and merged), the size limit drops and counts, and merging gives each process its own pid.
#include "common/trace/trace.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace tandem::trace {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path TempPath(const std::string& name) {
  return fs::temp_directory_path() / (std::to_string(getpid()) + "-" + name);
}

std::string Slurp(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::unique_ptr<Tracer> Open(const fs::path& path, int64_t max_bytes = int64_t{1} << 20) {
  TracerOptions o;
  o.path = path.string();
  o.process_name = "tandem-test";
  o.max_bytes = max_bytes;
  absl::StatusOr<std::unique_ptr<Tracer>> t = Tracer::Create(o);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(TraceTest, ClosedFileIsStrictJsonWithEveryRequiredField) {
  const fs::path path = TempPath("closed.json");
  {
    std::unique_ptr<Tracer> t = Open(path);
    ASSERT_NE(t, nullptr);
    t->NameThread("main");
    {
      Span outer(t.get(), "Generate", "rpc", "req-1");
      outer.Flow('s');
      outer.Arg("prompt_tokens", 12);
      { Span inner(t.get(), "call \"Prefill\"", "rpc", "req-1"); }  // a name that needs escaping
    }
    t->Async("kv_transfer", "kv", "req-1", 100, 250, {{"bytes", 4096}});
    std::thread other([&] { Span s(t.get(), "step", "engine"); });
    other.join();
  }
  const json events = json::parse(Slurp(path));  // throws on anything but strict JSON
  ASSERT_TRUE(events.is_array());
  std::set<std::string> names;
  std::set<int64_t> tids;
  for (const json& e : events) {
    ASSERT_TRUE(e.contains("name") && e.contains("ph") && e.contains("pid") && e.contains("tid"))
        << e;
    names.insert(e["name"].get<std::string>());
    const std::string ph = e["ph"];
    if (ph != "M") {
      ASSERT_TRUE(e["ts"].is_number_integer()) << e;
    }
    if (ph == "X") {
      ASSERT_GE(e["dur"].get<int64_t>(), 1) << e;
      tids.insert(e["tid"].get<int64_t>());
    }
    EXPECT_EQ(e["pid"].get<int>(), getpid());
  }
  EXPECT_TRUE(names.contains("process_name"));
  EXPECT_TRUE(names.contains("thread_name"));
  EXPECT_TRUE(names.contains("Generate"));
  EXPECT_TRUE(names.contains("call \"Prefill\""));
  EXPECT_TRUE(names.contains("trace_end"));
  EXPECT_EQ(tids.size(), 2u) << "the other thread's slice is on its own track";
  // The inner slice nests in the outer one; the flow starts inside the outer one.
  json outer, inner, flow, b, e;
  for (const json& ev : events) {
    if (ev["name"] == "Generate") outer = ev;
    if (ev["name"] == "call \"Prefill\"") inner = ev;
    if (ev["ph"] == "s") flow = ev;
    if (ev["ph"] == "b") b = ev;
    if (ev["ph"] == "e") e = ev;
  }
  EXPECT_EQ(outer["args"]["request_id"], "req-1");
  EXPECT_EQ(outer["args"]["prompt_tokens"], 12);
  EXPECT_GE(inner["ts"].get<int64_t>(), outer["ts"].get<int64_t>());
  EXPECT_LE(inner["ts"].get<int64_t>() + inner["dur"].get<int64_t>(),
            outer["ts"].get<int64_t>() + outer["dur"].get<int64_t>());
  EXPECT_EQ(flow["ts"], outer["ts"]);
  EXPECT_EQ(flow["tid"], outer["tid"]);
  EXPECT_EQ(flow["id"].get<uint64_t>(), FlowId("req-1"));
  EXPECT_EQ(b["id"], e["id"]);
  EXPECT_EQ(b["ts"], 100);
  EXPECT_EQ(e["ts"], 250);
  EXPECT_EQ(b["args"]["request_id"], "req-1");
  fs::remove(path);
}

TEST(TraceTest, FlowIdsAgreeAcrossProcessesAndAreExactJsonNumbers) {
  EXPECT_EQ(FlowId("abc"), FlowId(std::string("abc")));
  EXPECT_NE(FlowId("abc"), FlowId("abd"));
  for (const char* id : {"a", "request-1", "0123456789abcdef0123456789abcdef"}) {
    EXPECT_LT(FlowId(id), uint64_t{1} << 53) << id;
  }
}

TEST(TraceTest, FileCutShortByACrashIsStillRead) {
  const fs::path path = TempPath("cut.json");
  std::string whole;
  {
    std::unique_ptr<Tracer> t = Open(path);
    ASSERT_NE(t, nullptr);
    for (int i = 0; i < 5; ++i) t->Complete("step", "engine", 10 * i, 10 * i + 5);
  }
  whole = Slurp(path);
  // What a SIGKILL can leave: no closing bracket and half of the last event's line.
  const size_t last = whole.rfind("{\"args\"");
  ASSERT_NE(last, std::string::npos);
  {
    std::ofstream f(path, std::ios::trunc);
    f << whole.substr(0, last + 20);
  }
  ASSERT_TRUE(json::parse(Slurp(path), nullptr, false).is_discarded());
  absl::StatusOr<json> events = ReadEvents(path.string());
  ASSERT_TRUE(events.ok()) << events.status();
  int steps = 0;
  for (const json& e : *events) steps += e["name"] == "step";
  EXPECT_EQ(steps, 5);
  fs::remove(path);
}

TEST(TraceTest, SizeLimitDropsLaterEventsAndSaysHowMany) {
  const fs::path path = TempPath("limit.json");
  int64_t written = 0, dropped = 0;
  {
    std::unique_ptr<Tracer> t = Open(path, 4096);
    ASSERT_NE(t, nullptr);
    for (int i = 0; i < 200; ++i) t->Complete("step", "engine", i, i + 1, {{"i", i}});
    written = t->events();
    dropped = t->dropped();
  }
  EXPECT_GT(written, 5);
  EXPECT_GT(dropped, 0);
  EXPECT_EQ(written + dropped, 201);  // the process name too
  EXPECT_LE(fs::file_size(path), 4096u + 512u);
  const json events = json::parse(Slurp(path));
  EXPECT_EQ(events.back()["name"], "trace_end");
  EXPECT_EQ(events.back()["args"]["dropped_at_size_limit"], dropped);
  fs::remove(path);
}

TEST(TraceTest, MergeGivesEachFileItsOwnPid) {
  // Two processes that both ran as the same pid, as pods do.
  const fs::path a = TempPath("a.json"), b = TempPath("b.json"), out = TempPath("merged.json");
  for (const fs::path& p : {a, b}) {
    std::unique_ptr<Tracer> t = Open(p);
    ASSERT_NE(t, nullptr);
    t->Complete("Generate", "rpc", 1, 2, {{"request_id", "r"}});
  }
  {
    // One of them killed: its file is cut short.
    std::string text = Slurp(b);
    std::ofstream f(b, std::ios::trunc);
    f << text.substr(0, text.rfind("{\"args\""));
  }
  ASSERT_TRUE(MergeTraces({a.string(), b.string()}, out.string()).ok());
  const json merged = json::parse(Slurp(out));
  std::set<int> pids;
  int slices = 0;
  for (const json& e : merged["traceEvents"]) {
    pids.insert(e["pid"].get<int>());
    slices += e["name"] == "Generate";
  }
  EXPECT_EQ(pids, (std::set<int>{1, 2}));
  EXPECT_EQ(slices, 2);
  EXPECT_FALSE(MergeTraces({a.string(), (a.string() + ".missing")}, out.string()).ok());
  EXPECT_FALSE(MergeTraces({}, out.string()).ok());
  for (const fs::path& p : {a, b, out}) fs::remove(p);
}

TEST(TraceTest, UnwritablePathIsARefusalNotACrash) {
  TracerOptions o;
  o.path = "/nonexistent-dir/trace.json";
  o.process_name = "x";
  absl::StatusOr<std::unique_ptr<Tracer>> t = Tracer::Create(o);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kFailedPrecondition);
  o.path = "";
  EXPECT_EQ(Tracer::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// A client chooses the request id, and gRPC does not check that it is UTF-8: a traced service
// writes such an id (replaced, not thrown) and the file stays strict JSON.
TEST(TraceTest, RequestIdThatIsNotUtf8IsWrittenNotThrown) {
  const fs::path path = TempPath("not-utf8.json");
  const std::string id = std::string("req-\xff\xfe-") + char(0xc3);  // bad bytes, cut sequence
  {
    std::unique_ptr<Tracer> t = Open(path);
    ASSERT_NE(t, nullptr);
    {
      Span s(t.get(), "Decode", "rpc", id);
      s.Flow('f');
      s.Arg("status", "INVALID_ARGUMENT: \x80");
    }
    t->Async("kv_transfer", "kv", id, 10, 20);
    EXPECT_EQ(t->events(), 5);  // process name, flow, slice, async begin and end
  }
  const json events = json::parse(Slurp(path), nullptr, false);
  ASSERT_FALSE(events.is_discarded());
  int with_id = 0;
  for (const json& e : events) {
    if (e.contains("args") && e["args"].contains("request_id")) {
      EXPECT_EQ(e["args"]["request_id"], "req-\uFFFD\uFFFD-\uFFFD") << e;
      ++with_id;
    }
  }
  EXPECT_EQ(with_id, 2);  // the slice and the async begin
  fs::remove(path);
}

TEST(TraceTest, NullTracerSpansDoNothing) {
  Span s(nullptr, "x", "y", "z");
  s.Arg("k", 1);
  s.Flow('s');
  EXPECT_FALSE(s.on());
}

}  // namespace
}  // namespace tandem::trace
