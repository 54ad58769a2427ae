// UcxTransport: KvTransport over UCX (UCP), for shared memory between processes on one host and
// for TCP (and RDMA where UCX finds it) between hosts.
//
// How a write travels. The sender creates a UCP endpoint from the peer's packed worker address
// the first time it writes there, and for each (peer, region) decides between two paths:
//  * put: ucp_put_nbx per op, then ucp_ep_flush_nbx, whose completion means the bytes are in
//    the peer's memory. Used where UCX puts are native: the peer's region is a shared-memory
//    segment we can map (ucp_rkey_ptr succeeds: memory from AllocateRegion, so a put is one
//    memcpy and the receiver does nothing) or the endpoint has an RDMA lane (rc/dc).
//  * active messages: every op is ucp_am_send_nbx with a small header {region, offset}; the
//    peer's handler receives the payload straight into its region (rendezvous with
//    ucp_am_recv_data_nbx for payloads >= am_rndv_threshold, so over shm the receiver pulls
//    the bytes with one cma copy; a copy out of the eager buffer for small ones) and, once
//    every op of the batch has landed, sends one acknowledgement carrying a status. Used for
//    TCP (UCX emulates puts there at < 1 GB/s) and for caller-allocated memory on shm: UCX
//    1.13 cannot put into such memory natively (cma serves only rendezvous), so a "put" would
//    be emulated with messages anyway, without the ack.
// The sender completes an AM batch on the ack, not on its own send completions: an eager send
// completes when its buffer is reusable, and even a rendezvous send can complete before the
// receiver's handler has run (UCX's AM-fragment pipeline), so only the ack makes "OK" mean
// "visible". The ack also carries the receiver's own bounds and region check, so a write to a
// region the receiver has deregistered fails with NOT_FOUND instead of silently vanishing.
//
// Threading: one progress thread per instance drives the UCP worker (created
// UCS_THREAD_MODE_SERIALIZED) under the transport's worker lock, which it holds except while it
// sleeps in poll() on the worker's event fd (ucp_worker_arm) and an eventfd; it spins on
// ucp_worker_progress only while requests are in flight, and only for `spin` after the last
// progress. Work reaches it through a task queue and the eventfd. Fast path (`inline_writes`):
// a put batch to a peer region already written to, that finds the lock free and no task queued
// (the progress thread is idle), is issued (puts and flush) on the caller's thread; a put into
// a mapped shared-memory segment then completes inside those calls and the callback runs on
// the caller's thread before WriteAsync returns (outside the lock). Whatever is left pending
// goes on with the progress thread, which is woken for it. Active messages always go through
// the progress thread. Other callbacks run on the progress thread outside any UCX callback, so
// they may call WriteAsync. RegisterRegion and DeregisterRegion block the caller until the
// progress thread has done the work.
//
// Errors: FromUcsStatus maps UCX errors. A dead peer is detected by UCX's peer error handling
// where the transports support it (tcp, RDMA): its endpoint fails, its batches get UNAVAILABLE.
// UCX 1.13's posix/sysv shared-memory transports do not support it (an endpoint asking for
// UCP_ERR_HANDLING_MODE_PEER cannot use them), so shm endpoints run with error handling NONE,
// and the transport watches a same-host receiver process itself: descriptors carry the host's
// identity (boot id + pid namespace) and the receiver's pid, the sender holds a pidfd, and a
// batch to a process that has exited fails with UNAVAILABLE (also a put that "succeeded" into a
// segment we still map after the receiver died).
// Deadlines: a request still running at its deadline is cancelled. ucp_request_cancel is tried;
// UCX 1.13 cannot cancel send requests, so the endpoint is then force-closed (other batches to
// the same peer fail with UNAVAILABLE; the next write reconnects). The callback gets
// DEADLINE_EXCEEDED once UCX has handed the requests back, or after a 1 s grace if it does not
// (seen with error handling NONE over shm): from then on a frozen receiver could still pull the
// source bytes, so AM headers carry the sender's deadline and a same-host receiver refuses a
// write that arrives after it (DEADLINE_EXCEEDED in the ack), so a late write never lands in
// blocks that the control plane may have handed to someone else.
//
// Limits of one-sided writes: with puts the receiver's CPU is not involved, so (a) its
// bytes_received stat stays 0 and (b) it cannot refuse a write. A sender holding a stale
// descriptor of a freed shared-memory region writes into a segment nobody reads any more (the
// sender keeps it attached), which is harmless but silent; the control plane's leases prevent
// it. The AM path checks every write on the receiver.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transfer/transfer.h"

namespace tandem::transfer {

struct UcxTransportOptions {
  // Which UCX transports: "shm" (posix,sysv,cma), "tcp", "all", or an explicit UCX_TLS-style
  // list ("posix,cma,tcp"). Applied through ucp_config_modify, never via the environment.
  std::string transports = "shm";

  enum class WriteMode {
    kAuto,           // put where native (shared-memory segment or RDMA), active messages else
    kPut,            // always ucp_put_nbx (+ flush), even where UCX emulates it
    kActiveMessage,  // always active messages into the region (+ ack)
  };
  WriteMode write_mode = WriteMode::kAuto;

  enum class PeerFailureDetection {
    kAuto,  // on unless the transport list includes shared memory (UCX 1.13 cannot combine them)
    kOn,    // UCP_ERR_HANDLING_MODE_PEER (excludes posix/sysv in UCX 1.13)
    kOff,   // UCP_ERR_HANDLING_MODE_NONE
  };
  PeerFailureDetection peer_failure_detection = PeerFailureDetection::kAuto;

  enum class ProgressMode {
    kAdaptive,  // spin up to `spin` after the last progress while busy, then sleep on events
    kBlocking,  // always sleep on events (lowest CPU, highest latency)
    kPolling,   // spin as long as requests are in flight (lowest latency); still sleeps when idle
  };
  ProgressMode progress_mode = ProgressMode::kAdaptive;
  std::chrono::microseconds spin{200};

  // Further UCX settings, without the UCX_ prefix (e.g. {"RNDV_THRESH", "32K"}), applied with
  // ucp_config_modify after the transport list.
  std::vector<std::pair<std::string, std::string>> ucx_config;

  // Issue a write on the caller's thread when the progress thread is idle (see Threading).
  // Off: every write is handed to the progress thread, and every callback runs there.
  bool inline_writes = true;

  // Active-message payloads at least this large are forced onto UCX's rendezvous protocol
  // (received zero-copy into the region); smaller ones use UCX's own eager/rendezvous choice.
  uint64_t am_rndv_threshold = 64 * 1024;
};

absl::StatusOr<std::unique_ptr<KvTransport>> CreateUcxTransport(
    const UcxTransportOptions& options);

// Expands the "shm"/"tcp"/"all" shorthands into the UCX transport list used for UCX_TLS.
absl::StatusOr<std::string> ResolveUcxTransports(const std::string& transports);

}  // namespace tandem::transfer
