#include "server/path_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace weightd {

absl::StatusOr<PathLock> PathLock::Acquire(const std::string& path, const std::string& flag) {
  std::string lock_path = path + ".lock";
  // O_NOFOLLOW: whoever can write the socket's folder must not make a root
  // daemon create or lock a file elsewhere through a symlink.
  ScopedFd fd(open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0600));
  if (!fd.valid() && errno == ELOOP) {
    return absl::FailedPreconditionError(absl::StrCat(lock_path, ": is a symbolic link; refusing to follow it"));
  }
  if (!fd.valid()) return ErrnoToStatus(absl::StrCat("open ", lock_path), errno);
  struct stat st;
  if (fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(lock_path, ": is not a regular file; refusing to use it as a lock"));
  }
  if (flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) return ErrnoToStatus(absl::StrCat("flock ", lock_path), errno);
    return absl::FailedPreconditionError(absl::StrCat("another weightd is serving ", path, " (it holds ", lock_path,
                                                      "); stop it first or use another ", flag));
  }
  return PathLock(path, std::move(fd));
}

}  // namespace weightd
