#include "server/registry/lease_table.h"

#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace weightd {

std::string NewRandomId(absl::string_view prefix) {
  static absl::Mutex mu(absl::kConstInit);
  static std::random_device device ABSL_GUARDED_BY(mu);
  absl::MutexLock lock(&mu);
  return absl::StrCat(prefix, absl::StrFormat("%08x%08x%08x%08x", device(), device(), device(), device()));
}

LeaseTable::Lease LeaseTable::Add(std::shared_ptr<ModelGeneration> model, uint32_t rank, Clock::time_point now,
                                  Clock::time_point deadline, int numa_copy, std::shared_ptr<const Layout> layout) {
  Lease lease{NewRandomId(""), std::move(model), rank, false, now, deadline, numa_copy, std::move(layout)};
  ++lease.model->leases;
  if (lease.layout != nullptr) ++lease.layout->leases;
  absl::MutexLock lock(&mu_);
  leases_[lease.id] = lease;
  return lease;
}

absl::StatusOr<LeaseTable::Lease> LeaseTable::Claim(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return absl::NotFoundError("unknown or expired lease id");
  if (it->second.claimed) return absl::FailedPreconditionError("lease already claimed on another connection");
  it->second.claimed = true;
  return it->second;
}

LeaseTable::Removed LeaseTable::RemoveLocked(std::map<std::string, Lease>::iterator it) {
  Removed removed{std::move(it->second.model), 0, std::move(it->second.layout)};
  if (removed.layout != nullptr) --removed.layout->leases;
  leases_.erase(it);
  removed.leases_left = --removed.model->leases;
  return removed;
}

LeaseTable::Removed LeaseTable::Remove(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return {};
  return RemoveLocked(it);
}

std::vector<LeaseTable::Removed> LeaseTable::RemoveExpired(Clock::time_point now) {
  absl::MutexLock lock(&mu_);
  std::vector<Removed> removed;
  for (auto it = leases_.begin(); it != leases_.end();) {
    auto next = std::next(it);
    if (!it->second.claimed && it->second.deadline < now) removed.push_back(RemoveLocked(it));
    it = next;
  }
  return removed;
}

std::vector<LeaseTable::Removed> LeaseTable::RemoveOf(const std::string& name,
                                                      const std::function<bool(const Lease&)>& keep) {
  absl::MutexLock lock(&mu_);
  std::vector<Removed> removed;
  for (auto it = leases_.begin(); it != leases_.end();) {
    auto next = std::next(it);
    if (it->second.model->request.name == name && !keep(it->second)) removed.push_back(RemoveLocked(it));
    it = next;
  }
  return removed;
}

bool LeaseTable::Contains(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return leases_.count(id) != 0;
}

size_t LeaseTable::size() const {
  absl::MutexLock lock(&mu_);
  return leases_.size();
}

}  // namespace weightd
