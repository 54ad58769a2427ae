#include "common/transfer/nccl/nccl_pair_transport.h"

#include <atomic>
#include <deque>
#include <map>
#include <random>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"

namespace tandem::transfer {
namespace {

using Clock = std::chrono::steady_clock;
constexpr absl::string_view kPrefix = "ncclpair:";

struct PeerName {
  std::string instance;
  std::string control_address;
};
absl::StatusOr<PeerName> ParsePeer(absl::string_view a) {
  if (!absl::StartsWith(a, kPrefix)) {
    return absl::InvalidArgumentError(
        absl::StrCat("descriptor is not for the nccl transport (peer \"", a, "\")"));
  }
  a.remove_prefix(kPrefix.size());
  size_t at = a.find('@');
  if (at == absl::string_view::npos || at == 0 || at + 1 == a.size()) {
    return absl::InvalidArgumentError("nccl descriptor: peer is not INSTANCE@HOST:PORT");
  }
  return PeerName{std::string(a.substr(0, at)), std::string(a.substr(at + 1))};
}

// A failure after which the pair's communicator is gone (NcclTransport aborts it).
bool PairIsBroken(const absl::Status& s) {
  return s.code() == absl::StatusCode::kUnavailable ||
         s.code() == absl::StatusCode::kDeadlineExceeded;
}

class NcclPairTransportImpl final : public NcclPairTransport {
 public:
  explicit NcclPairTransportImpl(NcclPairTransportOptions o) : o_(std::move(o)) {
    std::random_device rd;
    instance_ = absl::StrFormat("%08x%08x", rd(), rd());
    janitor_ = std::thread([this] { Janitor(); });
  }

  ~NcclPairTransportImpl() override {
    std::vector<std::shared_ptr<Pair>> all;
    {
      absl::MutexLock l(&mu_);
      for (auto& [k, p] : sending_) all.push_back(p);
      for (auto& [k, p] : receiving_) all.push_back(p);
      sending_.clear();
      receiving_.clear();
    }
    for (auto& p : all) Retire(std::move(p));
    {
      absl::MutexLock l(&mu_);
      stop_ = true;
    }
    janitor_.join();
  }

  Capabilities capabilities() const override {
    return Capabilities{.name = "nccl",
                        .detail = "ncclSend/ncclRecv, one communicator per peer pair",
                        .one_sided = false,
                        .device_memory = true,
                        .cross_host = true};
  }

  std::string instance() const override { return instance_; }

  std::pair<size_t, size_t> pair_counts() const override {
    absl::MutexLock l(&mu_);
    return {sending_.size(), receiving_.size()};
  }

  absl::StatusOr<RegionDescriptor> RegisterRegion(void* base, uint64_t length) override {
    if (base == nullptr || length == 0) return absl::InvalidArgumentError("empty region");
    if (o_.control_address.empty()) {
      return absl::FailedPreconditionError(
          "nccl transport has no control-plane address to publish (a sender-only transport)");
    }
    absl::MutexLock l(&mu_);
    const uint64_t id = next_region_++;
    regions_[id] = {base, length};
    // Pairs built before this region: register it there too (their senders learn the id by
    // joining again, see the header).
    for (auto& [sender, p] : receiving_) {
      if (p->rank == nullptr) continue;
      absl::StatusOr<RegionDescriptor> d = p->rank->RegisterRegion(base, length);
      if (d.ok()) p->regions[id] = d->region_id;
    }
    RegionDescriptor d;
    d.peer_address = absl::StrCat(kPrefix, instance_, "@", o_.control_address);
    d.region_id = id;
    d.base = reinterpret_cast<uintptr_t>(base);
    d.length = length;
    return d;
  }

  absl::Status DeregisterRegion(uint64_t region_id) override {
    absl::MutexLock l(&mu_);
    if (regions_.erase(region_id) == 0) return absl::NotFoundError("region is not registered");
    absl::Status first;
    for (auto& [sender, p] : receiving_) {
      auto it = p->regions.find(region_id);
      if (it == p->regions.end() || p->rank == nullptr) continue;
      absl::Status s = p->rank->DeregisterRegion(it->second);
      p->regions.erase(it);
      if (first.ok() && !s.ok() && s.code() != absl::StatusCode::kNotFound) first = s;
    }
    return first;
  }

  void WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                  Clock::time_point deadline, std::function<void(absl::Status)> done) override {
    absl::StatusOr<PeerName> peer = ParsePeer(dst.peer_address);
    if (!peer.ok()) return Fail(std::move(done), peer.status());
    if (!o_.join) {
      return Fail(std::move(done),
                  absl::FailedPreconditionError("nccl transport: this worker cannot send"));
    }
    Pending w{dst, std::move(ops), deadline, std::move(done)};
    std::shared_ptr<Pair> ready;
    std::shared_ptr<Pair> stale;
    {
      absl::MutexLock l(&mu_);
      auto it = sending_.find(dst.peer_address);
      if (it != sending_.end() && it->second->ready &&
          !it->second->regions.contains(dst.region_id)) {
        stale = std::move(it->second);  // region newer than the pair: join again
        sending_.erase(it);
        it = sending_.end();
      }
      if (it == sending_.end()) {
        auto p = std::make_shared<Pair>();
        p->waiting.push_back(std::move(w));
        Pair* raw = p.get();
        sending_[dst.peer_address] = p;
        p->init = std::thread([this, raw, key = dst.peer_address, peer = *peer, deadline] {
          JoinAsSender(raw, key, peer, deadline);
        });
      } else if (!it->second->ready) {
        it->second->waiting.push_back(std::move(w));
      } else {
        ready = it->second;
      }
    }
    if (stale) Retire(std::move(stale));
    if (ready) Issue(*ready, dst.peer_address, std::move(w));
  }

  void ForgetPeer(const std::string& peer_address) override {
    std::shared_ptr<Pair> p;
    {
      absl::MutexLock l(&mu_);
      auto it = sending_.find(peer_address);
      if (it == sending_.end()) return;
      p = std::move(it->second);
      sending_.erase(it);
    }
    Retire(std::move(p));
  }

  TransportStats stats() const override {
    TransportStats t;
    {
      absl::MutexLock l(&mu_);
      t = retired_;
      auto add = [&t](const Pair& p) {
        if (p.rank == nullptr) return;
        TransportStats s = p.rank->stats();
        t.bytes_written += s.bytes_written;
        t.bytes_received += s.bytes_received;
        t.writes_failed += s.writes_failed;
      };
      for (auto& [k, p] : sending_) add(*p);
      for (auto& [k, p] : receiving_) add(*p);
    }
    t.writes_failed += writes_refused_.load();
    t.bytes_written_by_lanes.clear();
    if (t.bytes_written > 0) t.bytes_written_by_lanes["nccl"] = t.bytes_written;
    return t;
  }

  absl::StatusOr<NcclJoinReply> HandleJoin(const NcclJoinRequest& req,
                                           Clock::time_point deadline) override {
    if (req.receiver_instance != instance_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "nccl join names receiver instance ", req.receiver_instance, " but this is ", instance_,
          " (the worker restarted: its descriptors are stale)"));
    }
    if (req.sender_instance.empty()) return absl::InvalidArgumentError("nccl join: no sender");
    absl::StatusOr<std::string> uid = o_.create_unique_id();
    if (!uid.ok()) return uid.status();
    absl::StatusOr<std::unique_ptr<NcclTransport>> rank = o_.create_rank();
    if (!rank.ok()) return rank.status();
    auto p = std::make_shared<Pair>();
    p->rank = std::move(*rank);
    NcclJoinReply reply;
    reply.unique_id = *uid;
    std::vector<std::shared_ptr<Pair>> old;
    {
      absl::MutexLock l(&mu_);
      for (auto& [id, r] : regions_) {
        absl::StatusOr<RegionDescriptor> d = p->rank->RegisterRegion(r.base, r.length);
        if (!d.ok()) return d.status();
        p->regions[id] = d->region_id;
        reply.regions.push_back({id, d->region_id});
      }
      Pair* raw = p.get();
      NcclTransport* rank_ptr = p->rank.get();
      const std::string sender = req.sender_instance;
      p->init = std::thread([this, raw, rank_ptr, sender, uid = *uid, deadline] {
        absl::Status s = rank_ptr->Init(0, 2, uid, deadline);
        absl::MutexLock l(&mu_);
        auto it = receiving_.find(sender);
        if (it == receiving_.end() || it->second.get() != raw) return;  // replaced meanwhile
        if (s.ok()) {
          raw->ready = true;
        } else {
          // The sender never joined (died, or missed the deadline): free the rank.
          graveyard_.push_back(std::move(it->second));
          receiving_.erase(it);
        }
      });
      auto it = receiving_.find(sender);
      if (it != receiving_.end()) old.push_back(std::move(it->second));
      receiving_[sender] = p;
      receive_order_.push_back(sender);
      while (receiving_.size() > o_.max_receiving_pairs && !receive_order_.empty()) {
        auto v = receiving_.find(receive_order_.front());
        receive_order_.pop_front();
        if (v != receiving_.end() && v->first != sender) {
          old.push_back(std::move(v->second));
          receiving_.erase(v);
        }
      }
      // Keep the order queue bounded: drop names whose pair is gone.
      while (receive_order_.size() > 2 * o_.max_receiving_pairs + 1) receive_order_.pop_front();
    }
    for (auto& q : old) Retire(std::move(q));
    return reply;
  }

 private:
  struct Region {
    void* base;
    uint64_t length;
  };
  struct Pending {
    RegionDescriptor dst;
    std::vector<WriteOp> ops;
    Clock::time_point deadline;
    std::function<void(absl::Status)> done;
  };
  struct Pair {
    ~Pair() {
      if (init.joinable()) init.join();  // bounded by the join's deadline
      rank.reset();  // fails its outstanding writes (their callbacks run here)
    }
    // Set before `ready`/`init`'s end under mu_; read by writers only once ready.
    std::unique_ptr<NcclTransport> rank;
    std::map<uint64_t, uint64_t> regions;  // descriptor region id -> the pair's region id
    std::string remote;                    // sender: the receiver rank's peer_address
    bool ready = false;
    std::vector<Pending> waiting;  // sender: writes that wait for the join
    std::thread init;
  };

  void Fail(std::function<void(absl::Status)> done, absl::Status s) {
    writes_refused_++;
    done(std::move(s));
  }

  // Runs on the pair's init thread.
  void JoinAsSender(Pair* p, const std::string& key, const PeerName& peer,
                    Clock::time_point deadline) {
    absl::Status s;
    NcclJoinReply reply;
    std::unique_ptr<NcclTransport> rank;
    absl::StatusOr<NcclJoinReply> r = o_.join(peer.control_address,
                                              {peer.instance, instance_}, deadline);
    if (!r.ok()) {
      s = r.status();
    } else {
      reply = std::move(*r);
      absl::StatusOr<std::unique_ptr<NcclTransport>> made = o_.create_rank();
      if (!made.ok()) {
        s = made.status();
      } else {
        rank = std::move(*made);
        s = rank->Init(1, 2, reply.unique_id, deadline);
      }
    }
    if (!s.ok()) {
      s = absl::Status(s.code(), absl::StrCat("joining the nccl pair with ",
                                              peer.control_address, ": ", s.message()));
    }
    std::vector<Pending> waiting;
    std::shared_ptr<Pair> drop;
    {
      absl::MutexLock l(&mu_);
      waiting.swap(p->waiting);
      auto it = sending_.find(key);
      const bool current = it != sending_.end() && it->second.get() == p;
      if (!current && s.ok()) s = absl::UnavailableError("nccl peer was forgotten while joining");
      if (s.ok()) {
        p->rank = std::move(rank);
        for (auto& [outer, inner] : reply.regions) p->regions[outer] = inner;
        p->remote = NcclTransport::AddressOfRank(reply.unique_id, 0);
        p->ready = true;
      } else if (current) {
        drop = std::move(it->second);
        sending_.erase(it);
      }
    }
    // The rank of a failed join goes here, on this thread (never its own progress thread).
    rank.reset();
    for (Pending& w : waiting) {
      if (s.ok()) {
        Issue(*p, key, std::move(w));
      } else {
        Fail(std::move(w.done), s);
      }
    }
    if (drop) Retire(std::move(drop));
  }

  // Writes through a ready pair. The pair stays alive meanwhile: only the janitor destroys
  // pairs, and a destroyed rank completes every write it holds first.
  void Issue(Pair& p, const std::string& key, Pending w) {
    auto it = p.regions.find(w.dst.region_id);
    if (it == p.regions.end()) {
      return Fail(std::move(w.done), absl::NotFoundError("region unknown to the nccl pair"));
    }
    RegionDescriptor inner = w.dst;
    inner.peer_address = p.remote;
    inner.region_id = it->second;
    Pair* raw = &p;
    p.rank->WriteAsync(inner, std::move(w.ops), w.deadline,
                       [this, raw, key, done = std::move(w.done)](absl::Status s) {
                         if (PairIsBroken(s)) DropSending(key, raw);
                         done(std::move(s));
                       });
  }

  void DropSending(const std::string& key, Pair* p) {
    std::shared_ptr<Pair> drop;
    {
      absl::MutexLock l(&mu_);
      auto it = sending_.find(key);
      if (it == sending_.end() || it->second.get() != p) return;
      drop = std::move(it->second);
      sending_.erase(it);
    }
    Retire(std::move(drop));
  }

  // Pairs are destroyed on the janitor thread: a rank's destructor joins its progress thread,
  // which may be the thread that noticed the failure.
  void Retire(std::shared_ptr<Pair> p) {
    absl::MutexLock l(&mu_);
    graveyard_.push_back(std::move(p));
  }

  bool JanitorHasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || !graveyard_.empty();
  }
  void Janitor() {
    for (;;) {
      std::vector<std::shared_ptr<Pair>> dead;
      bool stop;
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(this, &NcclPairTransportImpl::JanitorHasWork));
        dead.swap(graveyard_);
        stop = stop_;
        for (auto& p : dead) {
          if (p->rank == nullptr) continue;
          TransportStats s = p->rank->stats();
          retired_.bytes_written += s.bytes_written;
          retired_.bytes_received += s.bytes_received;
          retired_.writes_failed += s.writes_failed;
        }
      }
      dead.clear();  // outside mu_: the ranks' callbacks take it
      if (stop) {
        absl::MutexLock l(&mu_);
        if (graveyard_.empty()) return;
      }
    }
  }

  const NcclPairTransportOptions o_;
  std::string instance_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Region> regions_ ABSL_GUARDED_BY(mu_);
  uint64_t next_region_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, std::shared_ptr<Pair>> sending_ ABSL_GUARDED_BY(mu_);    // by peer
  std::map<std::string, std::shared_ptr<Pair>> receiving_ ABSL_GUARDED_BY(mu_);  // by sender
  std::deque<std::string> receive_order_ ABSL_GUARDED_BY(mu_);  // oldest join first
  std::vector<std::shared_ptr<Pair>> graveyard_ ABSL_GUARDED_BY(mu_);
  TransportStats retired_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> writes_refused_{0};
  std::thread janitor_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<NcclPairTransport>> NcclPairTransport::Create(
    NcclPairTransportOptions o) {
  if (!o.create_rank || !o.create_unique_id) {
    return absl::InvalidArgumentError("nccl pair transport needs create_rank and create_unique_id");
  }
  if (o.max_receiving_pairs == 0) return absl::InvalidArgumentError("max_receiving_pairs is 0");
  return std::unique_ptr<NcclPairTransport>(new NcclPairTransportImpl(std::move(o)));
}

}  // namespace tandem::transfer
