// The one wrapper that counts and times every RPC: a gRPC server interceptor
// reporting each finished call to Metrics::RpcFinished, so that no handler
// holds metrics code. (The attach histogram, Attach to the lease's claim on
// the fd socket, is fed by MetricsListener::OnLeaseClaimed, not from here.)
//
// Thread-safety: the factory is called by gRPC from any thread; `metrics`
// must outlive the server it is installed on.
#ifndef WEIGHTD_SERVER_LISTEN_RPC_METRICS_H_
#define WEIGHTD_SERVER_LISTEN_RPC_METRICS_H_

#include <grpcpp/server_builder.h>
#include <grpcpp/support/server_interceptor.h>

#include <memory>
#include <string>

#include "server/metrics/metrics.h"

namespace weightd {

// "/weightd.v1.Weightd/Attach" -> "weightd.v1.Weightd/Attach"; a method the
// process has no descriptor for (a client's typo) becomes "unknown", so a
// client cannot grow the label set without bound.
std::string RpcMethodLabel(const char* method);

class RpcMetricsFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcMetricsFactory(Metrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

 private:
  Metrics* metrics_;
};

// Installs RpcMetricsFactory on `builder` (its only interceptor).
void CountRpcs(grpc::ServerBuilder& builder, Metrics* metrics);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LISTEN_RPC_METRICS_H_
