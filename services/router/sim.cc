#include "services/router/sim.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <numeric>
#include <queue>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace tandem::router::sim {

double StepCoefficients::Seconds(int64_t prefill_tokens, int64_t decode_seqs,
                                 int64_t decode_kv_tokens) const {
  const double s = intercept_s + prefill_token_s * static_cast<double>(prefill_tokens) +
                   decode_seq_s * static_cast<double>(decode_seqs) +
                   decode_kv_token_s * static_cast<double>(decode_kv_tokens);
  return std::max(s, 1e-7);  // a step always takes some time: no zero-time loops
}

namespace {

constexpr int kUnavailable = 14;
constexpr int kResourceExhausted = 8;
constexpr int kInvalidArgument = 3;
constexpr int kDeadlineExceeded = 4;

enum class Kind : uint8_t { kDispatch, kWake, kStepDone, kKvArrived, kHeartbeat };

struct Event {
  double t;
  uint64_t seq;  // ties resolve in scheduling order
  Kind kind;
  int32_t a;  // request or worker
  int32_t b;  // the decode worker of a kKvArrived
};

struct Later {
  bool operator()(const Event& x, const Event& y) const {
    return x.t != y.t ? x.t > y.t : x.seq > y.seq;
  }
};

enum class Role { kPrefill, kDecode, kColocated };

struct Seq {
  int32_t req = 0;
  int32_t prompt = 0;
  int32_t done = 0;  // prompt tokens computed
  int32_t left = 0;  // tokens still to generate after the first
  int64_t pos = 0;   // positions in the cache once decoding
  int64_t blocks = 0;
  int32_t take = 0;  // tokens in the step under way
  double last_token_s = 0;
};

struct Worker {
  Role role = Role::kPrefill;
  std::string id;
  std::deque<Seq> waiting;
  std::vector<Seq> running;
  std::vector<int32_t> inbox;  // decode: requests whose KV arrived, adopted between steps
  bool busy = false;
  bool waking = false;  // a kWake is scheduled
  int64_t total_blocks = 0;
  int64_t free_blocks = 0;
  uint64_t steps = 0;
  const StepCoefficients* cost = nullptr;
};

struct InFlight {
  Assignment decode, prefill;
  bool admitted = false;
};

int64_t BlocksFor(int64_t positions, int block_size) {
  return (positions + block_size - 1) / block_size;
}

class Simulation {
 public:
  Simulation(const Options& o, std::span<const Request> requests)
      : o_(o), reqs_(requests), results_(requests.size()), registry_(RegistryOptionsFor(o)) {}

  absl::StatusOr<std::vector<Result>> Run(Stats* stats);

 private:
  RegistryOptions RegistryOptionsFor(const Options& o) {
    RegistryOptions r;
    r.policy = o.router.policy;
    r.lease = absl::Seconds(std::max(3.0, 3 * o.router.heartbeat_s));
    r.clock = [this] { return base_ + absl::Seconds(now_); };
    return r;
  }
  void Schedule(double t, Kind kind, int32_t a, int32_t b = -1) {
    events_.push(Event{t, next_seq_++, kind, a, b});
  }
  void Arrive(int32_t r);
  void Admit(int32_t r);
  void Dispatch(int32_t r);
  // New work for an idle worker: it starts a step once everything else due at this instant
  // has happened, so requests arriving together share the step, as they would on a real worker
  // whose engine thread wakes up to a queue.
  void Kick(int32_t w) {
    Worker& wk = workers_[w];
    if (wk.busy || wk.waking) return;
    wk.waking = true;
    Schedule(now_, Kind::kWake, w);
  }
  // Queues request r's prompt on worker w, holding `blocks` once admitted.
  void Enqueue(int32_t w, int32_t r, int64_t blocks);
  void StartStep(int32_t w);
  void StepDone(int32_t w);
  void KvArrived(int32_t r, int32_t w);
  // The decode worker's engine thread takes an arrived sequence between steps and reports its
  // first token (sampled by the prefill) at once.
  void Adopt(int32_t w, int32_t r);
  void Heartbeat(int32_t w);
  void Token(Seq& s);
  void Finish(int32_t r);
  void Fail(int32_t r, int code, std::string error);
  void EndRequest(int32_t r);
  int32_t WorkerOf(const Assignment& a) const { return index_.at(a.worker_id()); }

  const Options& o_;
  std::span<const Request> reqs_;
  std::vector<Result> results_;
  const absl::Time base_ = absl::FromUnixSeconds(1'000'000'000);
  double now_ = 0;
  WorkerRegistry registry_;
  std::vector<Worker> workers_;
  absl::flat_hash_map<std::string, int32_t> index_;
  std::priority_queue<Event, std::vector<Event>, Later> events_;
  uint64_t next_seq_ = 0;
  absl::flat_hash_map<int32_t, InFlight> inflight_;
  int admitted_ = 0;                          // holding an admission slot
  std::array<std::deque<int32_t>, 3> queue_;  // per class, in arrival order
  size_t queued_ = 0;
  size_t ended_ = 0;
  Stats stats_;
};

void Simulation::Arrive(int32_t r) {
  inflight_[r];
  if (admitted_ < o_.router.max_inflight) {
    Admit(r);
    return;
  }
  const int cls = std::clamp(reqs_[r].priority, 0, 2);
  if (queued_ >= static_cast<size_t>(o_.router.max_queue)) {
    // Full: displace the newest waiter of the least urgent class below this one, if any.
    int victim_cls = -1;
    for (int c = 2; c > cls; --c) {
      if (!queue_[c].empty()) {
        victim_cls = c;
        break;
      }
    }
    if (victim_cls < 0) {
      Fail(r, kResourceExhausted, "router queue full");
      return;
    }
    const int32_t victim = queue_[victim_cls].back();
    queue_[victim_cls].pop_back();
    --queued_;
    Fail(victim, kResourceExhausted, "displaced by a more urgent request");
  }
  queue_[cls].push_back(r);
  ++queued_;
}

void Simulation::Admit(int32_t r) {
  ++admitted_;
  inflight_[r].admitted = true;
  Schedule(now_ + o_.costs.dispatch_s, Kind::kDispatch, r);
}

void Simulation::Dispatch(int32_t r) {
  const Request& q = reqs_[r];
  const Topology& t = o_.topology;
  const int64_t need =
      BlocksFor(static_cast<int64_t>(q.prompt_tokens) + q.output_tokens, t.block_size);
  InFlight& f = inflight_[r];
  switch (registry_.Plan()) {
    case PlanKind::kDisaggregated: {
      absl::flat_hash_set<std::string> refused;
      for (;;) {
        Assignment a = registry_.Pick(Pool::kDecode, need, refused);
        if (!a) {
          Fail(r, refused.empty() ? kUnavailable : kResourceExhausted,
               refused.empty() ? "no decode worker available"
                               : "no decode worker has KV blocks for the request");
          return;
        }
        Worker& d = workers_[WorkerOf(a)];
        if (d.free_blocks >= need) {
          d.free_blocks -= need;
          f.decode = std::move(a);
          break;
        }
        refused.insert(a.worker_id());  // the Reserve RPC answers RESOURCE_EXHAUSTED
      }
      Assignment p = registry_.Pick(Pool::kPrefill, 0);
      if (!p) {
        workers_[WorkerOf(f.decode)].free_blocks += need;
        Fail(r, kUnavailable, "no prefill worker available");
        return;
      }
      p.StartBacklog(q.prompt_tokens);
      const int32_t w = WorkerOf(p);
      f.prefill = std::move(p);
      Enqueue(w, r, BlocksFor(q.prompt_tokens, t.block_size));
      return;
    }
    case PlanKind::kColocated: {
      Assignment c = registry_.Pick(Pool::kColocated, need);
      if (!c) {
        Fail(r, kUnavailable, "no worker available");
        return;
      }
      c.StartBacklog(q.prompt_tokens);
      const int32_t w = WorkerOf(c);
      f.decode = std::move(c);
      Enqueue(w, r, need);
      return;
    }
    case PlanKind::kNone:
      Fail(r, kUnavailable, "no worker available");
      return;
  }
}

void Simulation::Enqueue(int32_t wi, int32_t r, int64_t blocks) {
  const Request& q = reqs_[r];
  Seq s;
  s.req = r;
  s.prompt = q.prompt_tokens;
  s.blocks = blocks;
  s.done = std::clamp(q.cached_tokens, 0, q.prompt_tokens - 1);  // the prefix-cache hit
  workers_[wi].waiting.push_back(s);
  Kick(wi);
}

void Simulation::StartStep(int32_t wi) {
  Worker& w = workers_[wi];
  const Topology& t = o_.topology;
  for (int32_t r : w.inbox) Adopt(wi, r);
  w.inbox.clear();
  // Admission, in arrival order, as each worker's own loop does it.
  while (!w.waiting.empty() && static_cast<int>(w.running.size()) < t.max_seqs) {
    Seq& s = w.waiting.front();
    if (w.role != Role::kDecode) {  // decode's blocks were reserved before the prefill
      if (w.free_blocks < s.blocks) break;
      w.free_blocks -= s.blocks;
    }
    w.running.push_back(s);
    w.waiting.pop_front();
  }
  const int64_t budget = t.max_batch_tokens;
  int64_t used = 0, prefill = 0, decode = 0, kv = 0;
  // Decode tokens first (colocated and decode workers), then prompt chunks in order.
  for (Seq& s : w.running) {
    s.take = 0;
    if (s.done < s.prompt || w.role == Role::kPrefill || used >= budget) continue;
    s.take = 1;
    ++used;
    ++decode;
    kv += s.pos + 1;
  }
  for (Seq& s : w.running) {
    if (s.done >= s.prompt || used >= budget) continue;
    s.take = static_cast<int32_t>(std::min<int64_t>(s.prompt - s.done, budget - used));
    used += s.take;
    prefill += s.take;
  }
  if (used == 0) {
    w.busy = false;
    return;
  }
  w.busy = true;
  ++w.steps;
  ++stats_.steps;
  Schedule(now_ + w.cost->Seconds(prefill, decode, kv), Kind::kStepDone, wi);
}

void Simulation::Token(Seq& s) {
  if (o_.keep_itl) results_[s.req].itl_s.push_back(now_ - s.last_token_s);
  s.last_token_s = now_;
  --s.left;
  ++s.pos;
}

void Simulation::StepDone(int32_t wi) {
  Worker& w = workers_[wi];
  int finished_prompts = 0;
  for (Seq& s : w.running) {
    if (s.take == 0) continue;
    if (s.done < s.prompt) {
      s.done += s.take;
      if (s.done < s.prompt) continue;
      if (w.role == Role::kPrefill) {
        // Done here: the KV finishes arriving at the decode worker, which reports the token.
        w.free_blocks += s.blocks;
        InFlight& f = inflight_[s.req];
        const int32_t d = WorkerOf(f.decode);
        f.prefill.Release();
        Schedule(now_ + o_.costs.transfer_s_per_token * s.prompt, Kind::kKvArrived, s.req, d);
        ++finished_prompts;
        continue;
      }
      // Colocated: the first token, from the prompt's last logits.
      inflight_[s.req].decode.EndBacklog();
      results_[s.req].ttft_s = now_ - reqs_[s.req].arrival_s;
      s.last_token_s = now_;
      s.left = reqs_[s.req].output_tokens - 1;
      s.pos = s.prompt;
    } else {
      Token(s);
    }
    if (s.left <= 0) {
      w.free_blocks += s.blocks;
      Finish(s.req);
    }
  }
  std::erase_if(w.running, [&](const Seq& s) {
    return (w.role == Role::kPrefill && s.done >= s.prompt) ||
           (w.role != Role::kPrefill && s.done >= s.prompt && s.left <= 0);
  });
  if (finished_prompts > 0 && o_.costs.prefill_request_s > 0) {
    // The engine thread finishes those prompts before its next step.
    w.busy = false;
    w.waking = true;
    Schedule(now_ + finished_prompts * o_.costs.prefill_request_s, Kind::kWake, wi);
    return;
  }
  StartStep(wi);
}

void Simulation::KvArrived(int32_t r, int32_t wi) {
  workers_[wi].inbox.push_back(r);
  Kick(wi);
}

void Simulation::Adopt(int32_t wi, int32_t r) {
  Worker& w = workers_[wi];
  const Request& q = reqs_[r];
  Seq s;
  s.req = r;
  s.prompt = q.prompt_tokens;
  s.done = q.prompt_tokens;
  s.pos = q.prompt_tokens;
  s.left = q.output_tokens - 1;
  s.blocks =
      BlocksFor(static_cast<int64_t>(q.prompt_tokens) + q.output_tokens, o_.topology.block_size);
  s.last_token_s = now_;
  results_[r].ttft_s = now_ - q.arrival_s;
  if (s.left <= 0) {
    w.free_blocks += s.blocks;
    Finish(r);
    return;
  }
  w.waiting.push_back(s);
}

void Simulation::Heartbeat(int32_t wi) {
  const Worker& w = workers_[wi];
  v1::HeartbeatRequest h;
  h.set_worker_id(w.id);
  v1::WorkerStats* st = h.mutable_stats();
  st->set_running(static_cast<int32_t>(w.running.size()));
  st->set_waiting(static_cast<int32_t>(w.waiting.size()));
  st->set_kv_blocks_total(w.total_blocks);
  st->set_kv_blocks_free(w.free_blocks);
  v1::StepCost* c = st->mutable_step_cost();
  c->set_intercept_s(w.cost->intercept_s);
  c->set_prefill_token_s(w.cost->prefill_token_s);
  c->set_decode_seq_s(w.cost->decode_seq_s);
  c->set_decode_kv_token_s(w.cost->decode_kv_token_s);
  c->set_steps(w.steps);
  registry_.Heartbeat(h);
  if (ended_ < reqs_.size()) Schedule(now_ + o_.router.heartbeat_s, Kind::kHeartbeat, wi);
}

void Simulation::EndRequest(int32_t r) {
  auto it = inflight_.find(r);
  const bool admitted = it != inflight_.end() && it->second.admitted;
  if (it != inflight_.end()) inflight_.erase(it);  // releases its assignments
  ++ended_;
  if (!admitted) return;
  --admitted_;
  while (admitted_ < o_.router.max_inflight && queued_ > 0) {
    for (auto& q : queue_) {
      if (q.empty()) continue;
      const int32_t next = q.front();
      q.pop_front();
      --queued_;
      Admit(next);
      break;
    }
  }
}

void Simulation::Finish(int32_t r) {
  results_[r].ok = true;
  results_[r].e2e_s = now_ - reqs_[r].arrival_s;
  EndRequest(r);
}

void Simulation::Fail(int32_t r, int code, std::string error) {
  Result& res = results_[r];
  res.ok = false;
  res.status_code = code;
  res.error = std::move(error);
  res.ttft_s = 0;
  res.e2e_s = now_ - reqs_[r].arrival_s;
  res.itl_s.clear();
  EndRequest(r);
}

absl::StatusOr<std::vector<Result>> Simulation::Run(Stats* stats) {
  const Topology& t = o_.topology;
  if (t.prefill < 0 || t.decode < 0 || t.colocated < 0) {
    return absl::InvalidArgumentError("worker counts must be >= 0");
  }
  if (t.max_batch_tokens < 1 || t.max_seqs < 1 || t.block_size < 1 || t.ctx_size < 1) {
    return absl::InvalidArgumentError(
        "max_batch_tokens, max_seqs, block_size and ctx_size must be >= 1");
  }
  if (o_.router.max_inflight < 1 || o_.router.max_queue < 0 || !(o_.router.heartbeat_s > 0)) {
    return absl::InvalidArgumentError(
        "router max_inflight must be >= 1, max_queue >= 0, heartbeat > 0");
  }
  const int64_t blocks =
      t.kv_blocks > 0 ? t.kv_blocks
                      : static_cast<int64_t>(t.max_seqs) * BlocksFor(t.ctx_size, t.block_size);
  auto add = [&](Role role, const char* prefix, int n, const StepCoefficients* cost,
                 v1::WorkerRole wr) -> absl::Status {
    for (int i = 0; i < n; ++i) {
      Worker w;
      w.role = role;
      w.id = absl::StrCat(prefix, i);
      w.total_blocks = w.free_blocks = blocks;
      w.cost = cost;
      v1::RegisterRequest reg;
      reg.set_worker_id(w.id);
      reg.set_address(w.id);
      reg.set_role(wr);
      reg.set_kv_blocks_total(blocks);
      if (absl::Status st = registry_.Register(reg); !st.ok()) return st;
      index_[w.id] = static_cast<int32_t>(workers_.size());
      workers_.push_back(std::move(w));
    }
    return absl::OkStatus();
  };
  if (absl::Status st =
          add(Role::kPrefill, "p", t.prefill, &o_.costs.prefill, v1::WORKER_ROLE_PREFILL);
      !st.ok()) {
    return st;
  }
  if (absl::Status st = add(Role::kDecode, "d", t.decode, &o_.costs.decode, v1::WORKER_ROLE_DECODE);
      !st.ok()) {
    return st;
  }
  if (absl::Status st =
          add(Role::kColocated, "c", t.colocated, &o_.costs.colocated, v1::WORKER_ROLE_BOTH);
      !st.ok()) {
    return st;
  }
  // Heartbeats spread over the first interval, as workers started apart would send them.
  const size_t n_workers = workers_.size();
  for (size_t i = 0; i < n_workers; ++i) {
    Schedule(o_.router.heartbeat_s * static_cast<double>(i) / static_cast<double>(n_workers),
             Kind::kHeartbeat, static_cast<int32_t>(i));
  }
  // Arrivals in time order, fed beside the heap rather than through it.
  std::vector<int32_t> order(reqs_.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return reqs_[a].arrival_s < reqs_[b].arrival_s; });
  const int64_t max_positions = std::min<int64_t>(t.ctx_size, blocks * t.block_size);
  // A request still unfinished a simulated day after the last arrival is stuck (no worker
  // could ever take it): it ends DEADLINE_EXCEEDED rather than keep the heartbeats going.
  const double horizon = (order.empty() ? 0 : reqs_[order.back()].arrival_s) + 86400;
  size_t next = 0;
  while (next < order.size() || !events_.empty()) {
    if (next == order.size() && now_ > horizon) break;
    const bool arrival =
        next < order.size() && (events_.empty() || reqs_[order[next]].arrival_s <= events_.top().t);
    ++stats_.events;
    if (arrival) {
      const int32_t r = order[next++];
      const Request& q = reqs_[r];
      now_ = std::max(now_, q.arrival_s);
      if (q.prompt_tokens < 1 || q.output_tokens < 1 ||
          static_cast<int64_t>(q.prompt_tokens) + q.output_tokens > max_positions) {
        Fail(r, kInvalidArgument,
             absl::StrCat("prompt ", q.prompt_tokens, " + output ", q.output_tokens,
                          " tokens must be >= 1 each and fit ", max_positions, " positions"));
        continue;
      }
      Arrive(r);
      continue;
    }
    const Event e = events_.top();
    events_.pop();
    now_ = e.t;
    switch (e.kind) {
      case Kind::kDispatch:
        Dispatch(e.a);
        break;
      case Kind::kWake:
        workers_[e.a].waking = false;
        if (!workers_[e.a].busy) StartStep(e.a);
        break;
      case Kind::kStepDone:
        StepDone(e.a);
        break;
      case Kind::kKvArrived:
        KvArrived(e.a, e.b);
        break;
      case Kind::kHeartbeat:
        Heartbeat(e.a);
        break;
    }
  }
  std::vector<int32_t> stuck;
  for (const auto& [r, f] : inflight_) stuck.push_back(r);
  std::sort(stuck.begin(), stuck.end());
  for (int32_t r : stuck) Fail(r, kDeadlineExceeded, "not finished a day after the last arrival");
  stats_.end_s = now_;
  if (stats != nullptr) *stats = stats_;
  return std::move(results_);
}

}  // namespace

absl::StatusOr<std::vector<Result>> Simulate(const Options& o, std::span<const Request> requests,
                                             Stats* stats) {
  if (requests.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError("too many requests");
  }
  Simulation s(o, requests);
  return s.Run(stats);
}

}  // namespace tandem::router::sim
