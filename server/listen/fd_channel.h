// The fd channel: a SOCK_SEQPACKET Unix socket beside the gRPC socket over
// which clients receive segment file descriptors, and whose connection is the
// lease.
//
// Protocol (grammar and limits: docs/api.md, "The fd channel"; encoded and
// parsed by common/transport/fd_channel_codec.h):
//   client -> daemon   "CLAIM <lease_id>"
//   daemon -> client   "OK <n>" carrying the first min(n, 250) fds (SCM_RIGHTS),
//                      then "MORE" messages carrying the rest, in the order of
//                      the Attach response's segments, skipping segments
//                      exported by handle bytes (cuda-legacy-ipc);
//                  or  "ERR <grpc-code-number> <message>" (cut to 4096 bytes),
//                      then the daemon shuts down its side for writing, reads
//                      what the client sent (for up to kRefusalDrain) and
//                      closes: a refused client always reads the reason, never
//                      ECONNRESET or EPIPE.
// The client then keeps the connection open and sends nothing. When it closes
// (exit, crash, SIGKILL: the kernel closes it), the daemon sees EOF and ends
// the lease. A connection that does not send CLAIM within the claim timeout
// is closed. The peer is checked with SO_PEERCRED when it connects: same uid or primary gid as
// the daemon, root, or a primary gid in the allowed list (SO_PEERCRED carries
// no supplementary groups).
//
// Thread-safety: Start/Stop from one thread; the channel runs its own thread.
#ifndef WEIGHTD_SERVER_LISTEN_FD_CHANNEL_H_
#define WEIGHTD_SERVER_LISTEN_FD_CHANNEL_H_

#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transport/unix_socket.h"
#include "server/registry/registry.h"

namespace weightd {

struct FdChannelOptions {
  std::string path;                 // e.g. /run/weightd/weightd.fd.sock
  mode_t mode = 0660;
  std::vector<gid_t> allowed_gids = {};  // besides the daemon's own uid and root
  // Connections held at once (claimed leases plus pending claims); more are
  // refused with ERR 8 (RESOURCE_EXHAUSTED).
  size_t max_connections = 4096;
};

class FdChannel {
 public:
  // How long a refused connection is kept to read the client's request
  // before it is closed, and how many may wait so at once (beyond that they
  // are closed at once).
  static constexpr std::chrono::milliseconds kRefusalDrain{1000};
  static constexpr size_t kMaxRefused = 64;

  // Listens on options.path and starts serving. `registry` must outlive this.
  static absl::StatusOr<std::unique_ptr<FdChannel>> Start(FdChannelOptions options, ModelRegistry* registry);
  // Stops the thread and closes every connection, ending their leases.
  ~FdChannel();

 private:
  struct Connection;
  FdChannel(FdChannelOptions options, ModelRegistry* registry, ScopedFd listener, ScopedFd wake_read,
            ScopedFd wake_write);
  void Loop();
  void Accept();
  // Returns false when the connection must be closed.
  bool Serve(Connection& connection);
  bool PeerAllowed(int sock, std::string* why) const;
  // Sends "ERR <code> <why>" and keeps `sock` to drain until it closes.
  void Refuse(ScopedFd sock, absl::StatusCode code, const std::string& why);
  size_t CountConnections(bool refused) const;

  FdChannelOptions options_;
  ModelRegistry* registry_;
  ScopedFd listener_;
  ScopedFd wake_read_, wake_write_;
  std::vector<std::unique_ptr<Connection>> connections_;
  bool warned_fd_limit_ = false;
  std::thread thread_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LISTEN_FD_CHANNEL_H_
