// The leases of a registry: which client holds which rank of which
// generation. A lease is PENDING from Add until its client claims it on the
// fd socket (Claim), or until its claim deadline passes (RemoveExpired);
// then ACTIVE until removed (the client detached or closed its fd-socket
// connection, or a forced unload). Each lease holds its generation by
// shared_ptr and is counted in ModelGeneration::leases, so a generation's
// memory outlives its last lease and not longer.
//
// Lease ids are 32 hex digits from std::random_device (128 bits: not
// guessable by another process on the node), as clients have always seen
// them; update ids (update_table.h) start with kUpdateIdPrefix, which no
// lease id does, so the fd socket tells what a CLAIM names from the id alone.
//
// Thread-safety: every method may be called from any thread; the table's
// lock is its own, taken after ModelRegistry's when both are held, and the
// table calls nothing outside itself while holding it but RemoveOf's `keep`.
// ModelRegistry removes leases only under its own lock too, since a
// DRAINING generation leaves its draining list when its last lease goes.
#ifndef WEIGHTD_SERVER_REGISTRY_LEASE_TABLE_H_
#define WEIGHTD_SERVER_REGISTRY_LEASE_TABLE_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "server/model/layout.h"
#include "server/model/model.h"

namespace weightd {

// `prefix` + 32 lowercase hex digits of std::random_device. Thread-safe.
std::string NewRandomId(absl::string_view prefix);

class LeaseTable {
 public:
  using Clock = std::chrono::steady_clock;

  struct Lease {
    std::string id;
    std::shared_ptr<ModelGeneration> model;
    uint32_t rank = 0;
    bool claimed = false;
    Clock::time_point attached;
    Clock::time_point deadline;  // to be claimed by
    int numa_copy = -1;          // index into model->numa_copies whose host segments it maps; -1: the rank's own
    // A lease on a runtime layout of `model` (server/model/layout.h): the
    // client maps the layout's segments; counted in layout->leases too.
    std::shared_ptr<const Layout> layout;
  };
  // A lease taken out of the table: its generation (whose lease count was
  // decremented) and that count after.
  struct Removed {
    std::shared_ptr<ModelGeneration> model;
    int leases_left = 0;
    // The layout a layout lease held (may be its last reference: the
    // registry frees it off its locks).
    std::shared_ptr<const Layout> layout = nullptr;
  };

  // A new PENDING lease on `rank` of `model`, attached at `now`, to be
  // claimed by `deadline`. Increments model->leases (and layout->leases
  // for a lease on `layout`, a layout of `model`).
  Lease Add(std::shared_ptr<ModelGeneration> model, uint32_t rank, Clock::time_point now,
            Clock::time_point deadline, int numa_copy = -1, std::shared_ptr<const Layout> layout = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // PENDING -> ACTIVE; the lease. NOT_FOUND for an unknown or expired id,
  // FAILED_PRECONDITION for one claimed already (on another connection).
  absl::StatusOr<Lease> Claim(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes lease `id` in any state; an empty Removed (null model) when unknown.
  Removed Remove(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every PENDING lease whose deadline is before `now`.
  std::vector<Removed> RemoveExpired(Clock::time_point now) ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every lease on a generation of `name` except those `keep`
  // returns true for (it sees each lease of the name, under the table's
  // lock: it must not call into the table).
  std::vector<Removed> RemoveOf(const std::string& name, const std::function<bool(const Lease&)>& keep)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool Contains(const std::string& id) const ABSL_LOCKS_EXCLUDED(mu_);
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  Removed RemoveLocked(std::map<std::string, Lease>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);  // by id
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_REGISTRY_LEASE_TABLE_H_
