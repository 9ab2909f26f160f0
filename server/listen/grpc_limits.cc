#include "server/listen/grpc_limits.h"

#include <grpcpp/resource_quota.h>

namespace weightd {

void ApplyGrpcLimits(const GrpcServerLimits& limits, grpc::ServerBuilder& builder) {
  grpc::ResourceQuota quota("weightd");
  quota.SetMaxThreads(limits.max_threads);
  builder.SetResourceQuota(quota);  // the builder keeps its own reference
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, limits.max_streams_per_connection);
}

void RefuseSharedPort(grpc::ServerBuilder& builder) { builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0); }

}  // namespace weightd
