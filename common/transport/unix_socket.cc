#include "common/transport/unix_socket.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace weightd {
namespace {

absl::StatusOr<sockaddr_un> Address(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path '", path, "' is longer than the ", sizeof(addr.sun_path) - 1, "-byte limit of unix(7)"));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

// Binds and listens, replacing an existing socket (never another kind of file) at `path`.
absl::StatusOr<ScopedFd> ListenUnix(const std::string& path, int type, const char* type_name, int backlog,
                                    mode_t mode) {
  WEIGHTD_ASSIGN_OR_RETURN(sockaddr_un addr, Address(path));
  ScopedFd sock(socket(AF_UNIX, type | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return ErrnoToStatus(absl::StrCat("socket(AF_UNIX, ", type_name, ")"), errno);
  // Replace only a socket: a regular file or anything else at the path is
  // someone's data, and a misconfigured --socket must not delete it.
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, ": exists and is not a socket; refusing to replace it (choose another path)"));
    }
    unlink(path.c_str());
  }
  if (bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoToStatus(absl::StrCat("bind ", path), errno);
  }
  if (chmod(path.c_str(), mode) != 0) return ErrnoToStatus(absl::StrCat("chmod ", path), errno);
  if (listen(sock.get(), backlog) != 0) return ErrnoToStatus(absl::StrCat("listen ", path), errno);
  return sock;
}

}  // namespace

absl::StatusOr<ScopedFd> ListenSeqpacket(const std::string& path, mode_t mode) {
  return ListenUnix(path, SOCK_SEQPACKET, "SOCK_SEQPACKET", 128, mode);
}

absl::StatusOr<ScopedFd> ListenStream(const std::string& path, mode_t mode) {
  return ListenUnix(path, SOCK_STREAM, "SOCK_STREAM", SOMAXCONN, mode);
}

absl::StatusOr<ScopedFd> ConnectSeqpacket(const std::string& path) {
  WEIGHTD_ASSIGN_OR_RETURN(sockaddr_un addr, Address(path));
  ScopedFd sock(socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return ErrnoToStatus("socket(AF_UNIX, SOCK_SEQPACKET)", errno);
  if (connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoToStatus(absl::StrCat("connect to fd socket ", path), errno);
  }
  return sock;
}

absl::Status SendMessage(int sock, const std::string& payload, const std::vector<int>& fds) {
  if (fds.size() > kMaxFdsPerMessage) return absl::InvalidArgumentError("too many fds for one message");
  if (payload.size() > kMaxMessageBytes) return absl::InvalidArgumentError("message too long");
  iovec iov{const_cast<char*>(payload.data()), payload.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  while (sendmsg(sock, &msg, MSG_NOSIGNAL) < 0) {
    if (errno != EINTR) return ErrnoToStatus("sendmsg on fd socket", errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReceiveMessage(int sock, std::vector<ScopedFd>* fds, int timeout_ms) {
  pollfd pfd{sock, POLLIN, 0};
  int ready;
  while ((ready = poll(&pfd, 1, timeout_ms)) < 0 && errno == EINTR) {
  }
  if (ready < 0) return ErrnoToStatus("poll fd socket", errno);
  if (ready == 0) return absl::DeadlineExceededError("timed out waiting on the fd socket");
  std::string payload(kMaxMessageBytes, '\0');
  iovec iov{payload.data(), payload.size()};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage));
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  while ((n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC)) < 0 && errno == EINTR) {
  }
  if (n < 0) return ErrnoToStatus("recvmsg on fd socket", errno);
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (fds != nullptr) {
        fds->emplace_back(fd);
      } else {
        close(fd);
      }
    }
  }
  if (n == 0) return absl::UnavailableError("fd socket closed by peer");
  if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) return absl::DataLossError("fd socket message truncated");
  payload.resize(static_cast<size_t>(n));
  return payload;
}

absl::StatusOr<PeerCredentials> GetPeerCredentials(int sock) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return ErrnoToStatus("SO_PEERCRED", errno);
  return PeerCredentials{cred.pid, cred.uid, cred.gid};
}

}  // namespace weightd
