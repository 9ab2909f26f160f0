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
// Pages (common/memory/huge_pages.h): a segment gets the PageChoice it is
// created with. kSmall segments are filled with Write() (pwrite(2)), so the
// kernel allocates each page inside the write instead of through a page
// fault on the mapping (measured ~1.5x faster on small VMs,
// docs/performance.md). kHugetlb segments (MFD_HUGETLB: hugetlbfs has no
// write(2)) and kShmemThp segments (THP is decided when a page is allocated
// through a mapping; pwrite would allocate 4 KiB pages) are filled through
// writable(): Populate() a range (MADV_POPULATE_WRITE, one call allocates,
// zeroes and maps its pages), then read or copy into it.
//
// Locking off the load's critical path: Seal(false), then Pin() from any
// thread once the segment is published; locked() turns true when it took.
//
// Thread-safety: writable(), Populate() and Write() may be used by many
// threads at disjoint offsets (one writer per memfd avoids the inode lock
// pwrite takes, docs/performance.md); Pin(), locked(), lock_errno() and the
// const accessors by any thread after Seal(); Create/Seal/destruction are
// not concurrent with anything else.
#ifndef WEIGHTD_COMMON_MEMORY_HOST_SEGMENT_H_
#define WEIGHTD_COMMON_MEMORY_HOST_SEGMENT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/base/scoped_fd.h"
#include "common/memory/huge_pages.h"

namespace weightd {

// A segment smaller than this never takes hugetlb pages (it would round
// up to a whole 2 MiB page): it gets the choice's fallback.
inline constexpr uint64_t kHugeSegmentMinBytes = 2ull << 20;

class HostSegment {
 public:
  // A memfd of `size` bytes named "weightd:<name>" (visible in /proc/PID/fd),
  // mapped read-write, of the pages `pages` asks for: kHugetlb when the
  // pool grants them (size rounded up to 2 MiB), else pages.fallback;
  // kShmemThp with madvise(MADV_HUGEPAGE) when pages.advise. page_kind()
  // says what it got. Errors: RESOURCE_EXHAUSTED when memory or fds are short.
  static absl::StatusOr<std::unique_ptr<HostSegment>> Create(const std::string& name, uint64_t size,
                                                             const PageChoice& pages = {});
  // Takes over `fd`, a memfd sealed by an earlier process (a restarted
  // daemon's fd store, server/restart/fd_store.h): it must carry F_SEAL_SHRINK |
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
  // Before Seal(): allocates the pages holding bytes [offset, offset + n)
  // through the writable mapping (madvise(MADV_POPULATE_WRITE), Linux
  // 5.14+), whole 2 MiB pages for huge kinds. UNIMPLEMENTED when the kernel
  // lacks it (EINVAL): the caller just writes, and pages fault in.
  // RESOURCE_EXHAUSTED on ENOMEM (or a hugetlb pool run dry: EFAULT).
  // Returns the bytes of the whole pages it covered.
  absl::StatusOr<uint64_t> Populate(uint64_t offset, uint64_t n);
  // Before Seal(): allocates (and the kernel zeroes) every page of the
  // segment without mapping any (fallocate(2)), for a segment that another
  // process fills through its own mapping (peer seeding,
  // server/load/source_fill.h): the pages' creation then costs this thread,
  // not the filler, and this process tears down no page table entries at
  // Seal(). Not for kShmemThp (no mapping advises the allocation: the pages
  // would be 4 KiB). Errors keep errno (ENOSPC, ENOMEM: RESOURCE_EXHAUSTED).
  absl::Status Preallocate();
  // Before Seal(): asks that pages not allocated yet be 4 KiB
  // (madvise(MADV_NOHUGEPAGE)), after a compaction stall. Best effort.
  void AvoidHugePages();
  // Before Seal(): copies `n` bytes from `src` to byte `offset` (pwrite(2);
  // memcpy into writable() for kHugetlb).
  // OUT_OF_RANGE past size(); a failed pwrite keeps errno (ENOSPC, ENOMEM
  // are RESOURCE_EXHAUSTED).
  absl::Status Write(uint64_t offset, const char* src, uint64_t n);
  // Seals and remaps read-only; then, if `lock`, Pin(). A refused mlock is
  // not an error: locked() says whether it took. While another
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

  // After Seal(): mlock()s the whole segment unless done already; returns
  // locked(). A refusal (RLIMIT_MEMLOCK, EPERM, ENOMEM) is kept in
  // lock_errno() and not retried. Thread-safe; concurrent calls lock once.
  bool Pin() const;
  // Pin() locks this many bytes per mlock(2) call (a multiple of 2 MiB).
  static constexpr uint64_t kPinPieceBytes = 64ull << 20;
  // After Seal(): drops this process's page table entries for the segment,
  // in kPinPieceBytes pieces: munlock(2) if Pin() took, then
  // madvise(MADV_DONTNEED). The bytes stay in the memfd (on a shared mapping
  // MADV_DONTNEED only unmaps, madvise(2)); a later read of data() faults
  // them back in, so this is safe while other threads read. For shutdown:
  // tearing down the entries of 4 KiB pages at exit costs about 70 ns a
  // page (170 ms for 2.4 GiB on the reference machine, docs/performance.md),
  // which the daemon pays here while it still answers, not while it is down.
  // Returns the bytes whose entries were dropped (0 before Seal()); a
  // later Pin() locks again. Thread-safe.
  uint64_t DropPageTables() const;

  const char* data() const { return base_; }
  uint64_t size() const { return size_; }  // kHugetlb: rounded up to 2 MiB
  PageKind page_kind() const { return kind_; }
  // An MFD_HUGETLB memfd (st_blksize 2 MiB): what the fd store records.
  bool huge_pages() const { return kind_ == PageKind::kHugetlb; }
  // Bytes on 2 MiB pages: size() for kHugetlb; for kShmemThp what the
  // filler measured (set_huge_bytes), 0 until then.
  uint64_t huge_bytes() const { return kind_ == PageKind::kHugetlb ? size_ : huge_bytes_; }
  void set_huge_bytes(uint64_t bytes) { huge_bytes_ = bytes; }
  int fd() const { return fd_; }
  bool sealed() const { return sealed_; }
  bool locked() const { return locked_.load(); }
  // errno of a refused mlock (0 when locked or not attempted).
  int lock_errno() const { return lock_errno_.load(); }

 private:
  HostSegment(int fd, char* base, uint64_t size, PageKind kind);

  int fd_;
  char* base_;               // writable until sealed, then read-only
  char* read_only_ = nullptr;  // mapping of an O_RDONLY descriptor, kept as the sealed one; null without /proc
  uint64_t size_;
  PageKind kind_;
  uint64_t huge_bytes_ = 0;
  bool sealed_ = false;
  mutable absl::Mutex pin_mu_;  // one mlock at a time
  mutable std::atomic<bool> locked_{false};
  mutable std::atomic<int> lock_errno_{0};
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
