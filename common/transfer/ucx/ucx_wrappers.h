// Non-copyable RAII owners of UCX (UCP) handles, and the one conversion of ucs_status_t into
// absl::Status.
//
// Threading: none of these types lock. UcxTransport creates the context and worker in
// UCP_THREAD_MODE_SINGLE and then touches every handle from its progress thread only.
// Ownership: each wrapper owns exactly one handle and releases it in its destructor. UcxEndpoint
// can hand its endpoint to an asynchronous close instead (StartClose), because closing needs
// worker progress that the owner drives.
// Errors: every fallible call returns a Status built by FromUcsStatus.
#pragma once

#include <ucp/api/ucp.h>

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace tandem::transfer::ucx {

// The only place a ucs_status_t becomes a Status. `context` says what was being done.
absl::Status FromUcsStatus(ucs_status_t status, std::string_view context);

class UcxContext {
 public:
  // `config` holds UCX settings without the UCX_ prefix, e.g. {"TLS", "posix,sysv,cma"}. They
  // are applied with ucp_config_modify on this context's config only; the process environment
  // is not changed (UCX still reads UCX_* variables a user set, as its defaults).
  static absl::StatusOr<std::unique_ptr<UcxContext>> Create(
      const std::vector<std::pair<std::string, std::string>>& config, uint64_t features);
  ~UcxContext();
  UcxContext(const UcxContext&) = delete;
  UcxContext& operator=(const UcxContext&) = delete;

  ucp_context_h get() const { return context_; }
  // ucp_context_print_info as text (for logs and the capability detail).
  std::string Info() const;

 private:
  explicit UcxContext(ucp_context_h c) : context_(c) {}
  ucp_context_h context_;
};

class UcxWorker {
 public:
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(const UcxContext& context);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  ucp_worker_h get() const { return worker_; }
  // The packed worker address (ucp_worker_get_address), as bytes a peer can connect to.
  const std::string& address() const { return address_; }
  // The file descriptor that becomes readable when the worker has events (after Arm).
  int event_fd() const { return event_fd_; }

 private:
  UcxWorker(ucp_worker_h w, std::string address, int efd)
      : worker_(w), address_(std::move(address)), event_fd_(efd) {}
  ucp_worker_h worker_;
  std::string address_;
  int event_fd_;
};

class UcxEndpoint {
 public:
  struct Options {
    std::string_view remote_address;  // packed worker address of the peer
    bool peer_error_handling = true;  // UCP_ERR_HANDLING_MODE_PEER vs NONE
    ucp_err_handler_cb_t on_error = nullptr;
    void* on_error_arg = nullptr;
  };
  static absl::StatusOr<std::unique_ptr<UcxEndpoint>> Create(const UcxWorker& worker,
                                                             const Options& options);
  // Force-closes the endpoint if StartClose was not called, progressing the worker until the
  // close completes (bounded); callbacks of requests still on it run with an error.
  ~UcxEndpoint();
  UcxEndpoint(const UcxEndpoint&) = delete;
  UcxEndpoint& operator=(const UcxEndpoint&) = delete;

  ucp_ep_h get() const { return ep_; }
  // ucp_ep_print_info as text: lane-to-transport map used to choose put vs active messages.
  std::string Info() const;
  // Starts closing (UCP_EP_CLOSE_FLAG_FORCE when `force`) and gives up the handle. Returns the
  // close request to progress and free, NULL when closed at once, or an error pointer.
  ucs_status_ptr_t StartClose(bool force);

 private:
  UcxEndpoint(ucp_worker_h w, ucp_ep_h ep) : worker_(w), ep_(ep) {}
  ucp_worker_h worker_;
  ucp_ep_h ep_;
};

// A local registration (ucp_mem_map of caller memory) and its packed remote key.
class UcxMemRegion {
 public:
  static absl::StatusOr<std::unique_ptr<UcxMemRegion>> Map(const UcxContext& context, void* base,
                                                           uint64_t length);
  // Lets UCX allocate the memory (UCP_MEM_MAP_ALLOCATE: a sysv/posix shared-memory segment when
  // those transports are enabled), freed by the destructor.
  static absl::StatusOr<std::unique_ptr<UcxMemRegion>> Allocate(const UcxContext& context,
                                                                uint64_t length);
  ~UcxMemRegion();
  UcxMemRegion(const UcxMemRegion&) = delete;
  UcxMemRegion& operator=(const UcxMemRegion&) = delete;

  uint8_t* base() const { return base_; }
  uint64_t length() const { return length_; }
  const std::string& packed_rkey() const { return rkey_; }

 private:
  static absl::StatusOr<std::unique_ptr<UcxMemRegion>> MapImpl(const UcxContext& context,
                                                               void* base, uint64_t length,
                                                               bool allocate);
  UcxMemRegion(ucp_context_h c, ucp_mem_h m, uint8_t* base, uint64_t length, std::string rkey)
      : context_(c), memh_(m), base_(base), length_(length), rkey_(std::move(rkey)) {}
  ucp_context_h context_;
  ucp_mem_h memh_;
  uint8_t* base_;
  uint64_t length_;
  std::string rkey_;
};

// A peer's remote key unpacked on one of our endpoints (ucp_ep_rkey_unpack).
class UcxRemoteKey {
 public:
  static absl::StatusOr<std::unique_ptr<UcxRemoteKey>> Unpack(ucp_ep_h ep,
                                                              std::string_view packed);
  ~UcxRemoteKey();
  UcxRemoteKey(const UcxRemoteKey&) = delete;
  UcxRemoteKey& operator=(const UcxRemoteKey&) = delete;

  ucp_rkey_h get() const { return rkey_; }

 private:
  explicit UcxRemoteKey(ucp_rkey_h r) : rkey_(r) {}
  ucp_rkey_h rkey_;
};

}  // namespace tandem::transfer::ucx
