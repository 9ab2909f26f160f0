// The open writer updates of a registry (server/update/update.h): at most
// one per model name. An update is opened empty (Open) while its segments
// are staged, then holds its StagedUpdate (SetStaged) until it ends: claimed
// once on the fd socket (Claim: the writer's connection is its lease),
// committed (BeginCommit, then End, or Reopen when the writer may retry), or
// ended for a reason (Abort, EndOf, Expire). Ending returns what it staged,
// for the caller to free outside its locks. An update being committed is
// never ended under the commit: Abort and EndOf record their reason on it
// instead (AbortRequested), and the commit ends it unless it publishes.
//
// Update ids are kUpdateIdPrefix + 32 hex digits (NewRandomId), distinct
// from lease ids, so a CLAIM is one lookup in one table.
//
// Thread-safety: as LeaseTable: any thread, its own lock, taken after
// ModelRegistry's, nothing called outside the table while it is held.
#ifndef WEIGHTD_SERVER_REGISTRY_UPDATE_TABLE_H_
#define WEIGHTD_SERVER_REGISTRY_UPDATE_TABLE_H_

#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/update/update.h"

namespace weightd {

inline constexpr absl::string_view kUpdateIdPrefix = "update-";

class UpdateTable {
 public:
  using Clock = std::chrono::steady_clock;

  // An update taken out of the table: its model's name and what it staged
  // (null when it ended while staging).
  struct Ended {
    std::string name;
    std::shared_ptr<StagedUpdate> staged;
  };

  // Opens the update of `name` with a new id, to be staged and then claimed
  // by `deadline`. ALREADY_EXISTS when `name` has one open.
  absl::StatusOr<std::string> Open(const std::string& name, Clock::time_point deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives the open update `id` what was staged for it, to be claimed by
  // `deadline`. FAILED_PRECONDITION when `id` ended meanwhile (its model was
  // unloaded): `staged` is left to the caller.
  absl::Status SetStaged(const std::string& id, std::shared_ptr<StagedUpdate> staged, Clock::time_point deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The staged update of `id`, claimed. NOT_FOUND for an unknown, ended or
  // still-staging id, FAILED_PRECONDITION when claimed already.
  absl::StatusOr<std::shared_ptr<const StagedUpdate>> Claim(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Marks `id` committing and returns its staged update. NOT_FOUND as for
  // Claim, FAILED_PRECONDITION while another commit of it runs.
  absl::StatusOr<std::shared_ptr<StagedUpdate>> BeginCommit(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // The commit of `id` failed and the writer may commit again.
  void Reopen(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes `id` in any state (its own commit's end, a failed staging).
  // NOT_FOUND when unknown.
  absl::StatusOr<Ended> End(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes `id` for `reason`. NOT_FOUND when unknown; while a commit of it
  // runs, FAILED_PRECONDITION, having recorded `reason` (the first recorded
  // stays) for the commit to end the update with unless it publishes.
  absl::StatusOr<Ended> Abort(const std::string& id, const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  // Abort of the update of `name`, if any: nullopt when there is none, or
  // when a commit of it runs (the reason is then recorded as by Abort).
  std::optional<Ended> EndOf(const std::string& name, const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  // The reason an Abort or EndOf recorded on `id` during its commit.
  std::optional<std::string> AbortRequested(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every staged update that nobody claimed or is committing by
  // its deadline.
  std::vector<Ended> Expire(Clock::time_point now) ABSL_LOCKS_EXCLUDED(mu_);
  // The model name of open update `id`, if open.
  std::optional<std::string> NameOf(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  bool IsOpen(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of the staged memfds of every open update.
  uint64_t StagedBytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::string name;
    std::shared_ptr<StagedUpdate> staged;  // null while staging
    bool claimed = false;
    bool committing = false;
    std::string abort_requested;  // during the commit: by Abort or EndOf
    Clock::time_point deadline;  // to be claimed by
  };
  Ended EndLocked(std::map<std::string, Entry>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends `it`, or, while it commits, records `reason` on it (the first
  // recorded stays) and returns FAILED_PRECONDITION.
  absl::StatusOr<Ended> AbortLocked(std::map<std::string, Entry>::iterator it, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Entry> by_id_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> id_of_name_ ABSL_GUARDED_BY(mu_);  // one writer per name
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_REGISTRY_UPDATE_TABLE_H_
