#include "server/grpc_limits.h"

#include <grpcpp/resource_quota.h>

namespace weightd {

void ApplyGrpcLimits(const DaemonConfig& config, grpc::ServerBuilder& builder) {
  grpc::ResourceQuota quota("weightd");
  quota.SetMaxThreads(config.grpc_max_threads);
  builder.SetResourceQuota(quota);  // the builder keeps its own reference
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, config.grpc_max_streams_per_connection);
}

void RefuseSharedPort(grpc::ServerBuilder& builder) { builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0); }

}  // namespace weightd
