// HostFill: how one block of checkpoint bytes gets into a host segment
// during a load, for each kind of page (common/memory/huge_pages.h), with
// the content hash computed on each 1 MiB slice while it is in cache (no
// second pass over memory):
//   kSmall     read a slice into the thread's bounce buffer, hash it,
//              pwrite(2) it into the memfd (the kernel allocates pages
//              inside the write; no page faults);
//   kHugetlb   populate the block's 2 MiB pages (MADV_POPULATE_WRITE),
//   kShmemThp  then read each slice straight into the mapping and hash it.
// A THP block whose populate runs below HugeFillBudget's floor (CPU time) for
// `stall_blocks` blocks in a row on one thread (the kernel compacting
// memory to find 2 MiB blocks) makes the rest of the load use 4 KiB pages:
// THP segments are then filled like kSmall ones after
// madvise(MADV_NOHUGEPAGE). O_DIRECT files are read a block at a time (the
// disk wants large requests) and hashed after.
//
// Thread-safety: FillBlock and ReadHashed may be called from many threads
// at once, each with its own FillThread, and never two threads on one
// segment at once (the loader gives each segment to one thread: pwrite on
// one memfd serialises on its inode lock). stalled()/stall_note() are
// thread-safe.
#ifndef WEIGHTD_SERVER_LOAD_HOST_FILL_H_
#define WEIGHTD_SERVER_LOAD_HOST_FILL_H_

#include <xxhash.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/memory/host_segment.h"
#include "server/load/reader.h"

namespace weightd {

inline constexpr uint64_t kFillSliceBytes = 1ull << 20;

// When a THP fill counts as stalled: populates timed in the thread's CPU
// time (CLOCK_THREAD_CPUTIME_ID: direct compaction runs in the populating
// thread; waiting for a CPU on a busy machine does not count). The default
// floor, 0.5 GB/s, is below a huge-page populate without compaction here
// (3-6 GB/s: zeroing) and above one that compacts (0.3-0.4 GB/s),
// docs/performance.md; two blocks in a row, each populating at least
// `min_block_bytes` (a shorter one is too quick to time).
// Tests set the floor to infinity to force the fall-back.
struct HugeFillBudget {
  double min_populate_bytes_per_second = 0.5e9;
  int stall_blocks = 2;
  uint64_t min_block_bytes = 8ull << 20;
};

// One filling thread's state.
struct FillThread {
  FillThread();
  ReadBuffer scratch;  // bounce buffer (kSmall) and O_DIRECT heads and tails
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> hasher;
  int slow_blocks = 0;  // THP populates below the floor in a row
};

class HostFill {
 public:
  HostFill(const CheckpointReader& reader, HugeFillBudget budget) : reader_(reader), budget_(budget) {}

  // Reads `n` bytes at `file_offset` of catalog file `file` into `segment`
  // at byte `at` (not sealed) and returns their XXH3-64. Errors: the read's
  // (naming file and offset), a write's or a populate's.
  absl::StatusOr<uint64_t> FillBlock(uint32_t file, uint64_t file_offset, uint64_t n, HostSegment& segment,
                                     uint64_t at, FillThread& thread);
  // The same into plain memory `dst` (a staging buffer), hashed per slice.
  absl::StatusOr<uint64_t> ReadHashed(uint32_t file, uint64_t file_offset, uint64_t n, char* dst, FillThread& thread);

  // Whether the load fell back to 4 KiB pages, and a phrase saying when and why.
  bool stalled() const { return stalled_.load(); }
  std::string stall_note() const ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes filled through huge-page populates (THP and hugetlb).
  uint64_t populated_bytes() const { return populated_.load(); }

 private:
  absl::StatusOr<uint64_t> Pwrite(uint32_t file, uint64_t file_offset, uint64_t n, HostSegment& segment, uint64_t at,
                                  FillThread& thread);
  // Times the populate of a THP block and applies the budget.
  absl::Status PopulateThp(HostSegment& segment, uint64_t at, uint64_t n, FillThread& thread);

  const CheckpointReader& reader_;
  const HugeFillBudget budget_;
  std::atomic<bool> stalled_{false};
  std::atomic<bool> no_populate_{false};  // the kernel lacks MADV_POPULATE_WRITE
  std::atomic<uint64_t> populated_{0};
  mutable absl::Mutex mu_;
  std::string stall_note_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LOAD_HOST_FILL_H_
