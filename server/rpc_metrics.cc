#include "server/rpc_metrics.h"

#include <google/protobuf/descriptor.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpc/health/v1/health.pb.h"
#include "absl/strings/strip.h"

namespace weightd {
namespace {

constexpr char kAttachMethod[] = "weightd.v1.Weightd/Attach";

using grpc::experimental::InterceptionHookPoints;

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
    metrics_->RpcFinished(method_, GrpcCodeName(code), seconds);
    if (code == grpc::StatusCode::OK && method_ == kAttachMethod) metrics_->AttachFinished(seconds);
  }

  Metrics* metrics_;
  std::string method_;
  std::chrono::steady_clock::time_point start_;
  bool reported_ = false;
};

}  // namespace

std::string RpcMethodLabel(const char* method) {
  absl::string_view m = method != nullptr ? method : "";
  size_t slash = m.rfind('/');
  if (!absl::ConsumePrefix(&m, "/") || slash == 0 || m.find('/') != slash - 1) return "unknown";
  std::string full_name = absl::StrCat(m.substr(0, slash - 1), ".", m.substr(slash));
  if (google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(full_name) == nullptr) return "unknown";
  return std::string(m);
}

RpcMetricsFactory::RpcMetricsFactory(Metrics* metrics) : metrics_(metrics) {
  // Links the grpc.health.v1 descriptors into the pool RpcMethodLabel looks
  // methods up in: the server's own health service does not use them.
  (void)grpc::health::v1::HealthCheckRequest::descriptor();
}

grpc::experimental::Interceptor* RpcMetricsFactory::CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) {
  return new RpcMetricsInterceptor(metrics_, RpcMethodLabel(info->method()));
}

}  // namespace weightd
