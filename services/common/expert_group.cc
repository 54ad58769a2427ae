#include "services/common/expert_group.h"

#include <immintrin.h>
#include <sched.h>
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/model/model.h"
#include "services/common/grpc_status.h"
#include "services/common/process_util.h"
#include "services/common/tls.h"
#include "services/common/transport_factory.h"
#include "services/common/worker_main.h"

namespace tandem::services {
namespace {

// The inbox: [0, 8) doorbell; kHeader: InboxHeader; kTable: the group table (expert ids, then
// row counts); the input rows from InboxRowsOffset. A result slice: [0, 8) doorbell; kHeader:
// ResultHeader; the output rows from kResultRows.
constexpr uint64_t kHeader = 64;
constexpr uint64_t kTable = 128;
constexpr uint64_t kResultRows = 256;
constexpr size_t kMessageBytes = 120;

struct InboxHeader {
  uint64_t seq;
  int32_t layer;
  int32_t groups;
  int64_t rows;
  int32_t same_input;
  int32_t pad;
};

struct ResultHeader {
  uint64_t seq;
  int32_t code;  // absl::StatusCode of the rank's answer
  int32_t pad;
  int64_t rows;
  char message[kMessageBytes];  // the error, NUL-terminated
};
static_assert(kHeader + sizeof(ResultHeader) <= kResultRows);

uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

uint64_t InboxRowsOffset(int32_t n_expert) {
  return AlignUp(kTable + uint64_t(n_expert) * (sizeof(int32_t) + sizeof(int64_t)), 64);
}
uint64_t InboxBytes(int32_t n_expert, int64_t capacity_rows, int32_t n_embd) {
  return AlignUp(InboxRowsOffset(n_expert) + uint64_t(capacity_rows) * n_embd * sizeof(float),
                 4096);
}
uint64_t SliceBytes(int64_t capacity_rows, int32_t n_embd) {
  return AlignUp(kResultRows + uint64_t(capacity_rows) * n_embd * sizeof(float), 4096);
}

uint64_t Sequence(uint32_t session, uint64_t counter) {
  return (uint64_t{session} << 32) | (counter & 0xffffffffu);
}

// Waits until `done()`; spins for the first ~50 us (an answer inside one layer's time comes
// back while spinning), then yields, then sleeps in steps growing to 1 ms. False when `give_up()`
// said so first.
template <typename Done, typename GiveUp>
bool AwaitDoorbell(Done done, GiveUp give_up) {
  const absl::Time start = absl::Now();
  absl::Duration nap = absl::Microseconds(20);
  for (int spin = 0;; ++spin) {
    if (done()) return true;
    if (spin < 2000) {
      _mm_pause();
      continue;
    }
    if (give_up()) return false;
    if (absl::Now() - start < absl::Microseconds(300)) {
      sched_yield();
      continue;
    }
    absl::SleepFor(nap);
    nap = std::min(nap * 2, absl::Milliseconds(1));
  }
}

uint64_t LoadAcquire(const uint8_t* p) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(p), __ATOMIC_ACQUIRE);
}

// Memory peers can write into: the transport's own (shared memory) where it has one.
struct Region {
  uint8_t* base = nullptr;
  transfer::RegionDescriptor desc;
  std::unique_ptr<uint8_t, void (*)(void*)> owned{nullptr, nullptr};
};
absl::StatusOr<Region> MakeRegion(transfer::KvTransport* t, uint64_t bytes) {
  Region r;
  absl::StatusOr<transfer::AllocatedRegion> a = t->AllocateRegion(bytes);
  if (a.ok()) {
    r.base = static_cast<uint8_t*>(a->base);
    r.desc = a->descriptor;
    std::memset(r.base, 0, bytes);
    return r;
  }
  if (a.status().code() != absl::StatusCode::kUnimplemented) return a.status();
  r.owned = {static_cast<uint8_t*>(std::aligned_alloc(4096, bytes)), std::free};
  if (r.owned == nullptr) return absl::ResourceExhaustedError("cannot allocate an EP region");
  r.base = r.owned.get();
  std::memset(r.base, 0, bytes);
  absl::StatusOr<transfer::RegionDescriptor> d = t->RegisterRegion(r.base, bytes);
  if (!d.ok()) return d.status();
  r.desc = *d;
  return r;
}

bool SamePlacement(const engine::ExpertPlacement& a, const std::string& json, int32_t n_layer,
                   int32_t n_expert, int32_t ranks) {
  nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return false;
  absl::StatusOr<engine::ExpertPlacement> b =
      engine::ExpertPlacement::FromJson(j, n_layer, n_expert, ranks);
  return b.ok() && b->layers == a.layers;
}

}  // namespace

ExpertGroup::ExpertGroup(ExpertGroupOptions o) : o_(std::move(o)), holders_(o_.placement) {}

absl::StatusOr<std::unique_ptr<ExpertGroup>> ExpertGroup::Create(ExpertGroupOptions o) {
  if (o.placement.ranks < 2 || o.transport == nullptr || o.model == nullptr) {
    return absl::InvalidArgumentError("an expert group needs 2 or more ranks and a transport");
  }
  std::unique_ptr<ExpertGroup> g(new ExpertGroup(std::move(o)));
  const int32_t n_embd = g->o_.model->config().n_embd;
  g->slice_bytes_ = SliceBytes(g->o_.capacity_rows, n_embd);
  absl::StatusOr<Region> r =
      MakeRegion(g->o_.transport, g->slice_bytes_ * uint64_t(g->o_.placement.ranks - 1));
  if (!r.ok()) return r.status();
  g->results_ = r->base;
  g->results_desc_ = r->desc;
  g->results_region_ = r->desc.region_id;
  g->owned_results_ = std::move(r->owned);
  for (int32_t i = 0; i < g->o_.placement.ranks; ++i) g->ranks_.push_back(std::make_unique<Rank>());
  return g;
}

ExpertGroup::~ExpertGroup() {
  Shutdown();
  (void)o_.transport->DeregisterRegion(results_region_);
}

bool ExpertGroup::complete() const {
  absl::MutexLock l(&mu_);
  for (size_t r = 1; r < ranks_.size(); ++r) {
    if (!ranks_[r]->in) return false;
  }
  return true;
}

void ExpertGroup::Shutdown() {
  absl::MutexLock l(&mu_);
  shutdown_ = true;
}

void ExpertGroup::Drop(int32_t rank, uint32_t session, const absl::Status& why) {
  absl::MutexLock l(&mu_);
  Rank& r = *ranks_[rank];
  if (!r.in || r.session != session) return;
  r.in = false;
  r.alive = false;
  r.dropped = why;
  std::fprintf(stderr, "%s: expert rank %d dropped from the group: %s\n", o_.worker_id.c_str(),
               rank, why.ToString().c_str());
}

absl::Status ExpertGroup::Send(int32_t rank, const engine::ExpertWork& work, const float* in) {
  Rank& r = *ranks_.at(rank);
  transfer::RegionDescriptor inbox;
  uint32_t session = 0;
  {
    absl::MutexLock l(&mu_);
    if (!r.in) {
      return absl::UnavailableError(
          absl::StrCat("expert rank ", rank, " of ", o_.worker_id, " is not in the group"));
    }
    inbox = r.inbox;
    session = r.session;
  }
  const int64_t rows = work.total_rows();
  const int32_t n_expert = o_.placement.n_expert;
  const int32_t d = o_.model->config().n_embd;
  if (rows > o_.capacity_rows || static_cast<int32_t>(work.expert.size()) > n_expert) {
    return absl::InternalError(absl::StrCat("expert work of ", rows, " rows exceeds the ",
                                            o_.capacity_rows, " an inbox holds"));
  }
  r.pending = Sequence(session, ++r.counter);
  const uint64_t rows_at = InboxRowsOffset(n_expert);
  r.staging.assign(rows_at - kHeader, 0);
  InboxHeader h{r.pending, work.layer, static_cast<int32_t>(work.expert.size()), rows,
                work.same_input ? 1 : 0, 0};
  std::memcpy(r.staging.data(), &h, sizeof(h));
  uint8_t* table = r.staging.data() + (kTable - kHeader);
  std::memcpy(table, work.expert.data(), work.expert.size() * sizeof(int32_t));
  std::memcpy(table + n_expert * sizeof(int32_t), work.rows.data(),
              work.rows.size() * sizeof(int64_t));
  std::vector<transfer::WriteOp> ops = {
      {r.staging.data(), r.staging.size(), kHeader},
      {in, uint64_t(work.input_rows()) * d * sizeof(float), rows_at}};
  const auto timeout = absl::ToChronoMilliseconds(o_.timeout);
  absl::Status st = o_.transport->Write(inbox, std::move(ops), timeout);
  if (st.ok()) {
    r.bell = r.pending;
    st = o_.transport->Write(inbox, {{&r.bell, sizeof(r.bell), 0}}, timeout);
  }
  if (!st.ok()) {
    Drop(rank, session, st);
    return absl::UnavailableError(
        absl::StrCat("expert rank ", rank, " of ", o_.worker_id, ": ", st.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<const float*> ExpertGroup::Receive(int32_t rank, int64_t rows) {
  Rank& r = *ranks_.at(rank);
  const uint8_t* slice = results_ + slice_bytes_ * uint64_t(rank - 1);
  const absl::Time deadline = absl::Now() + o_.timeout;
  bool late = false;
  const bool answered = AwaitDoorbell([&] { return LoadAcquire(slice) == r.pending; },
                                      [&] {
                                        late = absl::Now() >= deadline;
                                        return late || !r.alive.load();
                                      });
  if (!answered) {
    const absl::Status why =
        late ? absl::DeadlineExceededError(absl::StrCat("expert rank ", rank, " of ",
                                                        o_.worker_id, " did not answer within ",
                                                        absl::FormatDuration(o_.timeout)))
             : absl::UnavailableError(
                   absl::StrCat("expert rank ", rank, " of ", o_.worker_id, " left the group"));
    Drop(rank, static_cast<uint32_t>(r.pending >> 32), why);
    return why;
  }
  ResultHeader h;
  std::memcpy(&h, slice + kHeader, sizeof(h));
  if (h.seq != r.pending || h.rows != rows) {
    const absl::Status why = absl::InternalError(absl::StrCat(
        "expert rank ", rank, " answered ", h.rows, " rows of request ", h.seq, ", not ", rows,
        " of ", r.pending));
    Drop(rank, static_cast<uint32_t>(r.pending >> 32), why);
    return why;
  }
  if (h.code != 0) {
    h.message[kMessageBytes - 1] = '\0';
    return absl::Status(static_cast<absl::StatusCode>(h.code),
                        absl::StrCat("expert rank ", rank, ": ", h.message));
  }
  return reinterpret_cast<const float*>(slice + kResultRows);
}

grpc::Status ExpertGroup::Join(grpc::ServerContext* ctx, const v1::JoinExpertGroupRequest* req,
                               grpc::ServerWriter<v1::ExpertGroupEvent>* writer) {
  const engine::ModelConfig& c = o_.model->config();
  const int32_t rank = req->rank();
  if (rank < 1 || rank >= ranks()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("rank ", rank, " is not an expert rank of a group of ",
                                     ranks()));
  }
  if (req->ranks() != ranks() || req->model() != o_.model_name || req->n_layer() != c.n_layer ||
      req->n_expert() != c.n_expert || req->n_embd() != c.n_embd) {
    return grpc::Status(
        grpc::StatusCode::FAILED_PRECONDITION,
        absl::StrCat("rank ", rank, " runs ", req->model(), " in a group of ", req->ranks(),
                     "; the leader runs ", o_.model_name, " in a group of ", ranks()));
  }
  if (!SamePlacement(o_.placement, req->placement(), c.n_layer, c.n_expert, ranks())) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("rank ", rank, " has another expert placement than the "
                                     "leader (give both the same --expert-placement)"));
  }
  if (req->capacity_rows() < o_.capacity_rows) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("rank ", rank, "'s inbox holds ", req->capacity_rows(),
                                     " rows, a step may send ", o_.capacity_rows,
                                     " (give it the leader's --max-batch-tokens)"));
  }
  absl::StatusOr<transfer::RegionDescriptor> inbox =
      transfer::RegionDescriptor::Parse(req->inbox());
  if (!inbox.ok()) return ToGrpcStatus(inbox.status());
  Rank& r = *ranks_[rank];
  uint32_t session = 0;
  {
    absl::MutexLock l(&mu_);
    if (shutdown_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the leader is stopping");
    if (r.in) {
      return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                          absl::StrCat("rank ", rank, " is in the group already"));
    }
    session = ++next_session_;
    r.session = session;
    r.inbox = *inbox;
    r.dropped = absl::OkStatus();
    r.in = true;
    r.alive = true;
  }
  v1::ExpertGroupEvent ev;
  ev.set_results(results_desc_.Serialize());
  ev.set_results_offset(slice_bytes_ * uint64_t(rank - 1));
  ev.set_session(session);
  if (!writer->Write(ev)) {
    Drop(rank, session, absl::UnavailableError("its Join stream broke"));
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the Join stream broke");
  }
  std::fprintf(stderr, "%s: expert rank %d (%s) joined, session %u\n", o_.worker_id.c_str(), rank,
               req->worker_id().c_str(), session);
  absl::Status dropped;
  {
    absl::MutexLock l(&mu_);
    auto over = [&] {
      mu_.AssertHeld();  // Await calls it under mu_
      return shutdown_ || !r.in || r.session != session;
    };
    while (!over() && !ctx->IsCancelled()) {
      mu_.AwaitWithTimeout(absl::Condition(&over), absl::Milliseconds(20));
    }
    dropped = r.session == session ? r.dropped : absl::OkStatus();
  }
  if (ctx->IsCancelled()) {
    Drop(rank, session, absl::UnavailableError("its Join stream ended (the rank went away)"));
  } else {
    Drop(rank, session, absl::UnavailableError("the leader is stopping"));
  }
  o_.transport->ForgetPeer(inbox->peer_address);
  if (!dropped.ok()) return ToGrpcStatus(dropped);
  if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "the rank left");
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the leader is stopping");
}

// ---- the expert rank's process ----

namespace {

struct RankServer {
  const WorkerFlags& f;
  const std::string& binary;
  const engine::Model& model;
  const engine::ExpertPlacement& placement;
  transfer::KvTransport* transport;
  Region inbox;
  int64_t capacity_rows;
  util::ThreadPool pool;
  engine::ExpertRunner runner;
  std::vector<float> out;
  std::vector<uint8_t> answer;
  uint64_t bell = 0;

  // Serves one membership until the stream ends or `stop`. Returns why it ended.
  absl::Status ServeSession(const v1::ExpertGroupEvent& ev, const std::atomic<bool>& stream_open,
                            const std::atomic<bool>& stop) {
    absl::StatusOr<transfer::RegionDescriptor> results =
        transfer::RegionDescriptor::Parse(ev.results());
    if (!results.ok()) return results.status();
    const engine::ModelConfig& c = model.config();
    const uint64_t rows_at = InboxRowsOffset(c.n_expert);
    uint64_t last = 0;
    const auto timeout = absl::ToChronoMilliseconds(absl::Milliseconds(f.ep_timeout_ms));
    for (;;) {
      uint64_t seq = 0;
      const bool got = AwaitDoorbell(
          [&] {
            seq = LoadAcquire(inbox.base);
            return (seq >> 32) == ev.session() && seq != last;
          },
          [&] { return stop.load() || !stream_open.load(); });
      if (!got) return absl::CancelledError("membership ended");
      last = seq;
      InboxHeader h;
      std::memcpy(&h, inbox.base + kHeader, sizeof(h));
      engine::ExpertWork work;
      absl::Status bad;
      if (h.seq != seq || h.layer < 0 || h.layer >= c.n_layer || h.groups < 0 ||
          h.groups > c.n_expert || h.rows < 0 || h.rows > capacity_rows) {
        bad = absl::InvalidArgumentError(absl::StrCat("malformed work ", h.seq, ": layer ",
                                                      h.layer, ", ", h.groups, " groups, ",
                                                      h.rows, " rows"));
      } else {
        work.layer = h.layer;
        work.same_input = h.same_input != 0;
        work.expert.resize(h.groups);
        work.rows.resize(h.groups);
        std::memcpy(work.expert.data(), inbox.base + kTable, h.groups * sizeof(int32_t));
        std::memcpy(work.rows.data(), inbox.base + kTable + c.n_expert * sizeof(int32_t),
                    h.groups * sizeof(int64_t));
        for (size_t g = 0; g < work.expert.size() && bad.ok(); ++g) {
          if (work.expert[g] < 0 || work.expert[g] >= c.n_expert ||
              !placement.Holds(f.ep_rank, h.layer, work.expert[g]) || work.rows[g] <= 0) {
            bad = absl::InvalidArgumentError(absl::StrCat(
                "expert ", work.expert[g], " of layer ", h.layer, " is not held by rank ",
                f.ep_rank));
          }
        }
        if (bad.ok() && work.total_rows() != h.rows) {
          bad = absl::InvalidArgumentError("group rows do not add up to the work's rows");
        }
      }
      ResultHeader rh{};
      rh.seq = seq;
      rh.rows = bad.ok() ? h.rows : 0;
      rh.code = static_cast<int32_t>(bad.code());
      std::snprintf(rh.message, kMessageBytes, "%s", std::string(bad.message()).c_str());
      if (bad.ok()) {
        out.resize(size_t(h.rows) * c.n_embd);
        runner.Run(c, model.layer(h.layer), work,
                   reinterpret_cast<const float*>(inbox.base + rows_at), out.data(), &pool);
      }
      answer.assign(reinterpret_cast<const uint8_t*>(&rh),
                    reinterpret_cast<const uint8_t*>(&rh) + sizeof(rh));
      std::vector<transfer::WriteOp> ops = {{answer.data(), answer.size(),
                                             ev.results_offset() + kHeader}};
      if (bad.ok() && h.rows > 0) {
        ops.push_back({out.data(), out.size() * sizeof(float), ev.results_offset() + kResultRows});
      }
      absl::Status st = transport->Write(*results, std::move(ops), timeout);
      if (st.ok()) {
        bell = seq;
        st = transport->Write(*results, {{&bell, sizeof(bell), ev.results_offset()}}, timeout);
      }
      if (!st.ok()) return st;
    }
  }
};

}  // namespace

int RunExpertRank(const WorkerFlags& f, const std::string& binary) {
  absl::StatusOr<engine::ExpertPlacement> placement = PlacementFromFlags(f);
  if (!placement.ok()) return FailWorker(binary, "expert placement", placement.status());
  engine::ModelLoadOptions lo;
  lo.experts_only = true;
  const engine::ExpertPlacement& p = *placement;
  lo.holds_expert = [&p, &f](int32_t l, int32_t e) { return p.Holds(f.ep_rank, l, e); };
  absl::StatusOr<std::unique_ptr<engine::Model>> model = engine::Model::Load(f.model_path, lo);
  if (!model.ok()) {
    return FailWorker(binary, absl::StrCat("loading ", f.model_path), model.status());
  }
  absl::StatusOr<std::unique_ptr<transfer::KvTransport>> transport = TransportFromFlags(f);
  if (!transport.ok()) return FailWorker(binary, "--transport", transport.status());
  if (*transport == nullptr) {
    return FailWorker(binary, "--transport",
                      absl::InvalidArgumentError("an expert rank needs a KV transport (ucx)"));
  }
  const engine::ModelConfig& c = (*model)->config();
  const int64_t capacity = int64_t{f.max_batch_tokens} * c.n_expert_used;
  absl::StatusOr<Region> inbox =
      MakeRegion(transport->get(), InboxBytes(c.n_expert, capacity, c.n_embd));
  if (!inbox.ok()) return FailWorker(binary, "allocating the inbox", inbox.status());
  RankServer server{f,        binary,         **model,  p, transport->get(), std::move(*inbox),
                    capacity, util::ThreadPool(f.threads)};

  v1::JoinExpertGroupRequest req;
  req.set_rank(f.ep_rank);
  req.set_ranks(f.ep_size);
  req.set_worker_id(f.worker_id);
  req.set_model(std::filesystem::path(f.model_path).filename().string());
  req.set_n_layer(c.n_layer);
  req.set_n_expert(c.n_expert);
  req.set_n_embd(c.n_embd);
  req.set_placement(p.ToJson().dump());
  req.set_capacity_rows(capacity);
  req.set_inbox(server.inbox.desc.Serialize());
  std::printf("%s: expert rank %d of %d (%s): experts %s of layer 0, joining %s\n",
              binary.c_str(), f.ep_rank, f.ep_size, f.worker_id.c_str(),
              p.layers.empty() ? "none" : absl::StrJoin(p.layers[0][f.ep_rank], ",").c_str(),
              f.ep_leader.c_str());
  std::fflush(stdout);

  std::atomic<bool> stop{false}, fatal{false};
  absl::Mutex ctx_mu;
  grpc::ClientContext* live_ctx = nullptr;  // the Join in flight, for cancelling at SIGTERM
  std::thread loop([&] {
    auto stub = v1::ExpertGroup::NewStub(CreateClientChannel(f.ep_leader));
    absl::Duration backoff = absl::Milliseconds(100);
    while (!stop) {
      grpc::ClientContext ctx;
      {
        absl::MutexLock l(&ctx_mu);
        if (stop) break;
        live_ctx = &ctx;
      }
      std::unique_ptr<grpc::ClientReader<v1::ExpertGroupEvent>> reader = stub->Join(&ctx, req);
      v1::ExpertGroupEvent ev;
      absl::Status ended;
      if (reader->Read(&ev)) {
        backoff = absl::Milliseconds(100);
        std::fprintf(stderr, "%s: rank %d joined %s, session %u\n", binary.c_str(), f.ep_rank,
                     f.ep_leader.c_str(), ev.session());
        std::atomic<bool> open{true};
        std::thread serve([&] {
          ended = server.ServeSession(ev, open, stop);
          if (!absl::IsCancelled(ended)) ctx.TryCancel();  // our writes fail: leave and rejoin
        });
        v1::ExpertGroupEvent more;
        while (reader->Read(&more)) {
        }
        open = false;
        serve.join();
      }
      const grpc::Status st = reader->Finish();
      {
        absl::MutexLock l(&ctx_mu);
        live_ctx = nullptr;
      }
      if (stop) break;
      std::fprintf(stderr, "%s: rank %d: out of the group (%s%s%s)\n",
                   binary.c_str(), f.ep_rank, st.error_message().c_str(), ended.ok() ? "" : "; ",
                   ended.ok() ? "" : std::string(ended.message()).c_str());
      if (st.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
          st.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
        // A configuration error: the same request would be refused again, so exit (1).
        std::fprintf(stderr, "%s: rank %d: the leader refuses it: %s\n", binary.c_str(),
                     f.ep_rank, st.error_message().c_str());
        fatal = true;
        ::kill(::getpid(), SIGTERM);
        break;
      }
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, absl::Seconds(2));
    }
  });
  const int sig = WaitForTerminationSignal();
  std::fprintf(stderr, "%s: expert rank %d: signal %d: leaving\n", binary.c_str(), f.ep_rank, sig);
  {
    absl::MutexLock l(&ctx_mu);
    stop = true;
    if (live_ctx != nullptr) live_ctx->TryCancel();
  }
  loop.join();
  (void)transport->get()->DeregisterRegion(server.inbox.desc.region_id);
  return fatal ? 1 : 0;
}

}  // namespace tandem::services
