// An owned file descriptor, closed on destruction (RAII). Move-only.
#ifndef WEIGHTD_COMMON_BASE_SCOPED_FD_H_
#define WEIGHTD_COMMON_BASE_SCOPED_FD_H_

#include <unistd.h>

#include <utility>

namespace weightd {

// Owns a file descriptor; closes it on destruction. Move-only.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() { Reset(); }
  ScopedFd(ScopedFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int Release() { return std::exchange(fd_, -1); }
  void Reset() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

}  // namespace weightd

#endif  // WEIGHTD_COMMON_BASE_SCOPED_FD_H_
