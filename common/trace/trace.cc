#include "common/trace/trace.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "xxhash.h"

#if TANDEM_HAVE_NVTX
#include "nvtx3/nvToolsExt.h"
#endif

namespace tandem::trace {
namespace {

using json = nlohmann::json;

int ThreadId() { return static_cast<int>(syscall(SYS_gettid)); }

// Flushed at most this often, so a killed process loses about this much.
constexpr int64_t kFlushEveryUs = 1'000'000;

}  // namespace

uint64_t FlowId(std::string_view request_id) {
  // 53 bits: the ids are JSON numbers, exact in every JSON reader.
  return XXH64(request_id.data(), request_id.size(), 0) & ((uint64_t{1} << 53) - 1);
}

absl::StatusOr<std::unique_ptr<Tracer>> Tracer::Create(const TracerOptions& o) {
  if (o.path.empty()) return absl::InvalidArgumentError("--trace needs a file path");
  if (o.max_bytes <= 0) return absl::InvalidArgumentError("the trace size limit must be positive");
  std::FILE* f = std::fopen(o.path.c_str(), "w");
  if (f == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write the trace file ", o.path, ": ", std::strerror(errno)));
  }
  std::unique_ptr<Tracer> t(new Tracer(o, f));
  {
    absl::MutexLock l(&t->mu_);
    std::fputs("[\n", f);
  }
  t->Write({{"name", "process_name"},
            {"ph", "M"},
            {"pid", t->pid_},
            {"tid", 0},
            {"args", {{"name", o.process_name}}}});
  return t;
}

Tracer::Tracer(const TracerOptions& o, std::FILE* f) : o_(o), pid_(getpid()), f_(f) {
  last_flush_us_ = NowMicros();
}

Tracer::~Tracer() { Close(); }

int64_t Tracer::NowMicros() { return absl::ToUnixMicros(absl::Now()); }

namespace {

// Request ids and status messages come from clients and may hold any bytes: invalid UTF-8 is
// written as U+FFFD rather than thrown, which would take the service down.
std::string Dump(const json& ev) {
  return ev.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace

void Tracer::Write(json ev) {
  std::string line = Dump(ev);
  absl::MutexLock l(&mu_);
  if (f_ == nullptr) return;
  if (bytes_ + static_cast<int64_t>(line.size()) > o_.max_bytes) {
    ++dropped_;
    return;
  }
  line += ",\n";
  std::fwrite(line.data(), 1, line.size(), f_);
  bytes_ += static_cast<int64_t>(line.size());
  ++events_;
  const int64_t now = NowMicros();
  if (now - last_flush_us_ >= kFlushEveryUs) {
    std::fflush(f_);
    last_flush_us_ = now;
  }
}

int64_t RequestTrack(std::string_view request_id) {
  // Above every Linux tid (pid_max is at most 2^22), within a JSON viewer's int32.
  return (int64_t{1} << 30) + static_cast<int64_t>(FlowId(request_id) % (uint64_t{1} << 30));
}

void Tracer::Complete(std::string_view name, std::string_view cat, int64_t start_us,
                      int64_t end_us, json args, int64_t track) {
  Write({{"name", name},
         {"cat", cat},
         {"ph", "X"},
         {"ts", start_us},
         {"dur", std::max<int64_t>(1, end_us - start_us)},
         {"pid", pid_},
         {"tid", track != 0 ? track : ThreadId()},
         {"args", std::move(args)}});
}

void Tracer::Async(std::string_view name, std::string_view cat, std::string_view request_id,
                   int64_t start_us, int64_t end_us, json args) {
  const uint64_t id = FlowId(request_id);
  args["request_id"] = request_id;
  Write({{"name", name}, {"cat", cat},      {"ph", "b"},          {"ts", start_us},
         {"id", id},     {"pid", pid_},     {"tid", ThreadId()},  {"args", std::move(args)}});
  Write({{"name", name}, {"cat", cat},  {"ph", "e"},          {"ts", std::max(end_us, start_us + 1)},
         {"id", id},     {"pid", pid_}, {"tid", ThreadId()}});
}

void Tracer::Flow(char phase, std::string_view request_id, int64_t ts_us, int64_t track) {
  json ev = {{"name", "request"},
             {"cat", "request"},
             {"ph", std::string(1, phase)},
             {"ts", ts_us},
             {"id", FlowId(request_id)},
             {"pid", pid_},
             {"tid", track != 0 ? track : ThreadId()}};
  if (phase == 'f') ev["bp"] = "e";  // bound to the slice enclosing ts, not the next one
  Write(std::move(ev));
}

void Tracer::NameThread(std::string_view name, int64_t track) {
  Write({{"name", "thread_name"},
         {"ph", "M"},
         {"pid", pid_},
         {"tid", track != 0 ? track : ThreadId()},
         {"args", {{"name", name}}}});
}

void Tracer::Close() {
  absl::MutexLock l(&mu_);
  if (f_ == nullptr) return;
  // The last event closes the array: it says how many were dropped at the size limit.
  const json last = {{"name", "trace_end"},
                     {"ph", "i"},
                     {"s", "p"},
                     {"ts", NowMicros()},
                     {"pid", pid_},
                     {"tid", ThreadId()},
                     {"args", {{"events", events_}, {"dropped_at_size_limit", dropped_}}}};
  const std::string tail = Dump(last) + "\n]\n";
  std::fwrite(tail.data(), 1, tail.size(), f_);
  std::fclose(f_);
  f_ = nullptr;
}

int64_t Tracer::events() const {
  absl::MutexLock l(&mu_);
  return events_;
}

int64_t Tracer::dropped() const {
  absl::MutexLock l(&mu_);
  return dropped_;
}

NvtxRange::NvtxRange(const char* name) {
#if TANDEM_HAVE_NVTX
  id_ = nvtxRangeStartA(name);
#else
  (void)name;
#endif
}

NvtxRange::~NvtxRange() {
#if TANDEM_HAVE_NVTX
  nvtxRangeEnd(id_);
#endif
}

Span::Span(Tracer* t, std::string_view name, std::string_view cat, std::string_view request_id,
           int64_t track)
    : t_(t), name_(name), nvtx_(name_.c_str()), track_(track) {
  if (t_ == nullptr) return;
  cat_ = cat;
  request_id_ = request_id;
  start_us_ = Tracer::NowMicros();
  args_ = json::object();
  if (!request_id_.empty()) args_["request_id"] = request_id_;
}

Span::~Span() {
  if (t_ == nullptr) return;
  t_->Complete(name_, cat_, start_us_, Tracer::NowMicros(), std::move(args_), track_);
}

void Span::Arg(std::string_view key, json value) {
  if (t_ != nullptr) args_[std::string(key)] = std::move(value);
}

void Span::Flow(char phase) {
  if (t_ != nullptr && !request_id_.empty()) t_->Flow(phase, request_id_, start_us_, track_);
}

absl::StatusOr<json> ReadEvents(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read the trace ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  json parsed = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    // Cut short: keep the complete lines (one event each) and close the array.
    const size_t open = text.find('[');
    if (open == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON trace"));
    }
    std::string repaired = "[";
    std::istringstream lines(text.substr(open + 1));
    for (std::string line; std::getline(lines, line);) {
      while (!line.empty() && (line.back() == ',' || line.back() == ' ')) line.pop_back();
      if (line.empty() || line == "]") continue;
      if (json::parse(line, nullptr, false).is_discarded()) break;  // the partly written one
      if (repaired.size() > 1) repaired += ",";
      repaired += line;
    }
    repaired += "]";
    parsed = json::parse(repaired, nullptr, false);
  }
  if (parsed.is_object() && parsed.contains("traceEvents")) parsed = parsed["traceEvents"];
  if (!parsed.is_array()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON trace"));
  }
  return parsed;
}

absl::Status MergeTraces(const std::vector<std::string>& inputs, const std::string& out) {
  if (inputs.empty()) return absl::InvalidArgumentError("no traces to merge");
  json events = json::array();
  int64_t next_pid = 1;
  for (const std::string& in : inputs) {
    absl::StatusOr<json> evs = ReadEvents(in);
    if (!evs.ok()) return evs.status();
    std::map<int64_t, int64_t> pids;
    for (json& ev : *evs) {
      if (!ev.is_object()) continue;
      const int64_t pid = ev.value("pid", int64_t{0});
      auto [it, added] = pids.emplace(pid, next_pid);
      if (added) ++next_pid;
      ev["pid"] = it->second;
      events.push_back(std::move(ev));
    }
  }
  std::ofstream f(out, std::ios::trunc);
  f << json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump() << "\n";
  f.close();
  if (!f) return absl::PermissionDeniedError(absl::StrCat("cannot write ", out));
  return absl::OkStatus();
}

}  // namespace tandem::trace
