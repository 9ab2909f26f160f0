#include "server/self_check.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/unix_socket.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace weightd {
namespace {

absl::Status ProbeHealth(const std::string& target, std::chrono::milliseconds deadline) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // a new connection: the listener must accept it
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + deadline);
  grpc::health::v1::HealthCheckResponse response;
  grpc::Status status = stub->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
  if (!status.ok()) return absl::UnavailableError(absl::StrCat(target, ": health check: ", status.error_message()));
  if (response.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(target, ": health check says ",
                                               grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())));
  }
  return absl::OkStatus();
}

absl::Status ProbeFdSocket(const std::string& path, std::chrono::milliseconds deadline) {
  absl::StatusOr<ScopedFd> sock = ConnectSeqpacket(path);
  absl::Status status = sock.status();
  if (status.ok()) status = SendMessage(sock->get(), "CLAIM self-check", {});
  absl::StatusOr<std::string> reply = status.ok() ? ReceiveMessage(sock->get(), nullptr, static_cast<int>(deadline.count()))
                                                  : absl::StatusOr<std::string>(status);
  if (reply.ok() && absl::StartsWith(*reply, "ERR ")) return absl::OkStatus();
  return absl::UnavailableError(
      absl::StrCat("fd socket ", path, ": ", reply.ok() ? "unexpected reply '" + *reply + "'" : reply.status().message()));
}

}  // namespace

absl::Status ProbeListeners(const SelfCheckTargets& targets, std::chrono::milliseconds deadline) {
  if (absl::Status s = ProbeHealth("unix:" + targets.grpc_socket, deadline); !s.ok()) return s;
  if (absl::Status s = ProbeFdSocket(targets.fd_socket, deadline); !s.ok()) return s;
  for (const std::string& target : targets.grpc_targets) {
    if (absl::Status s = ProbeHealth(target, deadline); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::string LocalTarget(const std::string& address, int port) {
  std::string host = address.substr(0, address.rfind(':'));
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "[::]") host = "[::1]";
  return absl::StrCat(host, ":", port);
}

}  // namespace weightd
