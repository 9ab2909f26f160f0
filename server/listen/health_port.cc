#include "server/listen/health_port.h"

#include <grpcpp/generic/async_generic_service.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "server/listen/rpc_metrics.h"
#include "server/listen/grpc_limits.h"

namespace weightd {
namespace {

// Keeps gRPC server reflection off one builder: its plugin registers itself
// for every builder of the process once linked in.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    std::erase_if(*plugins, [](const auto& p) { return p->name() == "proto_server_reflection"; });
  }
};

}  // namespace

std::unique_ptr<grpc::ServerBuilderOption> WithoutReflectionOption() { return std::make_unique<WithoutReflection>(); }

// Answers every method but the health service's, naming what the port
// serves. gRPC also refuses to build a server whose only service is the
// default health service.
struct HealthPort::Unimplemented final : public grpc::CallbackGenericService {
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Reactor final : public grpc::ServerGenericBidiReactor {
     public:
      Reactor() {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                            "this is the health port: it serves grpc.health.v1.Health only"));
      }
      void OnDone() override { delete this; }
    };
    return new Reactor;
  }
};

HealthPort::HealthPort() : unimplemented_(std::make_unique<Unimplemented>()) {}

HealthPort::~HealthPort() { Shutdown(); }

absl::StatusOr<std::unique_ptr<HealthPort>> HealthPort::Start(const std::string& address, Metrics* metrics) {
  std::unique_ptr<HealthPort> health(new HealthPort());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &health->port_);
  RefuseSharedPort(builder);
  builder.SetOption(std::make_unique<WithoutReflection>());
  builder.RegisterCallbackGenericService(health->unimplemented_.get());
  CountRpcs(builder, metrics);
  health->server_ = builder.BuildAndStart();
  if (health->server_ == nullptr || health->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on --health-address ", address));
  }
  return health;
}

void HealthPort::Shutdown() {
  if (server_) server_->Shutdown(std::chrono::system_clock::now());
}

}  // namespace weightd
