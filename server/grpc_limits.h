// The bounds every gRPC server of the daemon (the Unix socket's and the TCP
// listener's) applies, from the config's grpc_max_threads and
// grpc_max_streams_per_connection (docs/operations.md "Reliability").
#ifndef WEIGHTD_SERVER_GRPC_LIMITS_H_
#define WEIGHTD_SERVER_GRPC_LIMITS_H_

#include <grpcpp/server_builder.h>

#include "server/config.h"

namespace weightd {

// A ResourceQuota capping the server's handler threads (calls beyond it get
// RESOURCE_EXHAUSTED; grpc::ResourceQuota::SetMaxThreads) and
// GRPC_ARG_MAX_CONCURRENT_STREAMS per connection. Call before BuildAndStart.
void ApplyGrpcLimits(const DaemonConfig& config, grpc::ServerBuilder& builder);

// Makes gRPC's own listeners of `builder` bind without SO_REUSEPORT, which
// gRPC sets by default (GRPC_ARG_ALLOW_REUSEPORT): with it a second daemon
// binds a port another already listens on and the kernel spreads
// connections between the two, so probes get either daemon's answer. Without
// it the second bind fails (EADDRINUSE) and BuildAndStart returns no server.
void RefuseSharedPort(grpc::ServerBuilder& builder);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_LIMITS_H_
