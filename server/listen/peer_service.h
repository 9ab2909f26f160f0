// The peer listener (--peer-address): a gRPC server of its own on TCP that
// serves weightd.v1.Peer (proto/weightd/v1/peer.proto) and the standard
// health service, nothing else (no reflection, none of weightd.v1.Weightd):
// what crosses it is read-only. Plain TCP or mutual TLS (--peer-tls-*), with
// connections accepted as AddTcpPort (server/listen/tcp_listener.h) describes.
//
// Each Transfer call is a callback reactor holding one PeerSeed::Session:
// opened on the joiner's first message, described in one reply, ended when
// the joiner says done, goes away (the call is cancelled), or the session
// limit passes (DEADLINE_EXCEEDED, from a reaper thread).
//
// Thread-safety: Start and Shutdown from one thread.
#ifndef WEIGHTD_SERVER_LISTEN_PEER_SERVICE_H_
#define WEIGHTD_SERVER_LISTEN_PEER_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/listen/grpc_limits.h"
#include "server/listen/grpc_acceptor.h"
#include "server/metrics/metrics.h"
#include "server/peer/peer_seed.h"

namespace weightd {

// Where and how the peer listener listens (the peer_* keys of the config).
struct PeerListenerOptions {
  std::string address;  // --peer-address, "HOST:PORT"; port 0 picks one
  // Mutual TLS: all three set (--peer-tls-cert, --peer-tls-key,
  // --peer-tls-ca), or none for plain TCP.
  std::string tls_cert, tls_key, tls_ca;
  GrpcServerLimits limits;
};

class PeerListener {
 public:
  // Listens on options.address for
  // `seed`, which must outlive this; counts calls in `metrics`.
  // UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<PeerListener>> Start(const PeerListenerOptions& options, PeerSeed* seed,
                                                             Metrics* metrics);
  ~PeerListener();  // Shutdown()

  grpc::Server* server() { return server_.get(); }
  int port() const { return port_; }
  // Ends every session (UNAVAILABLE) and the server.
  void Shutdown();

  class Service;

 private:
  PeerListener();
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<GrpcAcceptor> acceptor_;  // plain TCP only
  int port_ = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LISTEN_PEER_SERVICE_H_
