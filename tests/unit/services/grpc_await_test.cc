// services/common/grpc_await.h against a real gRPC server: a task awaits a unary call, a timer
// and a server stream; a stream whose server finishes while the task is busy elsewhere still
// delivers every message and its status; a cancelled stream ends.
#include "services/common/grpc_await.h"

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/util/task.h"
#include "gtest/gtest.h"
#include "tandem/v1/worker.grpc.pb.h"

namespace tandem::services {
namespace {

// Streams `tokens` messages as fast as it can and ends, or answers Cancel with found = true.
class StreamingWorker final : public v1::DecodeWorker::Service {
 public:
  grpc::Status Decode(grpc::ServerContext* ctx, const v1::DecodeRequest* req,
                      grpc::ServerWriter<v1::GenerateResponse>* w) override {
    const int n = req->sampling().max_tokens();
    for (int i = 0; i < n; ++i) {
      v1::GenerateResponse m;
      m.add_token_ids(i);
      m.set_finished(i + 1 == n);
      if (!w->Write(m)) return grpc::Status::CANCELLED;
    }
    if (req->request_id() == "forever") {  // holds the stream open until cancelled
      while (!ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(5));
      return grpc::Status::CANCELLED;
    }
    return grpc::Status(grpc::StatusCode::OUT_OF_RANGE, "done: " + req->request_id());
  }
  grpc::Status Cancel(grpc::ServerContext*, const v1::CancelRequest* req,
                      v1::CancelResponse* resp) override {
    resp->set_found(req->request_id() == "known");
    return grpc::Status::OK;
  }
};

class GrpcAwaitTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&worker_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::DecodeWorker::NewStub(grpc::CreateChannel(
        "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { server_->Shutdown(); }

  StreamingWorker worker_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::DecodeWorker::Stub> stub_;
};

struct StreamResult {
  std::vector<int32_t> tokens;
  grpc::Status status;
  absl::Notification done;
};

// Reads the whole stream, pausing `pause` after each message: the server has long finished
// by the time the later reads are made.
Task<void> ReadAll(v1::DecodeWorker::Stub* stub, std::string id, int n, absl::Duration pause,
                   StreamResult* out) {
  grpc::ClientContext cc;
  cc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::DecodeRequest req;
  req.set_request_id(id);
  req.mutable_sampling()->set_max_tokens(n);
  StreamReader<v1::GenerateResponse> reader;
  stub->async()->Decode(&cc, &req, &reader);
  v1::GenerateResponse m;
  while (co_await reader.Read(&m)) {
    for (int32_t t : m.token_ids()) out->tokens.push_back(t);
    co_await SleepUntil(absl::Now() + pause);
  }
  out->status = co_await reader.Finish();
  out->done.Notify();
}

TEST_F(GrpcAwaitTest, AStreamFinishedWhileTheTaskWasBusyStillDeliversEverything) {
  StreamResult r;
  Spawn(ReadAll(stub_.get(), "slow-reader", 6, absl::Milliseconds(30), &r));
  ASSERT_TRUE(r.done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(r.tokens, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::OUT_OF_RANGE);
  EXPECT_EQ(r.status.error_message(), "done: slow-reader");
}

TEST_F(GrpcAwaitTest, ManyConcurrentStreamsEachGetTheirOwnMessages) {
  std::vector<std::unique_ptr<StreamResult>> rs;
  for (int i = 0; i < 64; ++i) {
    rs.push_back(std::make_unique<StreamResult>());
    Spawn(ReadAll(stub_.get(), "s" + std::to_string(i), 1 + i % 9, absl::ZeroDuration(),
                  rs.back().get()));
  }
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE(rs[i]->done.WaitForNotificationWithTimeout(absl::Seconds(20))) << i;
    EXPECT_EQ(rs[i]->tokens.size(), static_cast<size_t>(1 + i % 9));
    EXPECT_EQ(rs[i]->status.error_message(), "done: s" + std::to_string(i));
  }
}

Task<void> CancelMidStream(v1::DecodeWorker::Stub* stub, StreamResult* out) {
  grpc::ClientContext cc;
  v1::DecodeRequest req;
  req.set_request_id("forever");
  req.mutable_sampling()->set_max_tokens(2);
  StreamReader<v1::GenerateResponse> reader;
  stub->async()->Decode(&cc, &req, &reader);
  v1::GenerateResponse m;
  while (co_await reader.Read(&m)) {
    for (int32_t t : m.token_ids()) out->tokens.push_back(t);
    if (m.finished()) cc.TryCancel();  // the server would hold the stream open for ever
  }
  out->status = co_await reader.Finish();
  out->done.Notify();
}

TEST_F(GrpcAwaitTest, ACancelledStreamEnds) {
  StreamResult r;
  Spawn(CancelMidStream(stub_.get(), &r));
  ASSERT_TRUE(r.done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_EQ(r.tokens, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::CANCELLED);
}

Task<void> UnaryThenSleep(v1::DecodeWorker::Stub* stub, bool* found, absl::Duration* slept,
                          absl::Notification* done) {
  grpc::ClientContext cc;
  v1::CancelRequest rq;
  rq.set_request_id("known");
  v1::CancelResponse resp;
  const grpc::Status st = co_await Unary(
      [&](auto cb) { stub->async()->Cancel(&cc, &rq, &resp, std::move(cb)); });
  *found = st.ok() && resp.found();
  const absl::Time start = absl::Now();
  co_await SleepUntil(start + absl::Milliseconds(50));
  co_await Hop();
  *slept = absl::Now() - start;
  done->Notify();
}

TEST_F(GrpcAwaitTest, UnaryCallTimerAndHop) {
  bool found = false;
  absl::Duration slept;
  absl::Notification done;
  Spawn(UnaryThenSleep(stub_.get(), &found, &slept, &done));
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20)));
  EXPECT_TRUE(found);
  EXPECT_GE(slept, absl::Milliseconds(50));
  EXPECT_LT(slept, absl::Seconds(5));
}

}  // namespace
}  // namespace tandem::services
