// One daemon per bound path: an exclusive flock(2) on "<path>.lock", taken
// before the path is unlinked or bound and held for the life of the process.
// A daemon unlinks a socket path only while it holds that path's lock, so a
// second daemon can never take over (or remove) a socket another live daemon
// accepts on.
//
// Thread-safety: a PathLock is a value; use it from one thread.
#ifndef WEIGHTD_SERVER_PATH_LOCK_H_
#define WEIGHTD_SERVER_PATH_LOCK_H_

#include <string>

#include "absl/status/statusor.h"
#include "common/transport/unix_socket.h"

namespace weightd {

class PathLock {
 public:
  // Locks "<path>.lock" (created mode 0600 if absent). FAILED_PRECONDITION
  // naming `path`, the lock file and `flag` (e.g. "--fd-socket") when another
  // process holds it; the errno's status when the lock file cannot be opened.
  static absl::StatusOr<PathLock> Acquire(const std::string& path, const std::string& flag);

  const std::string& path() const { return path_; }

 private:
  PathLock(std::string path, ScopedFd fd) : path_(std::move(path)), fd_(std::move(fd)) {}
  std::string path_;
  ScopedFd fd_;  // closing it releases the lock
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PATH_LOCK_H_
