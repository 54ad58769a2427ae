// A real RouterServer on loopback, serving the tiny model, with fake workers (gRPC services the
// test supplies) registered behind it: the setup the router's in-process tests share.
//
// The tiny GGUF is written once per test suite; each test starts its own router and workers,
// and TearDown shuts them down (workers first, so no call is left waiting on them).
#pragma once

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "services/router/router_server.h"
#include "tandem/v1/inference.grpc.pb.h"
#include "tandem/v1/worker.grpc.pb.h"
#include "tests/fakes/tiny_model.h"

namespace tandem::router {

class RouterFixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_path_ = new std::string((std::filesystem::temp_directory_path() /
                                   absl::StrCat("router-tiny-", getpid(), ".gguf"))
                                      .string());
    ASSERT_TRUE(testing::WriteTinyModel(testing::TinyModelOptions(), *model_path_).ok());
  }
  static void TearDownTestSuite() {
    std::filesystem::remove(*model_path_);
    delete model_path_;
    model_path_ = nullptr;
  }
  void TearDown() override {
    for (auto& s : servers_) s->Shutdown(std::chrono::system_clock::now());
    if (router_) router_->Shutdown(absl::ZeroDuration());
  }

  // Starts the router on a loopback port with the tiny model, a 30 s worker lease and the HTTP
  // front door on; everything else comes from `o`.
  void StartRouter(RouterOptions o) {
    o.model_path = *model_path_;
    o.host = "127.0.0.1";
    o.port = 0;
    o.worker_lease = absl::Seconds(30);
    HttpFrontOptions h;
    h.enabled = true;
    auto r = RouterServer::Create(o, h);
    ASSERT_TRUE(r.ok()) << r.status();
    router_ = std::move(*r);
    ASSERT_GT(router_->http_port(), 0);
    channel_ = grpc::CreateChannel(router_->address(), grpc::InsecureChannelCredentials());
    inference_ = v1::Inference::NewStub(channel_);
    registry_ = v1::Registry::NewStub(channel_);
  }

  // Serves `svc` on a loopback port and registers it with the router as `id` in `role`.
  void HostWorker(grpc::Service* svc, const std::string& id, v1::WorkerRole role) {
    int port = 0;
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(svc);
    servers_.push_back(b.BuildAndStart());
    ASSERT_GT(port, 0);
    v1::RegisterRequest rq;
    rq.set_worker_id(id);
    rq.set_role(role);
    rq.set_address(absl::StrCat("127.0.0.1:", port));
    rq.set_model(*model_path_);
    rq.set_kv_blocks_total(100);
    v1::RegisterResponse resp;
    grpc::ClientContext cc;
    ASSERT_TRUE(registry_->Register(&cc, rq, &resp).ok());
  }

  static inline std::string* model_path_ = nullptr;
  std::unique_ptr<RouterServer> router_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Inference::Stub> inference_;
  std::unique_ptr<v1::Registry::Stub> registry_;
  std::vector<std::unique_ptr<grpc::Server>> servers_;
};

}  // namespace tandem::router
