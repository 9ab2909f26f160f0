// The gRPC Unix socket's listener, run by the daemon instead of by gRPC.
//
// gRPC 1.51's own listener stops accepting for good after one accept4()
// failure such as EMFILE (grpc/grpc#20418): a daemon that once ran out of
// descriptors never served its API again. This acceptor owns the listening
// socket, hands each accepted connection to the gRPC server
// (grpc::AddInsecureChannelFromFd), backs off while descriptors are short and
// resumes by itself once they are free. It also bounds the connections held:
// one more is accepted and closed at once, except the daemon's own
// self-check (same pid), which always gets in.
//
// Thread-safety: Start and the destructor from one thread; the acceptor runs
// its own thread.
#ifndef WEIGHTD_SERVER_GRPC_ACCEPTOR_H_
#define WEIGHTD_SERVER_GRPC_ACCEPTOR_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "common/transport/unix_socket.h"

namespace weightd {

struct GrpcAcceptorOptions {
  std::string path;  // replaced if it exists: the caller holds its PathLock
  mode_t mode = 0660;
  size_t max_connections = 1024;
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
  GrpcAcceptor(GrpcAcceptorOptions options, grpc::Server* server, ScopedFd listener, ScopedFd wake_read,
               ScopedFd wake_write);
  void Loop();
  // False when accept4 failed for want of descriptors or memory.
  bool Accept();
  size_t OpenConnections();

  GrpcAcceptorOptions options_;
  grpc::Server* server_;
  ScopedFd listener_;
  ScopedFd wake_read_, wake_write_;
  std::vector<Handed> handed_;
  bool short_of_fds_ = false, at_limit_ = false;  // log each episode once
  std::thread thread_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_GRPC_ACCEPTOR_H_
