// The gRPC Unix socket's listener, run by the daemon instead of by gRPC.
//
// gRPC 1.51's own listener stops accepting for good after one accept4()
// failure such as EMFILE (grpc/grpc#20418): a daemon that once ran out of
// descriptors never served its API again. This acceptor owns the listening
// socket, hands each accepted connection to the gRPC server
// (grpc::AddInsecureChannelFromFd), backs off while descriptors are short and
// resumes by itself once they are free. It also bounds the connections held:
// one more is accepted and closed at once, except the daemon's own
// self-check (same pid), which always gets in; and a connection is handed
// over only once it has sent its first bytes (within first_bytes_timeout),
// so connections that never speak cannot hold the slots. The plain-TCP
// listener uses it too (a socket the caller bound); a TLS listener cannot:
// gRPC 1.51 takes connections from an fd only with insecure credentials
// (grpc/grpc_posix.h).
//
// Thread-safety: Start and the destructor from one thread; the acceptor runs
// its own thread.
#ifndef WEIGHTD_SERVER_LISTEN_GRPC_ACCEPTOR_H_
#define WEIGHTD_SERVER_LISTEN_GRPC_ACCEPTOR_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transport/unix_socket.h"

namespace weightd {

struct GrpcAcceptorOptions {
  std::string path;  // a Unix socket to listen on; replaced if it exists: the caller holds its PathLock
  mode_t mode = 0660;
  // Or a socket already bound and listening (the TCP listener), used
  // instead of `path`; `name` names it in log lines.
  ScopedFd listener;
  std::string name;
  size_t max_connections = 1024;
  // A connection that sends no byte (gRPC's HTTP/2 preface comes first)
  // within this time is closed before gRPC sees it; until then it counts
  // against max_connections. Silent connections cannot hold the slots.
  std::chrono::milliseconds first_bytes_timeout{10000};
};

class GrpcAcceptor {
 public:
  // Listens on options.path and starts accepting into `server`, which must
  // outlive this (destroy the acceptor before shutting the server down).
  static absl::StatusOr<std::unique_ptr<GrpcAcceptor>> Start(GrpcAcceptorOptions options, grpc::Server* server);
  // Stops accepting; connections already handed to gRPC stay gRPC's.
  ~GrpcAcceptor();

 private:
  // A connection handed to gRPC: open while fd `fd` still is socket `inode`
  // (gRPC closes it; the number may be reused, the inode is not).
  struct Handed {
    int fd;
    ino_t inode;
  };
  // Accepted, waiting for its first bytes.
  struct Pending {
    ScopedFd sock;
    std::chrono::steady_clock::time_point deadline;
  };

  GrpcAcceptor(GrpcAcceptorOptions options, grpc::Server* server, ScopedFd listener, ScopedFd wake_read,
               ScopedFd wake_write);
  void Loop();
  // False when accept4 failed for want of descriptors or memory.
  bool Accept();
  // Hands over pending connections that sent bytes; closes those that hung
  // up or ran out of time. `ready[i]`: poll saw pending_[i] readable.
  void ServePending(const std::vector<bool>& ready);
  int PollTimeoutMs(bool backoff) const;
  size_t OpenConnections();

  GrpcAcceptorOptions options_;
  grpc::Server* server_;
  ScopedFd listener_;
  ScopedFd wake_read_, wake_write_;
  std::vector<Handed> handed_;
  std::vector<Pending> pending_;
  bool short_of_fds_ = false, at_limit_ = false;  // log each episode once
  std::thread thread_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LISTEN_GRPC_ACCEPTOR_H_
