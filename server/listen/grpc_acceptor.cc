#include "server/listen/grpc_acceptor.h"

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
  ScopedFd listener = std::move(options.listener);
  if (!listener.valid()) {
    WEIGHTD_ASSIGN_OR_RETURN(listener, ListenStream(options.path, options.mode));
  }
  if (options.name.empty()) options.name = "gRPC socket " + options.path;
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
    std::vector<pollfd> fds = {{wake_read_.get(), POLLIN, 0},
                               {listener_.get(), static_cast<short>(backoff ? 0 : POLLIN), 0}};
    for (const Pending& p : pending_) fds.push_back({p.sock.get(), POLLIN, 0});
    int ready = poll(fds.data(), fds.size(), PollTimeoutMs(backoff));
    if (ready < 0 && errno != EINTR) return;
    if (fds[0].revents) return;
    std::vector<bool> spoke(pending_.size());
    for (size_t i = 0; i < pending_.size(); ++i) spoke[i] = fds[i + 2].revents != 0;
    ServePending(spoke);
    if (backoff || (fds[1].revents & POLLIN)) backoff = !Accept();  // after a backoff, retry even if poll saw nothing
  }
}

int GrpcAcceptor::PollTimeoutMs(bool backoff) const {
  int64_t ms = backoff ? kBackoffMs : -1;
  auto now = std::chrono::steady_clock::now();
  for (const Pending& p : pending_) {
    int64_t left = std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(p.deadline - now).count());
    ms = ms < 0 ? left + 1 : std::min<int64_t>(ms, left + 1);
  }
  return static_cast<int>(ms);
}

void GrpcAcceptor::ServePending(const std::vector<bool>& spoke) {
  auto now = std::chrono::steady_clock::now();
  std::vector<Pending> waiting;
  for (size_t i = 0; i < pending_.size(); ++i) {
    Pending& p = pending_[i];
    if (spoke[i]) {
      char byte;
      if (recv(p.sock.get(), &byte, 1, MSG_PEEK | MSG_DONTWAIT) > 0) {  // gRPC reads the bytes itself
        handed_.push_back({p.sock.get(), InodeOf(p.sock.get())});
        grpc::AddInsecureChannelFromFd(server_, p.sock.Release());
      }
      continue;  // handed over, or hung up / failed: closed
    }
    if (now < p.deadline) waiting.push_back(std::move(p));  // else silent for too long: closed
  }
  pending_ = std::move(waiting);
}

bool GrpcAcceptor::Accept() {
  int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) {
    if (!ShortOfResources(errno)) return true;  // EAGAIN, ECONNABORTED, EINTR: nothing to do
    if (!short_of_fds_) {
      LogWarning(absl::StrCat(options_.name, ": accept: ", strerror(errno), "; retrying every ", kBackoffMs,
                              " ms until descriptors are free"));
    }
    short_of_fds_ = true;
    return false;
  }
  if (short_of_fds_) LogInfo(absl::StrCat(options_.name, ": accepting again"));
  short_of_fds_ = false;
  ScopedFd sock(fd);
  bool full = OpenConnections() + pending_.size() >= options_.max_connections;
  if (full && !at_limit_) {
    LogWarning(absl::StrCat(options_.name, ": ", options_.max_connections,
                            " connections open (--grpc-max-connections); closing new ones until some end"));
  }
  at_limit_ = full;
  if (full && !IsSelf(sock.get())) return true;
  pending_.push_back({std::move(sock), std::chrono::steady_clock::now() + options_.first_bytes_timeout});
  return true;
}

size_t GrpcAcceptor::OpenConnections() {
  handed_.erase(std::remove_if(handed_.begin(), handed_.end(), [](const Handed& h) { return InodeOf(h.fd) != h.inode; }),
                handed_.end());
  return handed_.size();
}

}  // namespace weightd
