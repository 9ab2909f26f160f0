// SourceFill: the host segments of a load filled by a HostSource
// (server/load/loader.h) instead of the checkpoint's files: peer seeding,
// where a transfer helper that the daemon does not trust writes them.
//
// The order that makes that safe, per segment (the writer path's rule,
// server/update/update.h):
//   1. the source reports the segment filled (and says nothing of it maps
//      it writable any more);
//   2. the segment is sealed (HostSegment::Seal: F_SEAL_WRITE, which the
//      kernel refuses with EBUSY while any process, a helper or a child it
//      forked, still maps it writable; that fails the load);
//   3. only then is it read: every tensor hashed per kHashBlockBytes block
//      (the loader's content hash), and every byte no tensor covers checked
//      to be zero (DATA_LOSS naming the segment and byte otherwise).
// Nothing can change the bytes between 3 and serving. The caller compares
// the hashes with what it expects (the seed's).
//
// Steps 2-3 run on `threads` hashing threads as segments are reported, so
// hashing overlaps the arrival of later segments (SourceHashing::kPerSegment);
// with kPerTransfer step 2 still follows each report but step 3 waits until
// the source has returned, and then hashes every segment. One more thread makes the
// pages of the segments ahead of the source, in plan order
// (HostSegment::Preallocate; Populate for THP): creating a fresh page
// (allocating and zeroing it) is the costliest part of receiving on a VM
// (83% of a joiner helper's CPU time on 4 KiB pages, docs/performance.md),
// and this moves it off the receiving process
// onto another core. A segment is never sealed while it is being populated.
//
// Thread-safety: Start, Wait and destruction from one thread;
// bytes_hashed() from any.
#ifndef WEIGHTD_SERVER_LOAD_SOURCE_FILL_H_
#define WEIGHTD_SERVER_LOAD_SOURCE_FILL_H_

#include <atomic>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/memory/host_segment.h"
#include "server/load/loader.h"

namespace weightd {

// A tensor of a host segment: catalog index, bytes [offset, offset + nbytes).
struct SegmentTensor {
  uint32_t tensor = 0;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
};

class SourceFill {
 public:
  // `segments` (not owned, fresh and unsealed) and `tensors` are parallel
  // and outlive this; block hashes go to `block_hashes[tensor]` (sized by
  // the caller: one entry per kHashBlockBytes block).
  SourceFill(HostSource& source, std::vector<HostSegment*> segments, std::vector<std::vector<SegmentTensor>> tensors,
             std::vector<std::vector<uint64_t>>& block_hashes);
  ~SourceFill();  // waits for the threads (Wait() was called, or is now)

  // When set and true, the next segment reported filled is refused with
  // UNAVAILABLE (daemon shutdown), which stops the source. Not owned.
  void set_cancel(const std::atomic<bool>* cancel) { cancel_ = cancel; }
  // Before Start(): when the segments are hashed (kPerSegment by default).
  void set_hashing(SourceHashing hashing) { hashing_ = hashing; }
  // Starts the source's Fill on a thread of its own and `threads` hashers.
  void Start(int threads);
  // Waits for the fill and every hash: OK when every segment is sealed and
  // hashed; else the first error (the source's, a refused seal, a non-zero
  // byte outside the tensors).
  absl::Status Wait();
  uint64_t bytes_hashed() const { return hashed_.load(); }

 private:
  absl::Status Filled(uint32_t segment) ABSL_LOCKS_EXCLUDED(mu_);
  void Hasher() ABSL_LOCKS_EXCLUDED(mu_);
  void Populator() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status HashSegment(uint32_t segment);
  void Finish(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  HostSource& source_;
  const std::vector<HostSegment*> segments_;
  const std::vector<std::vector<SegmentTensor>> tensors_;
  std::vector<std::vector<uint64_t>>& block_hashes_;
  std::atomic<uint64_t> hashed_{0};
  const std::atomic<bool>* cancel_ = nullptr;
  SourceHashing hashing_ = SourceHashing::kPerSegment;
  std::vector<std::thread> threads_;
  absl::Mutex mu_;
  std::deque<uint32_t> queue_ ABSL_GUARDED_BY(mu_);
  // Per segment: the populator's hold (it works on the segment's writable
  // mapping, which the seal removes).
  enum class Stage : uint8_t { kFresh, kPopulating, kReported };
  std::vector<Stage> stage_ ABSL_GUARDED_BY(mu_);
  bool fill_done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LOAD_SOURCE_FILL_H_
