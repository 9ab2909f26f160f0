// Admission of loads against host memory: a load's host-resident bytes must
// fit in what the node and the daemon's cgroup can still give
// (common/io/host_memory.h) minus the bytes already promised to loads in
// flight, checked before anything is allocated. Two loads that fit alone but
// not together: the second is refused with RESOURCE_EXHAUSTED rather than
// meeting the OOM killer, which would take every model and lease with it.
//
// A load's promise is held at its full size until the load ends, also for
// the part already allocated (which the budget by then counts as used): a
// concurrent load may be refused early by up to that amount, never admitted
// late. When it ends, the memory is either freed or counted by the kernel.
//
// Thread-safety: every method may be called from any thread.
#ifndef WEIGHTD_SERVER_MODEL_MEMORY_ADMISSION_H_
#define WEIGHTD_SERVER_MODEL_MEMORY_ADMISSION_H_

#include <cstdint>
#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/io/host_memory.h"
#include "absl/synchronization/mutex.h"

namespace weightd {

class HostMemoryAdmission {
 public:
  // Reads the budget; errors make admission allow the load (a node whose
  // /proc cannot be read is not made unusable), with one warning log line.
  using Probe = std::function<absl::StatusOr<HostMemoryBudget>()>;
  // The default probe reads the running system (ReadHostMemoryBudget).
  explicit HostMemoryAdmission(Probe probe = nullptr);
  HostMemoryAdmission(const HostMemoryAdmission&) = delete;
  HostMemoryAdmission& operator=(const HostMemoryAdmission&) = delete;

  // Bytes promised to one load until it is destroyed. Move-only; must not
  // outlive the admission that issued it.
  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& o) noexcept;
    Reservation& operator=(Reservation&& o) noexcept;
    ~Reservation();
    uint64_t bytes() const { return bytes_; }

   private:
    friend class HostMemoryAdmission;
    Reservation(HostMemoryAdmission* owner, uint64_t bytes) : owner_(owner), bytes_(bytes) {}
    HostMemoryAdmission* owner_ = nullptr;
    uint64_t bytes_ = 0;
  };

  // Promises `bytes` to the load of `model` when they fit, else
  // RESOURCE_EXHAUSTED naming the bytes needed, the bytes available, what
  // bounded them and what loads in flight hold. 0 bytes always fit.
  absl::StatusOr<Reservation> Reserve(const std::string& model, uint64_t bytes);
  // Bytes promised to loads in flight now.
  uint64_t promised() const;

 private:
  void Release(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  Probe probe_;
  mutable absl::Mutex mu_;
  uint64_t promised_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MODEL_MEMORY_ADMISSION_H_
