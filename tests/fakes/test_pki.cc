#include "tests/fakes/test_pki.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace tandem::testing {

absl::StatusOr<TestPki> MakeTestPki(const std::string& dir) {
  std::filesystem::create_directories(dir);
  TestPki p;
  p.dir = dir;
  auto f = [&](const char* name) { return absl::StrCat(dir, "/", name); };
  p.ca = f("ca.pem");
  p.other_ca = f("other_ca.pem");
  p.server_cert = f("server.pem");
  p.server_key = f("server.key");
  p.client_cert = f("client.pem");
  p.client_key = f("client.key");
  p.rogue_cert = f("rogue.pem");
  p.rogue_key = f("rogue.key");
  // EC keys: fast to make. Server and client certificates allow both uses, as a router's own
  // certificate does when it dials its workers.
  const std::string script = absl::StrCat(R"(set -e
cd ')",
                                          dir, R"('
key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:prime256v1 -out "$1" 2>/dev/null; }
printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' > ext.cnf
for ca in ca other_ca; do
  key $ca.key
  openssl req -x509 -new -key $ca.key -out $ca.pem -days 2 -subj "/CN=tandem test $ca" 2>/dev/null
done
leaf() {  # name ca cn
  key $1.key
  openssl req -new -key $1.key -out $1.csr -subj "/CN=$3" 2>/dev/null
  openssl x509 -req -in $1.csr -CA $2.pem -CAkey $2.key -CAcreateserial -out $1.pem -days 2 \
    -extfile ext.cnf 2>/dev/null
}
leaf server ca localhost
leaf client ca tandem-client
leaf rogue other_ca tandem-rogue
)");
  const std::string script_path = f("make_pki.sh");
  {
    std::ofstream out(script_path);
    out << script;
  }
  const int rc = std::system(absl::StrCat("sh '", script_path, "'").c_str());
  if (rc != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("making test certificates with openssl failed (exit ", rc, ")"));
  }
  return p;
}

}  // namespace tandem::testing
