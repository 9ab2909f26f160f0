// Wires the daemon together: registry, fd channel, gRPC server (with the
// standard health service), preloads, and systemd notification.
//
// Thread-safety: Start, then Shutdown from any one thread; Shutdown is
// idempotent.
#ifndef WEIGHTD_SERVER_DAEMON_H_
#define WEIGHTD_SERVER_DAEMON_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/config/config.h"
#include "server/restart/fd_store.h"

namespace weightd {

class Daemon {
 public:
  // Listens on every configured socket, sends READY=1 to systemd (when
  // NOTIFY_SOCKET is set), then starts the preloads in the background.
  // `inherited`: the fds passed at start (TakeListenFds, taken first thing
  // in main()), restored before any socket answers.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonConfig& config,
                                                       std::vector<NamedFd> inherited = {});
  virtual ~Daemon() = default;
  // Stops accepting, lets in-flight calls finish (up to 10 s), ends leases.
  virtual void Shutdown() = 0;
  // Shutdown() before an in-place upgrade (server/restart/upgrade.h): tells systemd
  // RELOADING=1 rather than STOPPING=1.
  virtual void ShutdownForUpgrade() = 0;
  // After a shutdown: copies of the fds of every READY model, named as in the
  // fd store, for the next image (FdStoreKeeper::Handoff).
  virtual std::vector<NamedFd> Handoff() = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_DAEMON_H_
