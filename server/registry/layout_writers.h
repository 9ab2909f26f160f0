// The open layout writers of a registry (server/layout/layout_publish.h): at
// most one per slot (model, generation, layout key, rank). A writer is
// opened empty (Open) while its memfds are staged, then holds its
// StagedLayout (SetStaged) until it ends: claimed once on the fd socket
// (Claim: the writer's connection is its lease), committed (BeginCommit,
// then End, or Reopen when the writer may retry), or ended for a reason
// (Abort, EndOf, Expire). Ending returns what it staged, for the caller to
// free outside its locks. A writer being committed is never ended under the
// commit: Abort and EndOf record their reason on it instead
// (AbortRequested), and the commit ends it unless it publishes.
//
// A second writer of a busy slot may wait (AwaitFree) until the first ends,
// then looks again: a published layout, or a free slot to open.
//
// Writer ids are kLayoutWriterIdPrefix + 32 hex digits (NewRandomId),
// distinct from lease and update ids, so a CLAIM is one lookup in one table.
//
// Thread-safety: as LeaseTable: any thread, its own lock, taken after
// ModelRegistry's, nothing called outside the table while it is held.
// AwaitFree blocks: never call it with the registry's lock held.
#ifndef WEIGHTD_SERVER_REGISTRY_LAYOUT_WRITERS_H_
#define WEIGHTD_SERVER_REGISTRY_LAYOUT_WRITERS_H_

#include <chrono>
#include <compare>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/layout/layout_publish.h"

namespace weightd {

inline constexpr absl::string_view kLayoutWriterIdPrefix = "layout-";
// Open layout writers at once (every model and slot), and writers waiting
// for a busy slot at once: each waiter holds one of the gRPC server's
// handler threads (--grpc-max-threads, 64 by default), so waiters must
// leave most of them to the commits they wait for.
inline constexpr size_t kMaxOpenLayoutWriters = 256;
inline constexpr size_t kMaxLayoutWaiters = 16;

class LayoutWriters {
 public:
  using Clock = std::chrono::steady_clock;

  struct Slot {
    std::string model;
    uint64_t generation = 0;
    std::string key;
    uint32_t rank = 0;
    auto operator<=>(const Slot&) const = default;
  };
  // A writer taken out of the table: its slot and what it staged (null when
  // it ended while staging).
  struct Ended {
    Slot slot;
    std::shared_ptr<StagedLayout> staged;
  };

  // Opens a writer of `slot` with a new id, to be staged and then claimed by
  // `deadline`. ALREADY_EXISTS when the slot has one; RESOURCE_EXHAUSTED
  // when kMaxOpenLayoutWriters are open.
  absl::StatusOr<std::string> Open(const Slot& slot, Clock::time_point deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until `slot` has no writer (OK) or `deadline` passes
  // (DEADLINE_EXCEEDED); UNAVAILABLE at once when kMaxLayoutWaiters wait.
  absl::Status AwaitFree(const Slot& slot, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives open writer `id` what was staged for it. FAILED_PRECONDITION when
  // `id` ended meanwhile: `staged` is left to the caller.
  absl::Status SetStaged(const std::string& id, std::shared_ptr<StagedLayout> staged, Clock::time_point deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The staged layout of `id`, claimed. NOT_FOUND for an unknown, ended or
  // still-staging id, FAILED_PRECONDITION when claimed already.
  absl::StatusOr<std::shared_ptr<const StagedLayout>> Claim(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Marks `id` committing and returns its staged layout. NOT_FOUND as for
  // Claim (and for a writer not claimed yet: it has no fds to write through),
  // FAILED_PRECONDITION while another commit of it runs.
  absl::StatusOr<std::shared_ptr<StagedLayout>> BeginCommit(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // The commit of `id` failed and the writer may commit again.
  void Reopen(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes `id` in any state. NOT_FOUND when unknown.
  absl::StatusOr<Ended> End(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes `id` for `reason`. NOT_FOUND when unknown; while a commit of it
  // runs, FAILED_PRECONDITION, having recorded `reason` (the first stays).
  absl::StatusOr<Ended> Abort(const std::string& id, const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  // Aborts every writer of `model` (of generations other than `keep`, when
  // given) for `reason`; those committing get the reason recorded instead.
  std::vector<Ended> EndOf(const std::string& model, std::optional<uint64_t> keep, const std::string& reason)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The reason an Abort or EndOf recorded on `id` during its commit.
  std::optional<std::string> AbortRequested(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every writer that nobody claimed or is committing by its deadline.
  std::vector<Ended> Expire(Clock::time_point now) ABSL_LOCKS_EXCLUDED(mu_);
  bool IsOpen(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<Slot> SlotOf(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  // Bytes of the staged memfds of every open writer.
  uint64_t StagedBytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    Slot slot;
    std::shared_ptr<StagedLayout> staged;  // null while staging
    bool claimed = false;
    bool committing = false;
    std::string abort_requested;
    Clock::time_point deadline;
  };
  Ended EndLocked(std::map<std::string, Entry>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Ended> AbortLocked(std::map<std::string, Entry>::iterator it, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Entry> by_id_ ABSL_GUARDED_BY(mu_);
  std::map<Slot, std::string> id_of_slot_ ABSL_GUARDED_BY(mu_);  // one writer per slot
  size_t waiters_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_REGISTRY_LAYOUT_WRITERS_H_
