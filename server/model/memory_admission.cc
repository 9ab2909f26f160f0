#include "server/model/memory_admission.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"

namespace weightd {

HostMemoryAdmission::HostMemoryAdmission(Probe probe)
    : probe_(probe ? std::move(probe) : Probe([] { return ReadHostMemoryBudget(); })) {}

HostMemoryAdmission::Reservation::Reservation(Reservation&& o) noexcept
    : owner_(std::exchange(o.owner_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}

HostMemoryAdmission::Reservation& HostMemoryAdmission::Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    if (owner_ != nullptr) owner_->Release(bytes_);
    owner_ = std::exchange(o.owner_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

HostMemoryAdmission::Reservation::~Reservation() {
  if (owner_ != nullptr) owner_->Release(bytes_);
}

absl::StatusOr<HostMemoryAdmission::Reservation> HostMemoryAdmission::Reserve(const std::string& model,
                                                                              uint64_t bytes) {
  if (bytes == 0) return Reservation();
  // The probe runs under the lock: two loads admitted at once must not both
  // count the same free memory.
  absl::MutexLock lock(&mu_);
  absl::StatusOr<HostMemoryBudget> budget = probe_();
  if (!budget.ok()) {
    LogWarning(absl::StrCat("load of '", model, "': host memory admission skipped: ", budget.status().message()));
  } else {
    uint64_t available = budget->available > promised_ ? budget->available - promised_ : 0;
    if (bytes > available) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the host-resident tensors need ", bytes, " bytes of host memory but only ", available,
          " are available (", budget->available, " by ", budget->source, ", minus ", promised_,
          " promised to loads in flight); unload a model or place fewer tensors on the host"));
    }
  }
  promised_ += bytes;
  return Reservation(this, bytes);
}

uint64_t HostMemoryAdmission::promised() const {
  absl::MutexLock lock(&mu_);
  return promised_;
}

void HostMemoryAdmission::Release(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  promised_ -= bytes;
}

}  // namespace weightd
