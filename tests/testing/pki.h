// A throwaway PKI for TLS tests, made with /usr/bin/openssl in `dir`:
//   ca.pem / ca.key              the CA every certificate below but rogue* is signed by
//   server.pem / .key            serverAuth, for 127.0.0.1 and localhost
//   client.pem / .key            clientAuth
//   node-a.pem, node-b.pem / .key  serverAuth and clientAuth, 127.0.0.1 and localhost
//                                (a weightd node: seed and joiner at once)
//   rogue-ca.pem; rogue.pem, rogue-node.pem / .key  the same kinds signed by an unrelated CA
#ifndef WEIGHTD_TESTS_TESTING_PKI_H_
#define WEIGHTD_TESTS_TESTING_PKI_H_

#include <string>

#include "tests/testing/shared_inputs.h"

namespace weightd::testing {

inline constexpr char kOpenssl[] = "/usr/bin/openssl";

// False (with openssl's output in *log) when a certificate could not be made.
bool MakeCertificates(const TempDir& dir, std::string* log);

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_PKI_H_
