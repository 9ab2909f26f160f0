#include "server/process_watch.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>

namespace weightd {

ProcessWatch::ProcessWatch(pid_t pid) : pid_(pid) {
#ifdef SYS_pidfd_open
  if (pid_ > 0) pidfd_ = ScopedFd(static_cast<int>(syscall(SYS_pidfd_open, pid_, 0)));
#endif
}

bool ProcessWatch::Exited() const {
  if (pid_ <= 0) return false;
  if (pidfd_.valid()) {
    // A pidfd polls readable once the process has terminated (pidfd_open(2)).
    pollfd p = {pidfd_.get(), POLLIN, 0};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLIN | POLLHUP)) != 0;
  }
  return kill(pid_, 0) != 0 && errno == ESRCH;
}

}  // namespace weightd
