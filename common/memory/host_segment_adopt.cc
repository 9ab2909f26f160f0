// HostSegment::Adopt: taking over a segment that another process sealed.
// Kept apart from the fill path (host_segment.cc): adoption trusts nothing
// but what the kernel says of the fd.
#include <fcntl.h>
#include <sys/mman.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/status.h"
#include "common/memory/host_segment.h"

namespace weightd {

absl::StatusOr<std::unique_ptr<HostSegment>> HostSegment::Adopt(ScopedFd fd, uint64_t size, bool huge) {
  constexpr int kRequired = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL;
  int seals = fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) return absl::FailedPreconditionError("not a sealable memfd (fcntl F_GET_SEALS refused it)");
  if ((seals & kRequired) != kRequired) {
    return absl::FailedPreconditionError(
        absl::StrFormat("memfd lacks its seals (has 0x%x, needs SHRINK|GROW|WRITE|SEAL 0x%x)", seals, kRequired));
  }
  struct stat st {};
  if (fstat(fd.get(), &st) != 0) return ErrnoToStatus("fstat adopted memfd", errno);
  if (static_cast<uint64_t>(st.st_size) != size) {
    return absl::FailedPreconditionError(absl::StrCat("memfd is ", st.st_size, " bytes, the record says ", size));
  }
  // hugetlbfs by its file system, not st_blksize: a shmem memfd reports the
  // 2 MiB PMD size there too whenever shmem THP is enabled (shmem_getattr).
  struct statfs fs {};
  if (fstatfs(fd.get(), &fs) != 0) return ErrnoToStatus("fstatfs adopted memfd", errno);
  bool is_huge = static_cast<uint64_t>(fs.f_type) == HUGETLBFS_MAGIC;
  if (is_huge != huge) {
    return absl::FailedPreconditionError(absl::StrCat("memfd is ", is_huge ? "" : "not ",
                                                      "of 2 MiB hugetlb pages, the record says ", huge ? "2 MiB" : "4 KiB"));
  }
  std::unique_ptr<HostSegment> segment(new HostSegment(fd.Release(), nullptr, size, huge ? PageKind::kHugetlb : PageKind::kSmall));
  segment->sealed_ = true;
  if (size == 0) return segment;
  if (segment->read_only_ == nullptr) {
    void* map = mmap(nullptr, size, PROT_READ, MAP_SHARED, segment->fd_, 0);
    if (map == MAP_FAILED) return ErrnoToStatus("mmap adopted memfd read-only", errno);
    segment->read_only_ = static_cast<char*>(map);
  }
  segment->base_ = segment->read_only_;
  return segment;
}

}  // namespace weightd
