// Throw-away certificate authorities for TLS tests, made with the `openssl` command line at
// test time (nothing secret is committed). Two CAs: `ca` signs a server certificate (for
// localhost / 127.0.0.1, usable for client auth too) and a client certificate; `other_ca` signs
// a client certificate no server of the test trusts.
//
// Errors: FAILED_PRECONDITION when openssl is missing or fails (tests skip on it).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace tandem::testing {

struct TestPki {
  std::string dir;
  std::string ca, other_ca;             // CA certificates (PEM)
  std::string server_cert, server_key;  // signed by ca; SAN localhost, 127.0.0.1
  std::string client_cert, client_key;  // signed by ca
  std::string rogue_cert, rogue_key;    // signed by other_ca
};

absl::StatusOr<TestPki> MakeTestPki(const std::string& dir);

}  // namespace tandem::testing
