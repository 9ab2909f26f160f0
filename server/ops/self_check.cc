#include "server/ops/self_check.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/transport/tcp_address.h"
#include "common/transport/unix_socket.h"
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

// The accept queue length of this process's listening TCP socket on `port`
// (tcpi_unacked of TCP_INFO for a socket in LISTEN), or NOT_FOUND.
absl::StatusOr<uint32_t> AcceptQueueLength(int port) {
  DIR* dir = opendir("/proc/self/fd");
  if (dir == nullptr) return ErrnoToStatus("/proc/self/fd", errno);
  struct CloseDir {
    void operator()(DIR* d) const { closedir(d); }
  };
  std::unique_ptr<DIR, CloseDir> owned(dir);
  while (dirent* entry = readdir(dir)) {
    int fd = atoi(entry->d_name);
    int listening = 0;
    socklen_t len = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) != 0 || !listening) continue;
    sockaddr_storage addr{};
    len = sizeof addr;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) continue;
    int bound = addr.ss_family == AF_INET    ? ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port)
                : addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                             : -1;
    tcp_info info{};
    len = sizeof info;
    if (bound == port && getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0) return info.tcpi_unacked;
  }
  return absl::NotFoundError(absl::StrCat("no listening socket on port ", port));
}

// Connects to "HOST:PORT" and waits, up to `deadline`, for the listener to
// take the connection off its accept queue.
absl::Status ProbeAccepting(const std::string& target, std::chrono::milliseconds deadline) {
  absl::StatusOr<AddrInfoPtr> info = ResolveTcpAddress(target, AI_NUMERICHOST);
  if (!info.ok()) return absl::UnavailableError(absl::StrCat("TCP listener ", info.status().message()));
  // Non-blocking: a listener whose accept queue is full drops the SYN, and a
  // blocking connect would wait out the kernel's retries (minutes).
  const addrinfo& addr = **info;
  ScopedFd sock(socket(addr.ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  int err = !sock.valid() ? errno : connect(sock.get(), addr.ai_addr, addr.ai_addrlen) == 0 ? 0 : errno;
  if (err == EINPROGRESS) {
    pollfd p{sock.get(), POLLOUT, 0};
    socklen_t len = sizeof err;
    err = poll(&p, 1, static_cast<int>(deadline.count())) == 1 ? 0 : ETIMEDOUT;
    if (err == 0 && getsockopt(sock.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  }
  if (err != 0) return absl::UnavailableError(absl::StrCat("TCP listener ", target, ": connect: ", strerror(err)));
  auto give_up = std::chrono::steady_clock::now() + deadline;
  for (;;) {
    absl::StatusOr<uint32_t> queued = AcceptQueueLength(atoi(target.substr(target.rfind(':') + 1).c_str()));
    if (!queued.ok()) return absl::UnavailableError(absl::StrCat("TCP listener ", target, ": ", queued.status().message()));
    if (*queued == 0) return absl::OkStatus();
    if (std::chrono::steady_clock::now() >= give_up) {
      return absl::UnavailableError(
          absl::StrCat("TCP listener ", target, " does not accept: connections stay in its accept queue"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace

absl::Status ProbeListeners(const SelfCheckTargets& targets, std::chrono::milliseconds deadline) {
  if (absl::Status s = ProbeHealth("unix:" + targets.grpc_socket, deadline); !s.ok()) return s;
  if (absl::Status s = ProbeFdSocket(targets.fd_socket, deadline); !s.ok()) return s;
  for (const std::string& target : targets.grpc_targets) {
    if (absl::Status s = ProbeHealth(target, deadline); !s.ok()) return s;
  }
  for (const std::string& target : targets.accepting) {
    if (absl::Status s = ProbeAccepting(target, deadline); !s.ok()) return s;
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
