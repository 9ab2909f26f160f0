// HostSegment: one shareable, immutable block of host memory: a memfd
// (memfd_create(2)) that the daemon fills once, then seals so no process can
// change it, and hands to clients as a file descriptor.
//
// Lifecycle: Create() -> fill writable() -> Seal() -> share fd(). Seal()
// drops the writable mapping (F_SEAL_WRITE requires that no writable shared
// mapping exists, see memfd_create(2)/fcntl(2)), adds F_SEAL_SHRINK |
// F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL, maps the memory read-only, and
// mlock()s it when asked and RLIMIT_MEMLOCK allows.
//
// Thread-safety: writable() may be written by many threads at disjoint
// offsets; Create/Seal/destruction are not concurrent with anything else.
#ifndef WEIGHTD_COMMON_HOST_SEGMENT_H_
#define WEIGHTD_COMMON_HOST_SEGMENT_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace weightd {

class HostSegment {
 public:
  // A memfd of `size` bytes named "weightd:<name>" (visible in /proc/PID/fd),
  // mapped read-write. Errors: RESOURCE_EXHAUSTED when memory or fds are short.
  static absl::StatusOr<std::unique_ptr<HostSegment>> Create(const std::string& name, uint64_t size);
  ~HostSegment();
  HostSegment(const HostSegment&) = delete;
  HostSegment& operator=(const HostSegment&) = delete;

  // Before Seal(): the writable mapping (nullptr when size() == 0).
  char* writable() { return sealed_ ? nullptr : base_; }
  // Seals and remaps read-only; then, if `lock`, tries mlock(). A refused
  // mlock is not an error: locked() says whether it took.
  absl::Status Seal(bool lock);

  const char* data() const { return base_; }
  uint64_t size() const { return size_; }
  int fd() const { return fd_; }
  bool sealed() const { return sealed_; }
  bool locked() const { return locked_; }
  // errno of a refused mlock (0 when locked or not attempted).
  int lock_errno() const { return lock_errno_; }

 private:
  HostSegment(int fd, char* base, uint64_t size) : fd_(fd), base_(base), size_(size) {}

  int fd_;
  char* base_;
  uint64_t size_;
  bool sealed_ = false;
  bool locked_ = false;
  int lock_errno_ = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_COMMON_HOST_SEGMENT_H_
