#include "server/listen/rpc_metrics.h"

#include <google/protobuf/descriptor.h>

#include <chrono>

#include "absl/status/status.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "grpc/health/v1/health.pb.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {
namespace {


using grpc::experimental::InterceptionHookPoints;
using grpc::health::v1::HealthCheckRequest;

// Lives from the start of one call to its end (gRPC deletes it).
class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(Metrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(std::chrono::steady_clock::now()) {}

  // A call that ends without sending a status (the client went away) still counts.
  ~RpcMetricsInterceptor() override {
    if (!reported_) Report(grpc::StatusCode::CANCELLED);
  }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      Report(methods->GetSendStatus().error_code());
    }
    methods->Proceed();
  }

 private:
  void Report(grpc::StatusCode code) {
    reported_ = true;
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));  // gRPC's numbering
    metrics_->RpcFinished(method_, name.empty() ? "UNKNOWN" : name, seconds);
  }

  Metrics* metrics_;
  std::string method_;
  std::chrono::steady_clock::time_point start_;
  bool reported_ = false;
};

// The generated pool holds a .proto's services once its generated code is
// linked in, which these references make sure of (the daemon's default
// health service, for one, does not use the generated health code).
const google::protobuf::DescriptorPool& KnownMethods() {
  static const bool linked = (v1::AttachRequest::descriptor(), HealthCheckRequest::descriptor(), true);
  (void)linked;
  return *google::protobuf::DescriptorPool::generated_pool();
}

}  // namespace

std::string RpcMethodLabel(const char* method) {
  absl::string_view m = method != nullptr ? method : "";
  if (!absl::ConsumePrefix(&m, "/")) return "unknown";
  std::pair<std::string, std::string> parts = absl::StrSplit(m, absl::MaxSplits('/', 1));
  const google::protobuf::ServiceDescriptor* service = KnownMethods().FindServiceByName(parts.first);
  if (service == nullptr || service->FindMethodByName(parts.second) == nullptr) return "unknown";
  return std::string(m);
}

grpc::experimental::Interceptor* RpcMetricsFactory::CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) {
  return new RpcMetricsInterceptor(metrics_, RpcMethodLabel(info->method()));
}

void CountRpcs(grpc::ServerBuilder& builder, Metrics* metrics) {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<RpcMetricsFactory>(metrics));
  builder.experimental().SetInterceptorCreators(std::move(factories));
}

}  // namespace weightd
