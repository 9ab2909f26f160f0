#include "server/registry/update_table.h"

#include "absl/strings/str_cat.h"
#include "server/registry/lease_table.h"

namespace weightd {

absl::StatusOr<std::string> UpdateTable::Open(const std::string& name, Clock::time_point deadline) {
  std::string id = NewRandomId(kUpdateIdPrefix);
  absl::MutexLock lock(&mu_);
  if (id_of_name_.count(name)) {
    return absl::AlreadyExistsError(
        absl::StrCat("model '", name, "' already has an open update (one writer per model at a time)"));
  }
  id_of_name_[name] = id;
  by_id_[id] = Entry{name, nullptr, false, false, "", deadline};
  return id;
}

absl::Status UpdateTable::SetStaged(const std::string& id, std::shared_ptr<StagedUpdate> staged,
                                    Clock::time_point deadline) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return absl::FailedPreconditionError("the update ended while it was being staged");
  it->second.staged = std::move(staged);
  it->second.deadline = deadline;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const StagedUpdate>> UpdateTable::Claim(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.staged == nullptr) return absl::NotFoundError("unknown or ended update id");
  if (it->second.claimed) return absl::FailedPreconditionError("update already claimed on another connection");
  it->second.claimed = true;
  return std::shared_ptr<const StagedUpdate>(it->second.staged);
}

absl::StatusOr<std::shared_ptr<StagedUpdate>> UpdateTable::BeginCommit(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.staged == nullptr) return absl::NotFoundError("unknown or ended update id");
  if (it->second.committing) return absl::FailedPreconditionError("this update is already being committed");
  it->second.committing = true;
  return it->second.staged;
}

void UpdateTable::Reopen(const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (auto it = by_id_.find(id); it != by_id_.end()) it->second.committing = false;
}

UpdateTable::Ended UpdateTable::EndLocked(std::map<std::string, Entry>::iterator it) {
  Ended ended{it->second.name, std::move(it->second.staged)};
  id_of_name_.erase(ended.name);
  by_id_.erase(it);
  return ended;
}

absl::StatusOr<UpdateTable::Ended> UpdateTable::End(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return absl::NotFoundError("unknown or ended update id");
  return EndLocked(it);
}

absl::StatusOr<UpdateTable::Ended> UpdateTable::AbortLocked(std::map<std::string, Entry>::iterator it,
                                                             const std::string& reason) {
  if (it->second.committing) {
    if (it->second.abort_requested.empty()) it->second.abort_requested = reason;
    return absl::FailedPreconditionError("this update is being committed");
  }
  return EndLocked(it);
}

absl::StatusOr<UpdateTable::Ended> UpdateTable::Abort(const std::string& id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return absl::NotFoundError("unknown or ended update id");
  return AbortLocked(it, reason);
}

std::optional<UpdateTable::Ended> UpdateTable::EndOf(const std::string& name, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  auto id = id_of_name_.find(name);
  if (id == id_of_name_.end()) return std::nullopt;
  absl::StatusOr<Ended> ended = AbortLocked(by_id_.find(id->second), reason);
  if (!ended.ok()) return std::nullopt;
  return std::move(*ended);
}

std::optional<std::string> UpdateTable::AbortRequested(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.abort_requested.empty()) return std::nullopt;
  return it->second.abort_requested;
}

std::vector<UpdateTable::Ended> UpdateTable::Expire(Clock::time_point now) {
  absl::MutexLock lock(&mu_);
  std::vector<Ended> ended;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    auto next = std::next(it);
    const Entry& u = it->second;
    if (u.staged != nullptr && !u.claimed && !u.committing && u.deadline < now) ended.push_back(EndLocked(it));
    it = next;
  }
  return ended;
}

std::optional<std::string> UpdateTable::NameOf(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return std::nullopt;
  return it->second.name;
}

bool UpdateTable::IsOpen(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return by_id_.count(id) != 0;
}

uint64_t UpdateTable::StagedBytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (const auto& [id, u] : by_id_) {
    if (u.staged == nullptr) continue;
    for (const StagedSegment& s : u.staged->segments) bytes += s.memory->size();
  }
  return bytes;
}

}  // namespace weightd
