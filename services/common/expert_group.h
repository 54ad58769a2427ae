// Expert-parallel worker groups over the KV transport (UCX): rank 0's ExpertGroup (the
// engine's ExpertPeers, engine/runtime/expert_parallel.h, and the tandem.v1.ExpertGroup
// service the other ranks join) and RunExpertRank, the process of ranks 1..N-1.
//
// Memory and messages. Each expert rank allocates an inbox (KvTransport::AllocateRegion: a
// shared-memory segment on one host, so a put is one memcpy) and sends its descriptor in Join;
// the leader answers with its result region and the rank's slice of it. Per MoE layer the
// leader writes the rank's work (header, group table, input rows) into the inbox and, once
// those bytes are visible there, an 8-byte doorbell holding the request's sequence number; the
// rank waits for the doorbell, computes, and answers the same way into its result slice. A
// waiter spins briefly, then sleeps in growing steps of at most 1 ms (AwaitDoorbell), so an
// idle rank costs no core. The leader's waits end at the group's deadline.
//
// Membership. Join is a server stream that stays open while the rank is in the group. A rank
// that dies closes it, and the leader then fails every exchange with that rank at once
// (UNAVAILABLE): the steps in flight fail, their requests end UNAVAILABLE and the router
// migrates them. complete() turns false, so the worker deregisters (ServeOptions::ready) until
// the rank is back. A rank that misses the deadline is dropped the same way (its stream ends
// with DEADLINE_EXCEEDED). A rank whose leader goes away joins again, retrying with backoff; a
// sequence number carries its membership's session, so a late write from an old one is never
// taken for new work.
//
// Threading: Send and Receive on the engine's stepping thread; Join on gRPC threads; the rest
// anywhere.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/transfer/transfer.h"
#include "engine/model/model.h"
#include "engine/runtime/expert_parallel.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::services {

struct ExpertGroupOptions {
  transfer::KvTransport* transport = nullptr;  // borrowed
  engine::ExpertPlacement placement;
  const engine::Model* model = nullptr;  // borrowed: its shape is what joining ranks must match
  std::string model_name;                // the model file's name
  int64_t capacity_rows = 0;             // most rows one rank gets per layer
  absl::Duration timeout = absl::Seconds(10);  // every exchange with a rank
  std::string worker_id;                 // for log lines
};

class ExpertGroup final : public engine::ExpertPeers, public v1::ExpertGroup::Service {
 public:
  // INVALID_ARGUMENT for a placement of fewer than 2 ranks or no transport; the transport's
  // error when the result region cannot be had.
  static absl::StatusOr<std::unique_ptr<ExpertGroup>> Create(ExpertGroupOptions o);
  ~ExpertGroup() override;

  // Every rank is in the group.
  bool complete() const;
  // Ends every Join stream (before the gRPC server's shutdown, which waits for them).
  void Shutdown();

  int32_t ranks() const override { return o_.placement.ranks; }
  const engine::ExpertHolders& holders() const override { return holders_; }
  absl::Status Send(int32_t rank, const engine::ExpertWork& work, const float* in) override;
  absl::StatusOr<const float*> Receive(int32_t rank, int64_t rows) override;

  grpc::Status Join(grpc::ServerContext* ctx, const v1::JoinExpertGroupRequest* req,
                    grpc::ServerWriter<v1::ExpertGroupEvent>* writer) override;

 private:
  explicit ExpertGroup(ExpertGroupOptions o);
  // Drops `rank` from the group (its Join stream ends with `why`), unless it rejoined since.
  void Drop(int32_t rank, uint32_t session, const absl::Status& why);

  struct Rank {
    // Guarded by mu_.
    bool in = false;
    uint32_t session = 0;
    transfer::RegionDescriptor inbox;
    absl::Status dropped;  // why the leader dropped the current session (OK: it did not)
    // Stepping thread only.
    uint64_t counter = 0;
    uint64_t pending = 0;  // sequence number of the work awaiting its answer (session << 32 | n)
    uint64_t bell = 0;  // source of the doorbell write
    std::vector<uint8_t> staging;
    std::atomic<bool> alive{false};
  };

  ExpertGroupOptions o_;
  engine::ExpertHolders holders_;
  uint64_t slice_bytes_ = 0;
  uint8_t* results_ = nullptr;
  uint64_t results_region_ = 0;
  std::unique_ptr<uint8_t, void (*)(void*)> owned_results_{nullptr, nullptr};
  transfer::RegionDescriptor results_desc_;
  std::vector<std::unique_ptr<Rank>> ranks_;  // [rank]; 0 unused

  mutable absl::Mutex mu_;
  uint32_t next_session_ ABSL_GUARDED_BY(mu_) = 0;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

struct WorkerFlags;

// The process of an expert rank (--ep-rank >= 1): loads only its experts, joins the leader at
// --ep-leader and serves its work until SIGTERM/SIGINT. Returns the exit code (1 after printing
// what failed to start).
int RunExpertRank(const WorkerFlags& flags, const std::string& binary);

}  // namespace tandem::services
