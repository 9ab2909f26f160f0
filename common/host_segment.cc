#include "common/host_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace weightd {

absl::StatusOr<std::unique_ptr<HostSegment>> HostSegment::Create(const std::string& name, uint64_t size) {
  std::string memfd_name = absl::StrCat("weightd:", name).substr(0, 249);  // memfd names are at most 249 bytes
  int fd = memfd_create(memfd_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoToStatus("memfd_create", errno);
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    int err = errno;
    close(fd);
    return ErrnoToStatus(absl::StrCat("ftruncate memfd to ", size, " bytes"), err);
  }
  char* base = nullptr;
  if (size > 0) {
    void* map = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
      int err = errno;
      close(fd);
      return ErrnoToStatus(absl::StrCat("mmap ", size, "-byte memfd"), err);
    }
    // Large segments: ask for transparent huge pages (shmem THP is honoured
    // when /sys/kernel/mm/transparent_hugepage/shmem_enabled allows advise).
    if (size >= (64u << 20)) madvise(map, size, MADV_HUGEPAGE);
    base = static_cast<char*>(map);
  }
  return std::unique_ptr<HostSegment>(new HostSegment(fd, base, size));
}

HostSegment::~HostSegment() {
  if (base_ != nullptr) munmap(base_, size_);
  close(fd_);
}

absl::Status HostSegment::Seal(bool lock) {
  if (sealed_) return absl::FailedPreconditionError("segment already sealed");
  if (base_ != nullptr && munmap(base_, size_) != 0) return ErrnoToStatus("munmap writable segment", errno);
  base_ = nullptr;
  if (fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
    return ErrnoToStatus("fcntl(F_ADD_SEALS)", errno);
  }
  sealed_ = true;
  if (size_ == 0) return absl::OkStatus();
  void* map = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
  if (map == MAP_FAILED) return ErrnoToStatus("mmap sealed segment read-only", errno);
  base_ = static_cast<char*>(map);
  if (lock) {
    if (mlock(base_, size_) == 0) {
      locked_ = true;
    } else {
      lock_errno_ = errno;
    }
  }
  return absl::OkStatus();
}

}  // namespace weightd
