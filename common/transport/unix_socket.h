// Unix-domain socket helpers for the fd channel: an owned fd, SOCK_SEQPACKET
// listen/connect, and messages carrying file descriptors (SCM_RIGHTS, see
// unix(7) and cmsg(3)). At most kMaxFdsPerMessage fds travel in one message
// (the kernel's SCM_MAX_FD is 253).
#ifndef WEIGHTD_COMMON_TRANSPORT_UNIX_SOCKET_H_
#define WEIGHTD_COMMON_TRANSPORT_UNIX_SOCKET_H_

#include <sys/types.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/scoped_fd.h"
#include "common/transport/fd_channel_codec.h"  // kMaxFdsPerMessage, kMaxMessageBytes

namespace weightd {

// Binds and listens on a SOCK_SEQPACKET socket at `path` (an existing socket
// file is replaced) with file mode `mode`.
absl::StatusOr<ScopedFd> ListenSeqpacket(const std::string& path, mode_t mode);
// The same for a SOCK_STREAM socket (the gRPC socket), with backlog SOMAXCONN.
absl::StatusOr<ScopedFd> ListenStream(const std::string& path, mode_t mode);
// Connects to a SOCK_SEQPACKET socket at `path`.
absl::StatusOr<ScopedFd> ConnectSeqpacket(const std::string& path);

// Sends one message with `payload` and up to kMaxFdsPerMessage fds.
absl::Status SendMessage(int sock, const std::string& payload, const std::vector<int>& fds);
// Receives one message; received fds are owned by the caller via `fds`.
// A closed peer is UNAVAILABLE. `timeout_ms` < 0 waits forever.
absl::StatusOr<std::string> ReceiveMessage(int sock, std::vector<ScopedFd>* fds, int timeout_ms);

struct PeerCredentials {
  pid_t pid;
  uid_t uid;
  gid_t gid;
};
// SO_PEERCRED of a connected Unix socket.
absl::StatusOr<PeerCredentials> GetPeerCredentials(int sock);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_TRANSPORT_UNIX_SOCKET_H_
