// The daemon's self-check: probes every listening socket the way a client
// would, so the systemd watchdog is fed only while the API really answers.
//
//   gRPC Unix socket, plain TCP listener, health port: a fresh connection
//     (never a cached one) and a grpc.health.v1 Check("") that must say SERVING;
//   every TCP listener: a TCP connection, and the listening socket's accept
//     queue (TCP_INFO tcpi_unacked of a LISTEN socket, tcp(7); ss's Recv-Q)
//     must become empty within the deadline;
//   fd socket: a fresh connection, "CLAIM self-check", and any "ERR ..." reply
//     (the poll thread read and answered it).
//
// Thread-safety: ProbeListeners may be called from any thread.
#ifndef WEIGHTD_SERVER_OPS_SELF_CHECK_H_
#define WEIGHTD_SERVER_OPS_SELF_CHECK_H_

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace weightd {

struct SelfCheckTargets {
  std::string grpc_socket;                // path of the gRPC Unix socket
  std::string fd_socket;                  // path of the fd socket
  std::vector<std::string> grpc_targets;  // "HOST:PORT" of each TCP listener to health-check (the health port)
  // "HOST:PORT" of each TCP listener of this process whose accepting is
  // checked: a connection is made and the socket's accept queue must empty
  // within the deadline. A TLS listener cannot be health-checked without a
  // client certificate, and one at its connection limit closes the probe,
  // but either still accepts: what wedges (gRPC's listener after EMFILE)
  // is accepting, and the queue shows it.
  std::vector<std::string> accepting;
};

// OK when every listener answered within `deadline` (each); otherwise
// UNAVAILABLE naming the first one that did not, and why.
absl::Status ProbeListeners(const SelfCheckTargets& targets, std::chrono::milliseconds deadline);

// "0.0.0.0:0" bound to port 41234 -> "127.0.0.1:41234": where a local probe
// reaches a listener (wildcard hosts become loopback).
std::string LocalTarget(const std::string& address, int port);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_OPS_SELF_CHECK_H_
