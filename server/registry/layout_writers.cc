#include "server/registry/layout_writers.h"

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "server/registry/lease_table.h"

namespace weightd {
namespace {

constexpr const char* kUnknown = "unknown or ended layout writer id";

}  // namespace

absl::StatusOr<std::string> LayoutWriters::Open(const Slot& slot, Clock::time_point deadline) {
  std::string id = NewRandomId(kLayoutWriterIdPrefix);
  absl::MutexLock lock(&mu_);
  if (id_of_slot_.count(slot)) {
    return absl::AlreadyExistsError(absl::StrCat("layout ", QuoteName(slot.key), " of rank ", slot.rank, " of model ",
                                                 QuoteName(slot.model), " generation ", slot.generation,
                                                 " is being published by another writer"));
  }
  if (by_id_.size() >= kMaxOpenLayoutWriters) {
    return absl::ResourceExhaustedError(absl::StrCat(kMaxOpenLayoutWriters, " layout writers are open at once, as "
                                                     "many as weightd allows; commit or abort some first"));
  }
  id_of_slot_[slot] = id;
  by_id_[id] = Entry{slot, nullptr, false, false, "", deadline};
  return id;
}

absl::Status LayoutWriters::AwaitFree(const Slot& slot, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (waiters_ >= kMaxLayoutWaiters) {
    return absl::UnavailableError(absl::StrCat(kMaxLayoutWaiters, " publishes already wait for busy layouts; retry "
                                               "later, or attach the layout once it is published"));
  }
  ++waiters_;
  auto free = [this, &slot]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return id_of_slot_.count(slot) == 0; };
  bool freed = mu_.AwaitWithDeadline(absl::Condition(&free), deadline);
  --waiters_;
  if (freed) return absl::OkStatus();
  return absl::DeadlineExceededError(absl::StrCat("layout ", QuoteName(slot.key), " of rank ", slot.rank, " of model ",
                                                  QuoteName(slot.model), " is still being published by another writer"));
}

absl::Status LayoutWriters::SetStaged(const std::string& id, std::shared_ptr<StagedLayout> staged,
                                      Clock::time_point deadline) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return absl::FailedPreconditionError("the layout writer ended while it was being staged");
  it->second.staged = std::move(staged);
  it->second.deadline = deadline;
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const StagedLayout>> LayoutWriters::Claim(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.staged == nullptr) return absl::NotFoundError(kUnknown);
  if (it->second.claimed) return absl::FailedPreconditionError("layout writer already claimed on another connection");
  it->second.claimed = true;
  return std::shared_ptr<const StagedLayout>(it->second.staged);
}

absl::StatusOr<std::shared_ptr<StagedLayout>> LayoutWriters::BeginCommit(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.staged == nullptr) return absl::NotFoundError(kUnknown);
  if (!it->second.claimed) {
    return absl::FailedPreconditionError("the layout writer was not claimed on the fd socket: nothing was written");
  }
  if (it->second.committing) return absl::FailedPreconditionError("this layout is already being committed");
  it->second.committing = true;
  return it->second.staged;
}

void LayoutWriters::Reopen(const std::string& id) {
  absl::MutexLock lock(&mu_);
  if (auto it = by_id_.find(id); it != by_id_.end()) it->second.committing = false;
}

LayoutWriters::Ended LayoutWriters::EndLocked(std::map<std::string, Entry>::iterator it) {
  Ended ended{it->second.slot, std::move(it->second.staged)};
  id_of_slot_.erase(ended.slot);
  by_id_.erase(it);
  return ended;
}

absl::StatusOr<LayoutWriters::Ended> LayoutWriters::End(const std::string& id) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return absl::NotFoundError(kUnknown);
  return EndLocked(it);
}

absl::StatusOr<LayoutWriters::Ended> LayoutWriters::AbortLocked(std::map<std::string, Entry>::iterator it,
                                                                 const std::string& reason) {
  if (it->second.committing) {
    if (it->second.abort_requested.empty()) it->second.abort_requested = reason;
    return absl::FailedPreconditionError("this layout is being committed");
  }
  return EndLocked(it);
}

absl::StatusOr<LayoutWriters::Ended> LayoutWriters::Abort(const std::string& id, const std::string& reason) {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return absl::NotFoundError(kUnknown);
  return AbortLocked(it, reason);
}

std::vector<LayoutWriters::Ended> LayoutWriters::EndOf(const std::string& model, std::optional<uint64_t> keep,
                                                       const std::string& reason) {
  absl::MutexLock lock(&mu_);
  std::vector<Ended> ended;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    auto next = std::next(it);
    const Slot& slot = it->second.slot;
    if (slot.model == model && (!keep.has_value() || slot.generation != *keep)) {
      absl::StatusOr<Ended> e = AbortLocked(it, reason);
      if (e.ok()) ended.push_back(std::move(*e));
    }
    it = next;
  }
  return ended;
}

std::optional<std::string> LayoutWriters::AbortRequested(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end() || it->second.abort_requested.empty()) return std::nullopt;
  return it->second.abort_requested;
}

std::vector<LayoutWriters::Ended> LayoutWriters::Expire(Clock::time_point now) {
  absl::MutexLock lock(&mu_);
  std::vector<Ended> ended;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    auto next = std::next(it);
    const Entry& w = it->second;
    if (w.staged != nullptr && !w.claimed && !w.committing && w.deadline < now) ended.push_back(EndLocked(it));
    it = next;
  }
  return ended;
}

bool LayoutWriters::IsOpen(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  return by_id_.count(id) != 0;
}

std::optional<LayoutWriters::Slot> LayoutWriters::SlotOf(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  if (it == by_id_.end()) return std::nullopt;
  return it->second.slot;
}

uint64_t LayoutWriters::StagedBytes() const {
  absl::MutexLock lock(&mu_);
  uint64_t bytes = 0;
  for (const auto& [id, w] : by_id_) {
    if (w.staged != nullptr) bytes += w.staged->bytes_staged;
  }
  return bytes;
}

}  // namespace weightd
