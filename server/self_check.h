// The daemon's self-check: probes every listening socket the way a client
// would, so the systemd watchdog is fed only while the API really answers.
//
//   gRPC Unix socket, plain TCP listener, health port: a fresh connection
//     (never a cached one) and a grpc.health.v1 Check("") that must say SERVING;
//   TLS TCP listener: a TCP connection that must be accepted;
//   fd socket: a fresh connection, "CLAIM self-check", and any "ERR ..." reply
//     (the poll thread read and answered it).
//
// Thread-safety: ProbeListeners may be called from any thread.
#ifndef WEIGHTD_SERVER_SELF_CHECK_H_
#define WEIGHTD_SERVER_SELF_CHECK_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace weightd {

struct SelfCheckTargets {
  std::string grpc_socket;                // path of the gRPC Unix socket
  std::string fd_socket;                  // path of the fd socket
  std::vector<std::string> grpc_targets;  // "HOST:PORT" of each plain TCP gRPC listener
  // "HOST:PORT" of each TLS listener: only connected to (a plain probe would
  // fail its handshake), which shows that it still accepts.
  std::vector<std::string> connect_targets;
};

// OK when every listener answered within `deadline` (each); otherwise
// UNAVAILABLE naming the first one that did not, and why.
absl::Status ProbeListeners(const SelfCheckTargets& targets, std::chrono::milliseconds deadline);

// "0.0.0.0:0" bound to port 41234 -> "127.0.0.1:41234": where a local probe
// reaches a listener (wildcard hosts become loopback).
std::string LocalTarget(const std::string& address, int port);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_SELF_CHECK_H_
