// The optional gRPC TCP listener (--grpc-address): a gRPC server of its own,
// apart from the Unix socket's, so that what it serves is decided by how it
// is secured, not by which socket a call happened to arrive on.
//
//   plain TCP or server-only TLS   read-only: ListModels, GetManifest, WatchModel, health
//                                  and reflection; LoadModel, UnloadModel,
//                                  Attach and Detach answer PERMISSION_DENIED
//   mutual TLS (client CA set)     the same, or with --grpc-tcp-admin every
//                                  method, for clients whose certificate the
//                                  client CA signed
//
// The rules for the configuration (admin needs mutual TLS) are checked by
// ParseDaemonArgs; Start re-checks them so no caller can open the door.
// Requires grpc::EnableDefaultHealthCheckService(true) before Start.
// Thread-safety: Start and Shutdown from one thread.
#ifndef WEIGHTD_SERVER_LISTEN_TCP_LISTENER_H_
#define WEIGHTD_SERVER_LISTEN_TCP_LISTENER_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/listen/grpc_acceptor.h"
#include "server/listen/grpc_limits.h"
#include "server/metrics/metrics.h"
#include "server/api/service.h"

namespace weightd {

// A TCP socket bound to "HOST:PORT" (IPv4, "[IPv6]", or a name; port 0
// picks one) and listening; the bound port in *port. Errors name `flag`.
absl::StatusOr<ScopedFd> ListenTcp(const std::string& address, int* port, const std::string& flag);

// The PEM files of a TLS server, and the flags that name them in errors.
// `ca` empty: no client certificate is asked for; set: one it signed is
// required (mutual TLS).
struct ServerTlsFiles {
  std::string cert, key, ca;
  std::string cert_flag, key_flag, ca_flag;
};
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> ServerTlsCredentials(const ServerTlsFiles& files);

// A TCP port of a gRPC server (grpc_address, peer_address), in two steps.
// Before BuildAndStart, AddTcpPort: without `tls`, binds `address` now
// (ListenTcp; *port set) and returns the listener, which AcceptTcp then
// serves through a GrpcAcceptor (connections bounded by
// limits.max_connections, first bytes within limits.first_bytes_timeout).
// With `tls`, gRPC's own listener takes the port (it cannot take TLS
// connections from an fd; *port set by BuildAndStart), the TLS handshake
// must finish within limits.first_bytes_timeout, and gRPC 1.51 caps no
// connection count; an invalid fd is returned and AcceptTcp returns null.
absl::StatusOr<ScopedFd> AddTcpPort(const GrpcServerLimits& limits, const std::string& address,
                                    const std::string& flag, const std::shared_ptr<grpc::ServerCredentials>& tls,
                                    grpc::ServerBuilder& builder, int* port);
absl::StatusOr<std::unique_ptr<GrpcAcceptor>> AcceptTcp(const GrpcServerLimits& limits, ScopedFd listener,
                                                        const std::string& name, grpc::Server* server);

// What the gRPC TCP listener serves and how (the grpc_* keys of the config).
struct TcpListenerOptions {
  std::string address;          // --grpc-address, "HOST:PORT"; port 0 picks one
  std::string tls_cert;         // --grpc-tls-cert; "" = plain TCP
  std::string tls_key;          // --grpc-tls-key
  std::string tls_client_ca;    // --grpc-tls-client-ca; set = mutual TLS
  bool admin = false;           // --grpc-tcp-admin: every method (needs mutual TLS)
  std::string fd_socket;        // named in Attach replies
  bool mlock = true;            // as WeightdService
  // Attach's reply bodies, shared with the daemon's other services; null:
  // the listener's own.
  std::shared_ptr<AttachEncodingCache> encodings;
  GrpcServerLimits limits;
};

class TcpListener {
 public:
  // Listens on options.address with the credentials and methods the
  // options choose. `registry` and
  // `metrics` must outlive this. INVALID_ARGUMENT for admin without mutual
  // TLS, NOT_FOUND/INVALID_ARGUMENT naming an unreadable PEM file,
  // UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<TcpListener>> Start(const TcpListenerOptions& options, ModelRegistry* registry,
                                                            Metrics* metrics);
  ~TcpListener();  // Shutdown()

  grpc::Server* server() { return server_.get(); }
  int port() const { return port_; }
  // "plain TCP, read-only", "mutual TLS, admin", ...: for the log.
  const std::string& mode() const { return mode_; }
  // Ends open calls within `grace`.
  void Shutdown(std::chrono::milliseconds grace = std::chrono::milliseconds(0));

 private:
  TcpListener() = default;
  std::unique_ptr<WeightdService> full_;
  std::unique_ptr<ReadOnlyWeightdService> read_only_;  // null when admin
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<GrpcAcceptor> acceptor_;  // plain TCP only; stopped before server_ shuts down
  int port_ = 0;
  std::string mode_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LISTEN_TCP_LISTENER_H_
