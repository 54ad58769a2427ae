#include "common/transfer/inproc/inproc_transport.h"

#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <new>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/transfer/op_validation.h"

namespace tandem::transfer {
namespace {

constexpr char kAddressPrefix[] = "inproc:";

struct Region {
  uint8_t* base = nullptr;
  uint64_t length = 0;
  std::unique_ptr<uint8_t[]> owned;  // set for AllocateRegion memory
};

// The receiving half of an instance, shared with the registry so that a sender can reach it.
// Writers copy under a reader lock; (de)registration and shutdown take the writer lock, so
// once DeregisterRegion or the destructor returns, no copy into that memory is in progress.
struct Endpoint {
  absl::Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = true;
  std::map<uint64_t, Region> regions ABSL_GUARDED_BY(mu);
  std::atomic<uint64_t> bytes_received{0};
};

class Registry {
 public:
  static Registry& Get() {
    static Registry* r = new Registry();  // never destroyed: instances may outlive main's statics
    return *r;
  }
  std::string Add(const std::string& name, std::shared_ptr<Endpoint> ep) {
    absl::MutexLock l(&mu_);
    std::string address = absl::StrCat(kAddressPrefix, name, "#", ++serial_);
    endpoints_[address] = std::move(ep);
    return address;
  }
  void Remove(const std::string& address) {
    absl::MutexLock l(&mu_);
    endpoints_.erase(address);
  }
  std::shared_ptr<Endpoint> Find(const std::string& address) {
    absl::MutexLock l(&mu_);
    auto it = endpoints_.find(address);
    return it == endpoints_.end() ? nullptr : it->second;
  }

 private:
  absl::Mutex mu_;
  uint64_t serial_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, std::shared_ptr<Endpoint>> endpoints_ ABSL_GUARDED_BY(mu_);
};

class InProcessTransport final : public KvTransport {
 public:
  explicit InProcessTransport(const std::string& name)
      : self_(std::make_shared<Endpoint>()),
        address_(Registry::Get().Add(name, self_)),
        worker_([this] { WorkerLoop(); }) {}

  ~InProcessTransport() override {
    Registry::Get().Remove(address_);
    {
      absl::MutexLock l(&self_->mu);
      self_->alive = false;
      self_->regions.clear();
    }
    {
      absl::MutexLock l(&mu_);
      stopping_ = true;
    }
    worker_.join();
  }

  Capabilities capabilities() const override {
    return Capabilities{.name = "inproc", .detail = "memcpy", .one_sided = true};
  }

  absl::StatusOr<RegionDescriptor> RegisterRegion(void* base, uint64_t length) override {
    if (base == nullptr && length > 0) return absl::InvalidArgumentError("null region base");
    uint64_t id = next_region_id_.fetch_add(1);
    {
      absl::MutexLock l(&self_->mu);
      self_->regions[id] = Region{static_cast<uint8_t*>(base), length, nullptr};
    }
    RegionDescriptor d;
    d.peer_address = address_;
    d.region_id = id;
    d.base = reinterpret_cast<uintptr_t>(base);
    d.length = length;
    return d;
  }

  absl::StatusOr<AllocatedRegion> AllocateRegion(uint64_t length) override {
    if (length == 0) return absl::InvalidArgumentError("AllocateRegion of 0 bytes");
    auto memory = std::unique_ptr<uint8_t[]>(new (std::nothrow) uint8_t[length]);
    if (memory == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", length, " bytes"));
    }
    uint8_t* base = memory.get();
    auto d = RegisterRegion(base, length);
    if (!d.ok()) return d.status();
    {
      absl::MutexLock l(&self_->mu);
      self_->regions[d->region_id].owned = std::move(memory);
    }
    return AllocatedRegion{base, *d};
  }

  absl::Status DeregisterRegion(uint64_t region_id) override {
    absl::MutexLock l(&self_->mu);
    if (self_->regions.erase(region_id) == 0) {
      return absl::NotFoundError(absl::StrCat("region ", region_id, " is not registered"));
    }
    return absl::OkStatus();
  }

  void WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops,
                  std::chrono::steady_clock::time_point deadline,
                  std::function<void(absl::Status)> done) override {
    absl::MutexLock l(&mu_);
    queue_.push_back(Job{dst.peer_address, dst.region_id, dst.length, std::move(ops), deadline,
                         std::move(done)});
  }

  void ForgetPeer(const std::string&) override {}  // nothing is cached

  TransportStats stats() const override {
    TransportStats s;
    s.bytes_written = bytes_written_.load();
    s.bytes_received = self_->bytes_received.load();
    s.writes_failed = writes_failed_.load();
    if (s.bytes_written > 0) s.bytes_written_by_lanes["inproc"] = s.bytes_written;
    return s;
  }

 private:
  struct Job {
    std::string peer_address;
    uint64_t region_id;
    uint64_t region_length;
    std::vector<WriteOp> ops;
    std::chrono::steady_clock::time_point deadline;
    std::function<void(absl::Status)> done;
  };

  void WorkerLoop() {
    for (;;) {
      Job job;
      bool stopping;
      {
        absl::MutexLock l(&mu_);
        mu_.Await(absl::Condition(
            +[](InProcessTransport* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->mu_) {
              return t->stopping_ || !t->queue_.empty();
            },
            this));
        if (queue_.empty()) return;  // stopping and drained
        job = std::move(queue_.front());
        queue_.pop_front();
        stopping = stopping_;
      }
      absl::Status s = stopping ? absl::CancelledError("in-process transport shut down")
                                : Execute(job);
      if (s.ok()) {
        bytes_written_.fetch_add(TotalBytes(job.ops));
      } else {
        writes_failed_.fetch_add(1);
      }
      job.done(std::move(s));
    }
  }

  absl::Status Execute(const Job& job) {
    if (std::chrono::steady_clock::now() > job.deadline) {
      return absl::DeadlineExceededError("write deadline passed before it started");
    }
    if (!absl::StartsWith(job.peer_address, kAddressPrefix)) {
      return absl::InvalidArgumentError("descriptor is not for the in-process transport");
    }
    std::shared_ptr<Endpoint> peer = Registry::Get().Find(job.peer_address);
    if (peer == nullptr) {
      return absl::UnavailableError(absl::StrCat("peer ", job.peer_address, " is gone"));
    }
    if (absl::Status s = ValidateOps(job.region_length, job.ops); !s.ok()) return s;
    absl::ReaderMutexLock l(&peer->mu);
    if (!peer->alive) {
      return absl::UnavailableError(absl::StrCat("peer ", job.peer_address, " is gone"));
    }
    auto it = peer->regions.find(job.region_id);
    if (it == peer->regions.end()) {
      return absl::NotFoundError(absl::StrCat("region ", job.region_id, " is not registered at ",
                                              job.peer_address));
    }
    // Re-check against what the peer really registered: a forged or stale descriptor must not
    // let a write escape the region.
    if (absl::Status s = ValidateOps(it->second.length, job.ops); !s.ok()) return s;
    uint64_t total = 0;
    for (const WriteOp& op : job.ops) {
      if (op.length == 0) continue;
      std::memcpy(it->second.base + op.remote_offset, op.src, op.length);
      total += op.length;
    }
    peer->bytes_received.fetch_add(total);
    return absl::OkStatus();
  }

  std::shared_ptr<Endpoint> self_;
  const std::string address_;
  std::atomic<uint64_t> next_region_id_{1};
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> writes_failed_{0};

  absl::Mutex mu_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread worker_;  // last: starts after everything above is constructed
};

}  // namespace

std::unique_ptr<KvTransport> CreateInProcessTransport(std::string name) {
  return std::make_unique<InProcessTransport>(name);
}

}  // namespace tandem::transfer
