#include "services/common/grpc_status.h"

#include <string>

#include "absl/strings/cord.h"

namespace tandem::services {
namespace {
// google.rpc.Code runs from OK (0) to UNAUTHENTICATED (16).
constexpr int kMaxCode = 16;
}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& st) {
  if (st.ok()) return grpc::Status::OK;
  int code = static_cast<int>(st.code());
  if (code < 1 || code > kMaxCode) code = static_cast<int>(grpc::StatusCode::UNKNOWN);
  return grpc::Status(static_cast<grpc::StatusCode>(code), std::string(st.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& st) {
  if (st.ok()) return absl::OkStatus();
  int code = static_cast<int>(st.error_code());
  if (code < 1 || code > kMaxCode) code = static_cast<int>(absl::StatusCode::kUnknown);
  return absl::Status(static_cast<absl::StatusCode>(code), st.error_message());
}

std::chrono::system_clock::time_point ToChronoDeadline(absl::Time t) {
  if (t == absl::InfiniteFuture()) return std::chrono::system_clock::time_point::max();
  if (t == absl::InfinitePast()) return std::chrono::system_clock::time_point::min();
  return absl::ToChronoTime(t);
}

absl::Time FromChronoDeadline(std::chrono::system_clock::time_point t) {
  if (t == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  const absl::Time at = absl::FromChrono(t);
  // gRPC's "no deadline" can arrive as gpr_inf_future converted to a far time point.
  if (at > absl::Now() + absl::Hours(24 * 365 * 100)) return absl::InfiniteFuture();
  return at;
}

absl::Status MarkDestinationFault(absl::Status st) {
  if (!st.ok()) st.SetPayload(kFaultKey, absl::Cord(kFaultDestination));
  return st;
}

bool IsDestinationFault(const absl::Status& st) {
  const auto p = st.GetPayload(kFaultKey);
  return p.has_value() && *p == kFaultDestination;
}

}  // namespace tandem::services
