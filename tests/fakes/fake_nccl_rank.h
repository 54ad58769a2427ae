// Fake NCCL ranks for the nccl pair transport's CPU tests: host memory, an in-process
// rendezvous in place of ncclCommInitRank (honouring Init's deadline), writes as memcpy into
// the peer rank's registered regions. Break() makes a rank behave like an aborted
// communicator (UNAVAILABLE). Thread-safe; ranks find each other through one World.
#pragma once

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/transfer/nccl/nccl_transport.h"

namespace tandem::testing {

using transfer::Capabilities;
using transfer::NcclTransport;
using transfer::RegionDescriptor;
using transfer::TransportStats;
using transfer::WriteOp;
using Clock = std::chrono::steady_clock;

class FakeRank;

// Ranks by their AddressOfRank, and who has joined which unique id.
struct World {
  absl::Mutex mu;
  std::map<std::string, FakeRank*> by_address ABSL_GUARDED_BY(mu);
  std::map<std::string, int> joined ABSL_GUARDED_BY(mu);  // unique id -> ranks joined
  std::atomic<int> live_ranks{0};
  std::atomic<int> next_id{0};
};

class FakeRank final : public NcclTransport {
 public:
  explicit FakeRank(World* w) : w_(w) { w_->live_ranks++; }
  ~FakeRank() override {
    absl::MutexLock l(&w_->mu);
    w_->by_address.erase(address_);
    w_->live_ranks--;
  }
  absl::Status Init(int rank, int nranks, const std::string& uid,
                    Clock::time_point deadline) override {
    absl::MutexLock l(&w_->mu);
    address_ = AddressOfRank(uid, rank);
    w_->by_address[address_] = this;
    w_->joined[uid]++;
    auto all = [&] {
      w_->mu.AssertHeld();  // Await calls it under mu
      return w_->joined[uid] >= nranks;
    };
    while (!all()) {
      if (Clock::now() >= deadline) return absl::DeadlineExceededError("fake: peer never joined");
      w_->mu.AwaitWithTimeout(absl::Condition(&all), absl::Milliseconds(5));
    }
    return absl::OkStatus();
  }
  Capabilities capabilities() const override { return {.name = "fake-nccl"}; }
  absl::StatusOr<RegionDescriptor> RegisterRegion(void* base, uint64_t length) override {
    absl::MutexLock l(&w_->mu);
    uint64_t id = 100 + regions_.size();  // unlike the outer ids, so a mix-up shows
    regions_[id] = {static_cast<uint8_t*>(base), length};
    return RegionDescriptor{.region_id = id, .length = length};
  }
  absl::Status DeregisterRegion(uint64_t id) override {
    absl::MutexLock l(&w_->mu);
    return regions_.erase(id) ? absl::OkStatus() : absl::NotFoundError("fake");
  }
  void WriteAsync(const RegionDescriptor& dst, std::vector<WriteOp> ops, Clock::time_point,
                  std::function<void(absl::Status)> done) override {
    absl::Status s;
    {
      absl::MutexLock l(&w_->mu);
      auto it = w_->by_address.find(dst.peer_address);
      if (broken_ || it == w_->by_address.end()) {
        s = absl::UnavailableError("fake: communicator gone");
      } else {
        auto r = it->second->regions_.find(dst.region_id);
        if (r == it->second->regions_.end()) {
          s = absl::NotFoundError("fake: no region");
        } else {
          for (const WriteOp& op : ops) {
            std::memcpy(r->second.first + op.remote_offset, op.src, op.length);
            written_ += op.length;
          }
        }
      }
    }
    done(s);
  }
  void ForgetPeer(const std::string&) override {}
  TransportStats stats() const override { return {.bytes_written = written_.load()}; }

  void Break() {
    absl::MutexLock l(&w_->mu);
    broken_ = true;
  }

 private:
  World* w_;
  std::string address_;
  std::map<uint64_t, std::pair<uint8_t*, uint64_t>> regions_;
  bool broken_ = false;
  std::atomic<uint64_t> written_{0};
};

}  // namespace tandem::testing
