#include "common/transfer/ucx/ucx_wrappers.h"

#include <cstdio>
#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"

namespace tandem::transfer::ucx {
namespace {

// Captures what a ucp_*_print_info function writes to a FILE*.
template <typename Fn>
std::string CaptureStream(Fn&& print) {
  char* buf = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&buf, &size);
  if (f == nullptr) return {};
  print(f);
  std::fclose(f);
  std::string out(buf, size);
  std::free(buf);
  return out;
}

// Progresses `worker` until `request` completes or ~2 s pass, then frees it. Only used where
// the owner cannot keep the request for its own loop (destructors).
void WaitAndFree(ucp_worker_h worker, ucs_status_ptr_t request) {
  if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
  for (int i = 0; i < 2'000'000 && ucp_request_check_status(request) == UCS_INPROGRESS; ++i) {
    ucp_worker_progress(worker);
  }
  ucp_request_free(request);
}

}  // namespace

absl::Status FromUcsStatus(ucs_status_t status, std::string_view context) {
  if (status == UCS_OK) return absl::OkStatus();
  std::string msg = absl::StrCat(std::string(context), ": ", ucs_status_string(status));
  switch (status) {
    case UCS_INPROGRESS:
      return absl::InternalError(absl::StrCat(msg, " (unexpectedly in progress)"));
    case UCS_ERR_CANCELED:
      return absl::CancelledError(msg);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(msg);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_INVALID_ADDR:
    case UCS_ERR_MESSAGE_TRUNCATED:
      return absl::InvalidArgumentError(msg);
    case UCS_ERR_NO_ELEM:
      return absl::NotFoundError(msg);
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
    case UCS_ERR_OUT_OF_RANGE:
      return absl::ResourceExhaustedError(msg);
    case UCS_ERR_UNSUPPORTED:
    case UCS_ERR_NOT_IMPLEMENTED:
      return absl::UnimplementedError(msg);
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_SHMEM_SEGMENT:
    case UCS_ERR_BUSY:
      return absl::UnavailableError(msg);
    case UCS_ERR_NO_PROGRESS:
      return absl::AbortedError(msg);
    default:
      return absl::InternalError(msg);
  }
}

// --- UcxContext ---

absl::StatusOr<std::unique_ptr<UcxContext>> UcxContext::Create(
    const std::vector<std::pair<std::string, std::string>>& settings, uint64_t features) {
  ucp_config_t* config = nullptr;
  // NULL prefix/file: the defaults UCX would use, without our own overrides file.
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return FromUcsStatus(st, "ucp_config_read");
  std::string described;
  for (const auto& [key, value] : settings) {
    st = ucp_config_modify(config, key.c_str(), value.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return FromUcsStatus(st, absl::StrCat("ucp_config_modify ", key, "=", value));
    }
    absl::StrAppend(&described, described.empty() ? "" : " ", key, "=", value);
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features = features;
  params.mt_workers_shared = 0;
  ucp_context_h context = nullptr;
  st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (st != UCS_OK) return FromUcsStatus(st, absl::StrCat("ucp_init (", described, ")"));
  return std::unique_ptr<UcxContext>(new UcxContext(context));
}

UcxContext::~UcxContext() { ucp_cleanup(context_); }

std::string UcxContext::Info() const {
  return CaptureStream([this](FILE* f) { ucp_context_print_info(context_, f); });
}

// --- UcxWorker ---

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(const UcxContext& context) {
  ucp_worker_params_t params{};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // Serialized, not single: the transport's progress thread and, when that thread is asleep,
  // a thread issuing a write call into the worker, one at a time under the transport's lock.
  params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  ucs_status_t st = ucp_worker_create(context.get(), &params, &worker);
  if (st != UCS_OK) return FromUcsStatus(st, "ucp_worker_create");

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  st = ucp_worker_get_address(worker, &addr, &addr_len);
  if (st != UCS_OK) {
    ucp_worker_destroy(worker);
    return FromUcsStatus(st, "ucp_worker_get_address");
  }
  std::string address(reinterpret_cast<const char*>(addr), addr_len);
  ucp_worker_release_address(worker, addr);

  int efd = -1;
  st = ucp_worker_get_efd(worker, &efd);
  if (st != UCS_OK) {
    ucp_worker_destroy(worker);
    return FromUcsStatus(st, "ucp_worker_get_efd");
  }
  return std::unique_ptr<UcxWorker>(new UcxWorker(worker, std::move(address), efd));
}

UcxWorker::~UcxWorker() { ucp_worker_destroy(worker_); }  // also closes event_fd_

// --- UcxEndpoint ---

absl::StatusOr<std::unique_ptr<UcxEndpoint>> UcxEndpoint::Create(const UcxWorker& worker,
                                                                 const Options& options) {
  ucp_ep_params_t params{};
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(options.remote_address.data());
  params.err_mode =
      options.peer_error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (options.on_error != nullptr) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_handler.cb = options.on_error;
    params.err_handler.arg = options.on_error_arg;
  }
  ucp_ep_h ep = nullptr;
  ucs_status_t st = ucp_ep_create(worker.get(), &params, &ep);
  if (st != UCS_OK) return FromUcsStatus(st, "ucp_ep_create");
  return std::unique_ptr<UcxEndpoint>(new UcxEndpoint(worker.get(), ep));
}

UcxEndpoint::~UcxEndpoint() {
  if (ep_ != nullptr) WaitAndFree(worker_, StartClose(/*force=*/true));
}

std::string UcxEndpoint::Info() const {
  return CaptureStream([this](FILE* f) { ucp_ep_print_info(ep_, f); });
}

ucs_status_ptr_t UcxEndpoint::StartClose(bool force) {
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep_, &param);
  ep_ = nullptr;
  return req;
}

// --- UcxMemRegion ---

absl::StatusOr<std::unique_ptr<UcxMemRegion>> UcxMemRegion::Map(const UcxContext& context,
                                                                 void* base, uint64_t length) {
  return MapImpl(context, base, length, /*allocate=*/false);
}

absl::StatusOr<std::unique_ptr<UcxMemRegion>> UcxMemRegion::Allocate(const UcxContext& context,
                                                                      uint64_t length) {
  return MapImpl(context, nullptr, length, /*allocate=*/true);
}

absl::StatusOr<std::unique_ptr<UcxMemRegion>> UcxMemRegion::MapImpl(const UcxContext& context,
                                                                     void* base, uint64_t length,
                                                                     bool allocate) {
  ucp_mem_map_params_t params{};
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = base;
  params.length = length;
  params.flags = allocate ? UCP_MEM_MAP_ALLOCATE : 0;
  ucp_mem_h memh = nullptr;
  ucs_status_t st = ucp_mem_map(context.get(), &params, &memh);
  if (st != UCS_OK) return FromUcsStatus(st, absl::StrCat("ucp_mem_map of ", length, " bytes"));
  if (allocate) {
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS;
    st = ucp_mem_query(memh, &attr);
    if (st != UCS_OK) {
      ucp_mem_unmap(context.get(), memh);
      return FromUcsStatus(st, "ucp_mem_query");
    }
    base = attr.address;
  }
  void* rkey_buf = nullptr;
  size_t rkey_len = 0;
  st = ucp_rkey_pack(context.get(), memh, &rkey_buf, &rkey_len);
  if (st != UCS_OK) {
    ucp_mem_unmap(context.get(), memh);
    return FromUcsStatus(st, "ucp_rkey_pack");
  }
  std::string rkey(static_cast<const char*>(rkey_buf), rkey_len);
  ucp_rkey_buffer_release(rkey_buf);
  return std::unique_ptr<UcxMemRegion>(
      new UcxMemRegion(context.get(), memh, static_cast<uint8_t*>(base), length, std::move(rkey)));
}

UcxMemRegion::~UcxMemRegion() { ucp_mem_unmap(context_, memh_); }

// --- UcxRemoteKey ---

absl::StatusOr<std::unique_ptr<UcxRemoteKey>> UcxRemoteKey::Unpack(ucp_ep_h ep,
                                                                   std::string_view packed) {
  if (packed.empty()) return absl::InvalidArgumentError("descriptor carries no remote key");
  ucp_rkey_h rkey = nullptr;
  ucs_status_t st = ucp_ep_rkey_unpack(ep, packed.data(), &rkey);
  if (st != UCS_OK) return FromUcsStatus(st, "ucp_ep_rkey_unpack");
  return std::unique_ptr<UcxRemoteKey>(new UcxRemoteKey(rkey));
}

UcxRemoteKey::~UcxRemoteKey() { ucp_rkey_destroy(rkey_); }

}  // namespace tandem::transfer::ucx
