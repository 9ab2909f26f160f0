// Whether a client process has exited, for memory that must outlive every
// process that may still have it open (cuda-legacy-ipc arenas: see
// ModelRegistry::Unload).
//
// A pidfd (pidfd_open, Linux 5.3) names the process itself, so a reused pid
// is never mistaken for it; where pidfd_open is unavailable (older kernels,
// some sandboxes) the pid is probed with kill(pid, 0), which a reused pid
// can fool into reporting "still running" (never "exited" too early).
//
// Thread-compatible: one thread at a time per object.
#ifndef WEIGHTD_SERVER_PROCESS_WATCH_H_
#define WEIGHTD_SERVER_PROCESS_WATCH_H_

#include <sys/types.h>

#include "common/unix_socket.h"

namespace weightd {

class ProcessWatch {
 public:
  // Watches `pid` (a pid in this process's PID namespace, as SO_PEERCRED
  // reports it). pid <= 0 means the process is not visible from here (a
  // client in another PID namespace): it is treated as running until this
  // process exits, and known() is false.
  explicit ProcessWatch(pid_t pid);

  pid_t pid() const { return pid_; }
  bool known() const { return pid_ > 0; }
  // True once the process has exited (a zombie counts as exited: its
  // mappings are gone). Never blocks.
  bool Exited() const;

 private:
  pid_t pid_;
  ScopedFd pidfd_;  // invalid when pidfd_open failed
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PROCESS_WATCH_H_
