#include "common/memory/host_segment.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"

namespace weightd {

namespace {

// MADV_POPULATE_WRITE (Linux 5.14, include/uapi/asm-generic/mman-common.h)
// for C libraries that predate it.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// A sealable MFD_HUGETLB memfd of `size` bytes mapped read-write, or -1
// (and no resources held) when the pool or the kernel refuses.
int CreateHuge(const std::string& memfd_name, uint64_t size, char** base) {
  int fd = memfd_create(memfd_name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
  if (fd < 0) return -1;
  // mmap reserves the huge pages: it fails with ENOMEM when the pool ran short.
  void* map = ftruncate(fd, static_cast<off_t>(size)) == 0
                  ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                  : MAP_FAILED;
  if (map == MAP_FAILED) {
    close(fd);
    return -1;
  }
  *base = static_cast<char*>(map);
  return fd;
}

// A read-only mapping of `fd` through a new O_RDONLY descriptor (its
// VMA lacks VM_MAYWRITE, so it does not block F_SEAL_WRITE); null when
// /proc is unavailable.
char* MapReadOnlyCopy(int fd, uint64_t size) {
  int ro = open(absl::StrCat("/proc/self/fd/", fd).c_str(), O_RDONLY | O_CLOEXEC);
  if (ro < 0) return nullptr;
  void* map = mmap(nullptr, size, PROT_READ, MAP_SHARED, ro, 0);
  close(ro);  // the mapping keeps the file
  return map == MAP_FAILED ? nullptr : static_cast<char*>(map);
}

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

}  // namespace

absl::StatusOr<std::unique_ptr<HostSegment>> HostSegment::Create(const std::string& name, uint64_t size,
                                                                 const PageChoice& pages) {
  std::string memfd_name = absl::StrCat("weightd:", name).substr(0, 249);  // memfd names are at most 249 bytes
  if (pages.kind == PageKind::kHugetlb && size >= kHugeSegmentMinBytes) {
    uint64_t rounded = RoundUp(size, kHugePageBytes);
    char* base = nullptr;
    int fd = CreateHuge(memfd_name, rounded, &base);
    if (fd >= 0) return std::unique_ptr<HostSegment>(new HostSegment(fd, base, rounded, PageKind::kHugetlb));
  }
  PageKind kind = pages.kind == PageKind::kHugetlb ? pages.fallback : pages.kind;
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
    // With shmem_enabled "advise", only an advised mapping gets huge pages.
    if (kind == PageKind::kShmemThp && pages.advise) madvise(map, size, MADV_HUGEPAGE);
    base = static_cast<char*>(map);
  }
  return std::unique_ptr<HostSegment>(new HostSegment(fd, base, size, kind));
}

absl::StatusOr<uint64_t> HostSegment::Populate(uint64_t offset, uint64_t n) {
  if (sealed_) return absl::FailedPreconditionError("segment already sealed");
  if (offset > size_ || n > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("populate of ", n, " bytes at ", offset, " past a ", size_, "-byte segment"));
  }
  if (n == 0) return 0;
  uint64_t page = kind_ == PageKind::kSmall ? static_cast<uint64_t>(sysconf(_SC_PAGESIZE)) : kHugePageBytes;
  uint64_t start = offset / page * page;
  uint64_t end = std::min(RoundUp(offset + n, page), RoundUp(size_, static_cast<uint64_t>(sysconf(_SC_PAGESIZE))));
  if (madvise(base_ + start, end - start, MADV_POPULATE_WRITE) == 0) return end - start;
  if (errno == EINVAL) return absl::UnimplementedError("madvise(MADV_POPULATE_WRITE) needs Linux 5.14");
  if (errno == EFAULT) {
    return absl::ResourceExhaustedError(absl::StrCat("populating ", end - start, " bytes at ", start,
                                                     " of a huge page segment failed (EFAULT: the pool ran short)"));
  }
  return ErrnoToStatus(absl::StrCat("madvise(MADV_POPULATE_WRITE) of ", end - start, " bytes"), errno);
}

absl::Status HostSegment::Preallocate() {
  if (sealed_) return absl::FailedPreconditionError("segment already sealed");
  if (size_ == 0) return absl::OkStatus();
  while (fallocate(fd_, 0, 0, static_cast<off_t>(size_)) != 0) {
    if (errno != EINTR) return ErrnoToStatus(absl::StrCat("fallocate of a ", size_, "-byte segment"), errno);
  }
  return absl::OkStatus();
}

void HostSegment::AvoidHugePages() {
  if (!sealed_ && base_ != nullptr && kind_ == PageKind::kShmemThp) madvise(base_, size_, MADV_NOHUGEPAGE);
}

absl::Status HostSegment::Write(uint64_t offset, const char* src, uint64_t n) {
  if (sealed_) return absl::FailedPreconditionError("segment already sealed");
  if (offset > size_ || n > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("write of ", n, " bytes at ", offset, " past a ", size_, "-byte segment"));
  }
  if (kind_ == PageKind::kHugetlb) {
    std::memcpy(base_ + offset, src, n);
    return absl::OkStatus();
  }
  while (n > 0) {
    ssize_t put = pwrite(fd_, src, n, static_cast<off_t>(offset));
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return ErrnoToStatus(absl::StrCat("pwrite to memfd at byte ", offset), put < 0 ? errno : ENOSPC);
    src += put;
    offset += static_cast<uint64_t>(put);
    n -= static_cast<uint64_t>(put);
  }
  return absl::OkStatus();
}

HostSegment::HostSegment(int fd, char* base, uint64_t size, PageKind kind)
    : fd_(fd), base_(base), size_(size), kind_(kind) {
  if (size_ == 0) return;
  read_only_ = MapReadOnlyCopy(fd_, size_);
  // The sealed mapping of a THP segment maps its 2 MiB pages whole (one PMD
  // each) when advised: pinning 2.4 GiB then maps 1,200 entries, not 600k.
  if (read_only_ != nullptr && kind_ == PageKind::kShmemThp) madvise(read_only_, size_, MADV_HUGEPAGE);
}

HostSegment::~HostSegment() {
  if (base_ != nullptr) munmap(base_, size_);
  if (read_only_ != nullptr && read_only_ != base_) munmap(read_only_, size_);
  close(fd_);
}

bool HostSegment::Pin() const {
  if (!sealed_ || size_ == 0) return false;
  absl::MutexLock lock(&pin_mu_);
  if (locked_.load() || lock_errno_.load() != 0) return locked_.load();
  // In pieces: mlock(2) holds the process's mmap lock while it maps a range,
  // and every allocation or page fault of the daemon's other threads (an
  // Attach answered meanwhile) waits for it. Pinning 2.4 GiB in one call
  // stalled the first Attach after a load by ~100 ms; a piece takes a few ms.
  for (uint64_t done = 0; done < size_; done += kPinPieceBytes) {
    if (mlock(base_ + done, std::min(kPinPieceBytes, size_ - done)) != 0) {
      lock_errno_ = errno;
      if (done > 0) munlock(base_, done);  // all or nothing: locked() and locked bytes stay true
      return false;
    }
  }
  locked_ = true;
  return true;
}

uint64_t HostSegment::DropPageTables() const {
  if (!sealed_ || size_ == 0 || base_ == nullptr) return 0;
  absl::MutexLock lock(&pin_mu_);
  for (uint64_t done = 0; done < size_; done += kPinPieceBytes) {
    uint64_t n = std::min(kPinPieceBytes, size_ - done);
    if (locked_.load()) munlock(base_ + done, n);
    (void)madvise(base_ + done, n, MADV_DONTNEED);  // best effort: at worst exit tears them down
  }
  locked_ = false;
  return size_;
}

absl::Status HostSegment::SealSize() {
  if (sealed_) return absl::OkStatus();
  if (fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) != 0) return ErrnoToStatus("fcntl(F_ADD_SEALS size)", errno);
  return absl::OkStatus();
}

void HostSegment::Discard() {
  if (sealed_ || size_ == 0) return;
  // Whole pages only are freed: round the hole up past the last partial page.
  uint64_t page = kind_ == PageKind::kHugetlb ? kHugePageBytes : static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t len = (size_ + page - 1) / page * page;
  (void)fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, static_cast<off_t>(len));
}

absl::Status HostSegment::Seal(bool lock) {
  if (sealed_) return absl::FailedPreconditionError("segment already sealed");
  if (base_ != nullptr && munmap(base_, size_) != 0) return ErrnoToStatus("munmap writable segment", errno);
  base_ = nullptr;
  if (fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL) != 0) {
    if (errno == EBUSY) {
      return absl::FailedPreconditionError(
          "the memfd is still mapped writable by a process (F_SEAL_WRITE refused with EBUSY): unmap it first");
    }
    if (errno == EPERM) {
      return absl::PermissionDeniedError(
          "the memfd can take no more seals (another process holding its fd added F_SEAL_SEAL)");
    }
    return ErrnoToStatus("fcntl(F_ADD_SEALS)", errno);
  }
  sealed_ = true;
  if (size_ == 0) return absl::OkStatus();
  if (read_only_ == nullptr) {
    void* map = mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_, 0);
    if (map == MAP_FAILED) return ErrnoToStatus("mmap sealed segment read-only", errno);
    read_only_ = static_cast<char*>(map);
  }
  base_ = read_only_;
  if (lock) Pin();
  return absl::OkStatus();
}

absl::StatusOr<char*> MapSegmentFd(int fd, uint64_t size, bool copy_on_write, bool prefault) {
  int prot = copy_on_write ? PROT_READ | PROT_WRITE : PROT_READ;
  void* map = mmap(nullptr, size, prot, copy_on_write ? MAP_PRIVATE : MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) {
    return ErrnoToStatus(absl::StrCat("mmap segment fd ", fd, copy_on_write ? " copy-on-write" : " read-only"), errno);
  }
  if (prefault) {
    absl::Status populated = PrefaultMapping(static_cast<const char*>(map), size);
    if (!populated.ok()) {
      munmap(map, size);
      return populated;
    }
  }
  return static_cast<char*>(map);
}

absl::Status PrefaultMapping(const char* addr, uint64_t size) {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;  // <linux/mman.h>, Linux 5.14; older headers lack it
#endif
  if (size == 0) return absl::OkStatus();
  for (;;) {
    if (madvise(const_cast<char*>(addr), size, MADV_POPULATE_READ) == 0) return absl::OkStatus();
    if (errno == EINTR) continue;
    if (errno != EINVAL) return ErrnoToStatus("madvise(MADV_POPULATE_READ) of a segment mapping", errno);
    break;  // a kernel before 5.14
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const volatile char* p = addr;
  char sink = 0;
  for (uint64_t off = 0; off < size; off += page) sink ^= p[off];
  (void)sink;
  return absl::OkStatus();
}

}  // namespace weightd
