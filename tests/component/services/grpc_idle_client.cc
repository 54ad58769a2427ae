// A gRPC client that makes one call to a server and then sits idle with its connection open,
// in its own process: no thread here polls the connection, as with a real idle client, so it
// reads a server's GOAWAY only at gRPC's next backup poll. Used by grpc_server_test.
// Usage: grpc_idle_client HOST:PORT READY_FILE  (writes READY_FILE after the call, then sleeps
// until killed; exits 1 when the call fails).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "grpcpp/grpcpp.h"
#include "tandem/v1/worker.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: grpc_idle_client HOST:PORT READY_FILE\n");
    return 2;
  }
  auto channel = grpc::CreateChannel(argv[1], grpc::InsecureChannelCredentials());
  auto stub = tandem::v1::Registry::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  tandem::v1::HeartbeatRequest req;
  tandem::v1::HeartbeatResponse resp;
  const grpc::Status st = stub->Heartbeat(&ctx, req, &resp);
  if (!st.ok()) {
    std::fprintf(stderr, "grpc_idle_client: %s\n", st.error_message().c_str());
    return 1;
  }
  std::ofstream(argv[2]) << "ready\n";
  for (;;) pause();
}
