// The optional TCP health port (--health-address): a second gRPC server that
// serves only the standard grpc.health.v1.Health service, for Kubernetes
// gRPC probes, which reach TCP only. Its statuses are set by the daemon to
// mirror the Unix socket's (see DaemonListener in daemon.cc); every other
// method, reflection included, is UNIMPLEMENTED.
//
// Requires grpc::EnableDefaultHealthCheckService(true) before Start.
// Thread-safety: Start and Shutdown from one thread.
#ifndef WEIGHTD_SERVER_LISTEN_HEALTH_PORT_H_
#define WEIGHTD_SERVER_LISTEN_HEALTH_PORT_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/metrics/metrics.h"

namespace weightd {

// A builder option that keeps gRPC server reflection off one server (its
// plugin registers itself for every builder of the process once linked in).
std::unique_ptr<grpc::ServerBuilderOption> WithoutReflectionOption();

class HealthPort {
 public:
  // Listens on `address` ("HOST:PORT"; port 0 picks one) and counts every
  // call in `metrics`, which must outlive this. UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<HealthPort>> Start(const std::string& address, Metrics* metrics);
  ~HealthPort();  // Shutdown()

  grpc::Server* server() { return server_.get(); }
  int port() const { return port_; }
  // Ends open calls (Watch streams) at once; statuses read NOT_SERVING.
  void Shutdown();

  struct Unimplemented;

 private:
  HealthPort();
  std::unique_ptr<Unimplemented> unimplemented_;  // outlives server_
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LISTEN_HEALTH_PORT_H_
