// SegmentPinner: mlock()s the host segments of published generations on a
// thread of its own, so that locking is not on a load's critical path
// (locking each block while filling cost 27-36% of a load,
// docs/performance.md) while the host tables still end up pinned, as the
// daemon promises (--mlock). A generation's locked_bytes is 0 when it is
// published and becomes the bytes actually locked when its turn comes;
// segments shared with an earlier generation are locked once
// (HostSegment::Pin is idempotent).
//
// Pinning is background work and runs as such: the thread runs at nice 19
// (setpriority(2) on its own thread id), so that on a busy node an attach,
// a load or a starting daemon's gRPC set-up gets the cores first, and a
// pinner made with `held` starts only at Release() (the daemon releases it
// once it listens: a restart is not slowed by re-pinning what it restored).
//
// Thread-safety: Pin() from any thread; `done` runs on the pinning thread,
// with no lock of the pinner held.
#ifndef WEIGHTD_SERVER_MODEL_SEGMENT_PINNER_H_
#define WEIGHTD_SERVER_MODEL_SEGMENT_PINNER_H_

#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "server/model/model.h"

namespace weightd {

struct PinResult {
  uint64_t locked_bytes = 0;
  uint64_t host_bytes = 0;
  int lock_errno = 0;  // of the first segment mlock() refused (RLIMIT_MEMLOCK: ENOMEM or EPERM)
  double seconds = 0;
};

class SegmentPinner {
 public:
  using DoneFn = std::function<void(ModelGeneration& model, const PinResult& result)>;
  // `held`: queue pins but start none until Release().
  explicit SegmentPinner(DoneFn done, bool held = false);
  // Stops at the next segment boundary (pins handed in and not reached are
  // dropped) and joins the thread.
  ~SegmentPinner();
  // The same, earlier: no `done` runs after it returns. Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  SegmentPinner(const SegmentPinner&) = delete;
  SegmentPinner& operator=(const SegmentPinner&) = delete;

  // Lets a held pinner start on its queue. Idempotent.
  void Release() ABSL_LOCKS_EXCLUDED(mu_);

  // Queues `model` for pinning. Held weakly: a generation freed before its
  // turn is skipped; during its turn the pinner holds it.
  void Pin(const std::shared_ptr<ModelGeneration>& model) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  PinResult PinAll(const ModelGeneration& model) ABSL_LOCKS_EXCLUDED(mu_);
  bool stopping() const ABSL_LOCKS_EXCLUDED(mu_);

  DoneFn done_;
  mutable absl::Mutex mu_;
  std::deque<std::weak_ptr<ModelGeneration>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool held_ ABSL_GUARDED_BY(mu_);
  std::once_flag joined_;
  std::thread thread_;  // last: started after the members it uses
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MODEL_SEGMENT_PINNER_H_
