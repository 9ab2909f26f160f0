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
// Locking while filling: Lock(offset, n) mlock()s the pages of a range
// already written, through a read-only mapping of a second, O_RDONLY
// descriptor of the memfd (a read-only mapping of the writable descriptor
// would block F_SEAL_WRITE). Locking each block right after it is written,
// while its pages are in cache, costs almost nothing; locking 2.4 GiB at
// Seal() took ~0.4 s here (docs/performance.md). Seal() then locks only
// what is not locked yet, and keeps that mapping as the sealed one.
//
// Filling: Write() copies with pwrite(2) into the memfd, so the kernel
// allocates each page inside the write instead of through a page fault on
// the mapping (measured ~1.5x faster on small VMs, docs/performance.md).
// A segment of MFD_HUGETLB pages (hugetlbfs has no write(2)) is filled by
// memcpy into writable(); reading straight into writable() is the faster
// path there.
//
// Thread-safety: writable() and Write() may be used by many threads at
// disjoint offsets; Create/Seal/destruction are not concurrent with anything
// else.
#ifndef WEIGHTD_COMMON_MEMORY_HOST_SEGMENT_H_
#define WEIGHTD_COMMON_MEMORY_HOST_SEGMENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/base/scoped_fd.h"

namespace weightd {

// kWhenPoolAllows: a segment of at least kHugeSegmentMinBytes uses
// MFD_HUGETLB (2 MiB pages, size rounded up to a whole page) when
// /proc/meminfo shows enough free huge pages (an operator sets
// vm.nr_hugepages); any refusal falls back to ordinary pages.
enum class HugePages { kNever, kWhenPoolAllows };
inline constexpr uint64_t kHugeSegmentMinBytes = 64ull << 20;

class HostSegment {
 public:
  // A memfd of `size` bytes named "weightd:<name>" (visible in /proc/PID/fd),
  // mapped read-write. Errors: RESOURCE_EXHAUSTED when memory or fds are short.
  static absl::StatusOr<std::unique_ptr<HostSegment>> Create(const std::string& name, uint64_t size,
                                                             HugePages huge = HugePages::kNever);
  // Takes over `fd`, a memfd sealed by an earlier process (a restarted
  // daemon's fd store, server/fd_store.h): it must carry F_SEAL_SHRINK |
  // F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL, be exactly `size` bytes, and be
  // of 2 MiB pages exactly when `huge` (st_blksize). Maps it read-only and
  // lazily; locks nothing. The result is sealed(). Errors:
  // FAILED_PRECONDITION naming the check that failed; the fd is closed.
  static absl::StatusOr<std::unique_ptr<HostSegment>> Adopt(ScopedFd fd, uint64_t size, bool huge);
  ~HostSegment();
  HostSegment(const HostSegment&) = delete;
  HostSegment& operator=(const HostSegment&) = delete;

  // Before Seal(): the writable mapping (nullptr when size() == 0).
  char* writable() { return sealed_ ? nullptr : base_; }
  // Before Seal(): mlock()s the pages holding bytes [offset, offset + n)
  // (written already); a refusal is kept in lock_errno() and later calls do
  // nothing. Seal(true) skips the final mlock when every page is locked.
  void Lock(uint64_t offset, uint64_t n);
  // Before Seal(): copies `n` bytes from `src` to byte `offset`.
  // OUT_OF_RANGE past size(); a failed pwrite keeps errno (ENOSPC, ENOMEM
  // are RESOURCE_EXHAUSTED).
  absl::Status Write(uint64_t offset, const char* src, uint64_t n);
  // Seals and remaps read-only; then, if `lock`, tries mlock(). A refused
  // mlock is not an error: locked() says whether it took. While another
  // process maps the memfd writable the kernel refuses F_SEAL_WRITE (EBUSY,
  // FAILED_PRECONDITION here); the segment then stays unsealed, without its
  // writable mapping, and Seal() may be called again.
  absl::Status Seal(bool lock);
  // Before Seal(): fixes the size (F_SEAL_SHRINK | F_SEAL_GROW) so that an fd
  // handed to a writer process can change bytes but never truncate the
  // memory under the daemon's mappings (a read past a truncated memfd's end
  // is SIGBUS).
  absl::Status SealSize();
  // Before Seal(): gives the memory back to the kernel (fallocate(2)
  // FALLOC_FL_PUNCH_HOLE over the whole size), so that another process still
  // holding the memfd's fd keeps an empty file, not the daemon's pages. For
  // an update that ends without a commit. Best effort; no-op once sealed.
  void Discard();

  const char* data() const { return base_; }
  uint64_t size() const { return size_; }  // with huge pages: rounded up to 2 MiB
  bool huge_pages() const { return huge_; }
  int fd() const { return fd_; }
  bool sealed() const { return sealed_; }
  bool locked() const { return locked_; }
  // errno of a refused mlock (0 when locked or not attempted).
  int lock_errno() const { return lock_errno_; }

 private:
  HostSegment(int fd, char* base, uint64_t size, bool huge);

  int fd_;
  char* base_;               // writable until sealed, then read-only
  char* read_only_ = nullptr;  // the O_RDONLY mapping Lock() uses; null without /proc
  uint64_t size_;
  bool huge_;
  uint64_t page_bytes_ = 0;  // 4 KiB, or 2 MiB with huge pages
  uint64_t pages_ = 0;
  std::unique_ptr<std::atomic<uint64_t>[]> lock_bits_;  // one bit per page locked
  std::atomic<uint64_t> pages_locked_{0};
  std::atomic<int> fill_lock_errno_{0};
  bool sealed_ = false;
  bool locked_ = false;
  int lock_errno_ = 0;
};

// Client side: maps `size` bytes (> 0) of a received segment fd lazily
// (pages fault in on first use). Without `copy_on_write`: shared and
// read-only, so a write raises SIGSEGV. With it: private and writable
// (MAP_PRIVATE, PROT_READ|PROT_WRITE, allowed on a write-sealed memfd since
// F_SEAL_WRITE forbids only shared writable mappings): reads share the
// segment's pages, the first write to a page copies that page (4 KiB, or
// 2 MiB from the huge page pool for an MFD_HUGETLB segment) into this process,
// and the segment itself never changes. The caller owns the mapping
// (munmap). Errors keep errno (ENOMEM: RESOURCE_EXHAUSTED).
// With `prefault`, also PrefaultMapping() before returning (unmapping again
// if that fails).
absl::StatusOr<char*> MapSegmentFd(int fd, uint64_t size, bool copy_on_write, bool prefault = false);

// Maps every page of [addr, addr + size) of a mapping made by MapSegmentFd
// into this process's page tables now, reading, never writing: a
// copy-on-write mapping keeps sharing the segment's pages (MAP_POPULATE would
// copy them all, see mmap(2)). Uses madvise(MADV_POPULATE_READ) (Linux 5.14,
// madvise(2)); on older kernels (EINVAL) reads one byte of every page
// instead. Costs about what the page faults it saves cost, once; afterwards
// the first use of each page takes no fault. Errors keep errno (ENOMEM:
// RESOURCE_EXHAUSTED; EFAULT where the memory cannot be backed).
absl::Status PrefaultMapping(const char* addr, uint64_t size);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_MEMORY_HOST_SEGMENT_H_
