// Chrome/Perfetto JSON traces of a service's work: engine steps, KV transfers and RPCs.
//
// A Tracer writes one file in the Trace Event Format's JSON array form, an event per line, so
// ui.perfetto.dev (and chrome://tracing) open it as is. Every event that concerns one request
// carries its id in args.request_id, and the RPC spans of the router, the prefill worker and
// the decode worker are chained by flow events whose id is derived from the request id, so one
// request can be followed across processes once their files are merged
// (`tandem trace merge`, which also gives each file its own pid).
//
// Timestamps are wall-clock microseconds, so the files of services on one host line up (across
// hosts they are as good as the clocks' synchronisation).
//
// The file is valid JSON after Close(). A process killed before that leaves a file without its
// closing bracket, which the trace format allows and `tandem trace merge` repairs; events still
// in the write buffer (at most about a second's) are lost.
//
// Thread-safety: every method may be called from any thread. Services take a Tracer* in their
// options; null means tracing is off and costs a pointer test.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nlohmann/json.hpp"

namespace tandem::trace {

struct TracerOptions {
  std::string path;
  std::string process_name;  // names the process's track: tandem-router, tandem-prefill ...
  // Past this many bytes later events are dropped (counted in a last event), so a trace left
  // on in production cannot fill the disk.
  int64_t max_bytes = int64_t{512} << 20;
};

// Flow id of a request: the same in every process that sees the request id.
uint64_t FlowId(std::string_view request_id);

// A track (a tid no thread has) of the request's own, for code that serves many requests on
// few threads, each request hopping between them (the router's tasks): its slices nest on
// that track as they could not on any one thread. 0 is "the calling thread" below.
int64_t RequestTrack(std::string_view request_id);

class Tracer {
 public:
  static absl::StatusOr<std::unique_ptr<Tracer>> Create(const TracerOptions& o);
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  static int64_t NowMicros();

  // A slice [start_us, end_us) on the calling thread, or on `track` (RequestTrack). Slices of
  // one thread or track must nest.
  void Complete(std::string_view name, std::string_view cat, int64_t start_us, int64_t end_us,
                nlohmann::json args = nlohmann::json::object(), int64_t track = 0);
  // A slice on a track of its own per (cat, request id): for work that overlaps other requests'
  // on no one thread, such as a KV transfer completed by transport callbacks.
  void Async(std::string_view name, std::string_view cat, std::string_view request_id,
             int64_t start_us, int64_t end_us, nlohmann::json args = nlohmann::json::object());
  // One step of the request's flow at ts_us on the calling thread, bound to the slice that
  // encloses it there: 's' starts the flow, 't' continues it, 'f' ends it.
  void Flow(char phase, std::string_view request_id, int64_t ts_us, int64_t track = 0);
  // Names the calling thread's track, or `track`.
  void NameThread(std::string_view name, int64_t track = 0);

  // Writes the closing bracket; later events are dropped. Also run by the destructor.
  void Close();

  int64_t events() const;
  int64_t dropped() const;

 private:
  explicit Tracer(const TracerOptions& o, std::FILE* f);
  void Write(nlohmann::json ev);

  const TracerOptions o_;
  const int pid_;
  mutable absl::Mutex mu_;
  std::FILE* f_ ABSL_GUARDED_BY(mu_);
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t events_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t last_flush_us_ ABSL_GUARDED_BY(mu_) = 0;
};

// An NVTX range for its lifetime, for Nsight Systems, in builds with the CUDA toolkit; nothing
// otherwise. A start/end range, not a push/pop one: it may end on another thread than it began
// (a router task resumes wherever its RPC completed). Without a profiler attached NVTX calls return at once.
class NvtxRange {
 public:
  explicit NvtxRange(const char* name);
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  uint64_t id_ = 0;  // nvtxRangeId_t
};

// A slice on the calling thread (or on `track`, RequestTrack) from construction to
// destruction; nothing when the tracer is null. It is also an NVTX range of the same name
// (NvtxRange), traced or not.
class Span {
 public:
  Span(Tracer* t, std::string_view name, std::string_view cat, std::string_view request_id = {},
       int64_t track = 0);
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  bool on() const { return t_ != nullptr; }
  // Adds to the slice's args (shown when it is selected).
  void Arg(std::string_view key, nlohmann::json value);
  // A flow step at the slice's start (see Tracer::Flow).
  void Flow(char phase);

 private:
  Tracer* const t_;
  std::string name_;
  NvtxRange nvtx_;
  std::string cat_, request_id_;
  int64_t start_us_ = 0;
  int64_t track_ = 0;
  nlohmann::json args_;
};

// Reads a trace this library wrote, including one cut short by a crash (no closing bracket,
// a partly written last line), and returns its events.
absl::StatusOr<nlohmann::json> ReadEvents(const std::string& path);

// Writes the events of every input into one trace at `out` (the JSON object form), giving each
// input process a pid of its own: pods often all run as pid 1.
absl::Status MergeTraces(const std::vector<std::string>& inputs, const std::string& out);

}  // namespace tandem::trace
