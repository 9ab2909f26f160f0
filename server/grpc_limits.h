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

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_LIMITS_H_
