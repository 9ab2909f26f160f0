// The bounds every gRPC server of the daemon (the Unix socket's, the TCP
// listener's, the peer listener's) applies: --grpc-max-threads,
// --grpc-max-streams-per-connection, --grpc-max-connections and
// --grpc-first-bytes-timeout-seconds (docs/operations.md "Reliability").
#ifndef WEIGHTD_SERVER_LISTEN_GRPC_LIMITS_H_
#define WEIGHTD_SERVER_LISTEN_GRPC_LIMITS_H_

#include <grpcpp/server_builder.h>

#include <chrono>

namespace weightd {

struct GrpcServerLimits {
  int max_threads = 64;                  // sync-server threads in calls at once
  int max_streams_per_connection = 16;   // concurrent calls on one connection
  size_t max_connections = 1024;         // per listener our GrpcAcceptor serves
  // A connection silent this long is closed (grpc_acceptor.h); for TLS
  // listeners, the bound on the handshake.
  std::chrono::milliseconds first_bytes_timeout{10000};
};

// A ResourceQuota capping the server's handler threads (calls beyond it get
// RESOURCE_EXHAUSTED; grpc::ResourceQuota::SetMaxThreads) and
// GRPC_ARG_MAX_CONCURRENT_STREAMS per connection. Call before BuildAndStart.
void ApplyGrpcLimits(const GrpcServerLimits& limits, grpc::ServerBuilder& builder);

// Makes gRPC's own listeners of `builder` bind without SO_REUSEPORT, which
// gRPC sets by default (GRPC_ARG_ALLOW_REUSEPORT): with it a second daemon
// binds a port another already listens on and the kernel spreads
// connections between the two, so probes get either daemon's answer. Without
// it the second bind fails (EADDRINUSE) and BuildAndStart returns no server.
void RefuseSharedPort(grpc::ServerBuilder& builder);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LISTEN_GRPC_LIMITS_H_
