#include "tests/testing/pki.h"

#include "absl/strings/str_cat.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"

namespace weightd::testing {

bool MakeCertificates(const TempDir& dir, std::string* log) {
  std::string script = R"(set -e
key() { openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -out "$1.csr" -subj "/CN=$1" 2>/dev/null; }
ca() { openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$1.key" -out "$1.pem" -days 2 -subj "/CN=$1" 2>/dev/null; }
sign() { openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -set_serial "$4" -days 2 -out "$1.pem" -extfile "$3" 2>/dev/null; }
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n' > server.ext
printf 'extendedKeyUsage=clientAuth\n' > client.ext
printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' > node.ext
ca ca; ca rogue-ca
key server; sign server ca server.ext 1
key client; sign client ca client.ext 2
key rogue; sign rogue rogue-ca client.ext 3
key node-a; sign node-a ca node.ext 4
key node-b; sign node-b ca node.ext 5
key rogue-node; sign rogue-node rogue-ca node.ext 6
)";
  WriteFile(dir.Join("make-certs.sh"), script);
  CommandResult r = RunCommand({"/bin/sh", "-c", absl::StrCat("cd '", dir.path(), "' && sh make-certs.sh")});
  *log = r.out + r.err;
  return r.code == 0;
}

}  // namespace weightd::testing
