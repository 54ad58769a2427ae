// The one absl <-> gRPC status conversion keeps every code and the message, and never produces
// an invalid enum value.
#include "services/common/grpc_status.h"

#include "gtest/gtest.h"

namespace tandem::services {
namespace {

TEST(GrpcStatusTest, EveryCodeRoundTripsWithItsMessage) {
  for (int c = 1; c <= 16; ++c) {
    const absl::Status in(static_cast<absl::StatusCode>(c), "why " + std::to_string(c));
    const grpc::Status g = ToGrpcStatus(in);
    EXPECT_EQ(static_cast<int>(g.error_code()), c);
    EXPECT_EQ(g.error_message(), "why " + std::to_string(c));
    EXPECT_EQ(FromGrpcStatus(g), in);
  }
  EXPECT_TRUE(ToGrpcStatus(absl::OkStatus()).ok());
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
}

TEST(GrpcStatusTest, NamedCodesMatch) {
  EXPECT_EQ(ToGrpcStatus(absl::DataLossError("x")).error_code(), grpc::StatusCode::DATA_LOSS);
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("x")).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(ToGrpcStatus(absl::FailedPreconditionError("x")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "x")).code(),
            absl::StatusCode::kUnavailable);
}

TEST(GrpcStatusTest, UnknownCodesBecomeUnknown) {
  const absl::Status odd(static_cast<absl::StatusCode>(42), "from the future");
  EXPECT_EQ(ToGrpcStatus(odd).error_code(), grpc::StatusCode::UNKNOWN);
  // (grpc::StatusCode has no fixed underlying type, so an out-of-range one cannot even be
  // constructed without undefined behaviour; only the absl side needs the guard.)
}

TEST(GrpcStatusTest, DeadlinesConvertBothWays) {
  EXPECT_EQ(FromChronoDeadline(std::chrono::system_clock::time_point::max()),
            absl::InfiniteFuture());
  EXPECT_EQ(ToChronoDeadline(absl::InfiniteFuture()), std::chrono::system_clock::time_point::max());
  const absl::Time t = absl::FromUnixMillis(1700000000123);
  EXPECT_EQ(FromChronoDeadline(ToChronoDeadline(t)), t);
}

}  // namespace
}  // namespace tandem::services
