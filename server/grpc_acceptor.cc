#include "server/grpc_acceptor.h"

#include <fcntl.h>
#include <grpcpp/server_posix.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace weightd {
namespace {

constexpr int kBackoffMs = 100;  // while accept4 fails with EMFILE and friends

bool ShortOfResources(int err) { return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM; }

ino_t InodeOf(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 ? st.st_ino : 0;
}

bool IsSelf(int sock) {
  absl::StatusOr<PeerCredentials> peer = GetPeerCredentials(sock);
  return peer.ok() && peer->pid == getpid();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GrpcAcceptor>> GrpcAcceptor::Start(GrpcAcceptorOptions options, grpc::Server* server) {
  WEIGHTD_ASSIGN_OR_RETURN(ScopedFd listener, ListenStream(options.path, options.mode));
  if (fcntl(listener.get(), F_SETFL, O_NONBLOCK) != 0) return ErrnoToStatus("fcntl O_NONBLOCK", errno);
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) return ErrnoToStatus("pipe2", errno);
  std::unique_ptr<GrpcAcceptor> acceptor(new GrpcAcceptor(std::move(options), server, std::move(listener),
                                                          ScopedFd(pipe_fds[0]), ScopedFd(pipe_fds[1])));
  acceptor->thread_ = std::thread([a = acceptor.get()] { a->Loop(); });
  return acceptor;
}

GrpcAcceptor::GrpcAcceptor(GrpcAcceptorOptions options, grpc::Server* server, ScopedFd listener, ScopedFd wake_read,
                           ScopedFd wake_write)
    : options_(std::move(options)),
      server_(server),
      listener_(std::move(listener)),
      wake_read_(std::move(wake_read)),
      wake_write_(std::move(wake_write)) {}

GrpcAcceptor::~GrpcAcceptor() {
  char byte = 1;
  (void)!write(wake_write_.get(), &byte, 1);
  if (thread_.joinable()) thread_.join();
}

void GrpcAcceptor::Loop() {
  bool backoff = false;
  while (true) {
    pollfd fds[2] = {{wake_read_.get(), POLLIN, 0}, {listener_.get(), static_cast<short>(backoff ? 0 : POLLIN), 0}};
    int ready = poll(fds, 2, backoff ? kBackoffMs : -1);
    if (ready < 0 && errno != EINTR) return;
    if (fds[0].revents) return;
    backoff = !Accept();  // after a backoff, retry even if poll saw nothing new
  }
}

bool GrpcAcceptor::Accept() {
  int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    if (!ShortOfResources(errno)) return true;  // EAGAIN, ECONNABORTED, EINTR: nothing to do
    if (!short_of_fds_) {
      LogWarning(absl::StrCat("gRPC socket ", options_.path, ": accept: ", strerror(errno),
                              "; retrying every ", kBackoffMs, " ms until descriptors are free"));
    }
    short_of_fds_ = true;
    return false;
  }
  if (short_of_fds_) LogInfo(absl::StrCat("gRPC socket ", options_.path, ": accepting again"));
  short_of_fds_ = false;
  ScopedFd sock(fd);
  bool full = OpenConnections() >= options_.max_connections;
  if (full && !IsSelf(sock.get())) {
    if (!at_limit_) {
      LogWarning(absl::StrCat("gRPC socket ", options_.path, ": ", options_.max_connections,
                              " connections open (--grpc-max-connections); closing new ones until some end"));
    }
    at_limit_ = true;
    return true;
  }
  at_limit_ = full;  // the self-check got in; the episode goes on
  handed_.push_back({sock.get(), InodeOf(sock.get())});
  grpc::AddInsecureChannelFromFd(server_, sock.Release());
  return true;
}

size_t GrpcAcceptor::OpenConnections() {
  handed_.erase(std::remove_if(handed_.begin(), handed_.end(), [](const Handed& h) { return InodeOf(h.fd) != h.inode; }),
                handed_.end());
  return handed_.size();
}

}  // namespace weightd
