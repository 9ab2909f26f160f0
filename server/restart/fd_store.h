// The fd store: what keeps a daemon's models alive across its own restart.
//
// A sealed memfd (and a CUDA VMM allocation) lives as long as any process
// holds a file descriptor of it. systemd keeps such descriptors for a service
// in its file descriptor store (sd_pid_notify_with_fds(3) with "FDSTORE=1",
// FileDescriptorStoreMax= in the unit) and hands them to the next start of
// the service as LISTEN_FDS/LISTEN_FDNAMES (sd_listen_fds_with_names(3)).
// An in-place upgrade (SIGHUP or `weightctl upgrade`) passes the same fds
// the same way to the re-executed binary itself.
//
// What is stored, per model name: its current READY generation's state
// record (server/restart/state_record.h) in a sealed memfd named "wd-rec-<gen>"
// ("wd-rec-<gen>.<n>" when it is written again because a runtime layout of
// the generation was published or dropped: the record holds its layouts),
// and each of its segments and its layouts' segments once, named
// "wd-seg-<n>" (host memfds and fd-exported arenas). Segments go in before the record that names them and leave after
// it, so a daemon killed at any point finds every record it gets complete or
// drops it. Draining generations are not stored: their leases die with the
// process.
//
// Thread-safety: FdStoreKeeper may be called from any thread (its registry
// callbacks run under the registry lock and only queue work); one worker
// thread talks to the store, in the order of the calls.
#ifndef WEIGHTD_SERVER_RESTART_FD_STORE_H_
#define WEIGHTD_SERVER_RESTART_FD_STORE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/base/scoped_fd.h"
#include "server/restart/record_key.h"
#include "server/registry/registry.h"
#include "server/restart/state_record.h"

namespace weightd {

// A store of named fds: the service manager's, or a stand-in in tests.
class FdStoreSink {
 public:
  virtual ~FdStoreSink() = default;
  // Hands the store its own copy of `fd` under `name` (1..255 printable
  // ASCII characters, no ':'; sd_pid_notify_with_fds(3)). Errors keep errno.
  virtual absl::Status Store(const std::string& name, int fd) = 0;
  // Makes the store close every fd it keeps under `name` ("FDSTOREREMOVE=1").
  virtual absl::Status Remove(const std::string& name) = 0;
};

// systemd's fd store through NOTIFY_SOCKET, or null when NOTIFY_SOCKET is
// not set (no service manager: the keeper then only serves upgrades).
std::unique_ptr<FdStoreSink> MakeSystemdFdStore();

// One named fd of the store, as a start receives it or an upgrade hands it on.
struct NamedFd {
  std::string name;
  ScopedFd fd;
};

// The fds passed to this process at start, made close-on-exec: an in-place
// upgrade's (WEIGHTD_HANDOFF_FD, server/restart/upgrade.h), else the service
// manager's (sd_listen_fds_with_names(3): LISTEN_PID must be this process;
// LISTEN_* are then unset). Empty when none were passed.
//
// Both name fd *numbers*, so main() calls this first, before the process
// opens anything: taken later, a number such as LISTEN_FDS=2's fd 4 could be
// one of the daemon's own (a socket lock), which restore would then adopt
// and close. Each fd is checked to be what its name claims, and refused
// (closed unless it is not open, one log line each) otherwise: a state
// record ("wd-rec-*") must be a memfd sealed against writes, shrinking and
// growing; a segment ("wd-seg-*": a host memfd or an exported device arena)
// must be open and neither a socket, a directory nor a FIFO. Restore checks
// each record and segment in full later (server/restart/restore.h).
std::vector<NamedFd> TakeListenFds();

// Whether `fd` is a memfd carrying F_SEAL_WRITE, F_SEAL_SHRINK and
// F_SEAL_GROW (fcntl(2) F_GET_SEALS): bytes no process can change, as a
// state record and the upgrade's fd list are written (SealedMemfd).
bool SealedAgainstWrites(int fd);

// Why `fd`, passed as `name`, is not what its name claims (see
// TakeListenFds); "" when it is.
std::string InheritedFdProblem(int fd, const std::string& name);

// Keeps the store in step with the registry (a RegistryListener). The sink
// may be null: the keeper still knows what an upgrade must hand on.
class FdStoreKeeper final : public RegistryListener {
 public:
  // `key` (may be null: records carry no HMAC) must outlive this.
  explicit FdStoreKeeper(std::unique_ptr<FdStoreSink> sink, const RecordKey* key = nullptr);
  ~FdStoreKeeper() override;  // finishes the queued work
  FdStoreKeeper(const FdStoreKeeper&) = delete;
  FdStoreKeeper& operator=(const FdStoreKeeper&) = delete;

  // A generation restored from the store at start: already stored under
  // `record_name` (its record memfd `record_fd`) and the segment names
  // given, parallel to model->host_segments and ->arenas. Call before
  // the registry publishes it.
  // `layouts`: the restored runtime layouts (already in model->layouts),
  // each with the names of its host segments then arenas.
  void Adopted(const std::shared_ptr<ModelGeneration>& model, const std::string& record_name, ScopedFd record_fd,
               const std::vector<std::string>& host_segment_names, const std::vector<std::string>& arena_names,
               const std::vector<std::pair<std::shared_ptr<const Layout>, std::vector<std::string>>>& layouts = {});
  // Tells the store to drop `name` (a record or segment that start-up did
  // not adopt). Synchronous.
  void Drop(const std::string& name);

  // RegistryListener: a generation became current (stored, the name's older
  // record dropped); a name was unloaded (its record dropped).
  void OnGenerationPublished(const std::shared_ptr<ModelGeneration>& model) override;
  void OnModelUnloaded(const std::string& name) override;
  // A runtime layout of `model` was published or dropped: its record is
  // written again with the layouts it has now, under a new name, stored
  // before the old record is dropped (segments first, as always).
  void OnLayoutsChanged(const std::shared_ptr<ModelGeneration>& model) override;

  // Waits for queued work, then copies (dup) of every stored fd with its
  // name: what an in-place upgrade passes to the next binary. Records first.
  std::vector<NamedFd> Handoff() ABSL_LOCKS_EXCLUDED(mu_);
  // Blocks until the queued work is done (tests, Handoff).
  void Flush() ABSL_LOCKS_EXCLUDED(mu_);

  // Stored names, for tests and logs.
  std::vector<std::string> StoredNames() const ABSL_LOCKS_EXCLUDED(state_mu_);
  // Errors of the store since start (a full store, a refused datagram).
  uint64_t errors() const ABSL_LOCKS_EXCLUDED(state_mu_);

 private:
  struct Stored {  // one model name's stored record
    std::string record_name;
    ScopedFd record_fd;  // without a sink: written only when Handoff needs it
    std::weak_ptr<ModelGeneration> model;
    std::vector<std::string> segments;  // names of the fds it needs
    std::vector<StoredSegment> host, arenas;  // what the record says of them
    LayoutsToStore layouts;                   // the runtime layouts it holds
  };
  struct Task {
    std::shared_ptr<ModelGeneration> publish;  // null: unload of `name`
    std::string name;
    bool relayout = false;  // `publish` is stored already: write its record again for its layouts
  };

  void Run() ABSL_LOCKS_EXCLUDED(mu_, state_mu_);
  void Publish(const std::shared_ptr<ModelGeneration>& model, bool relayout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // Stores the segments of `model`'s layouts (Need) and says what the
  // record gives of them.
  absl::StatusOr<LayoutsToStore> StoreLayouts(const ModelGeneration& model, std::vector<std::string>& names)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  void Unload(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // The store name of a segment object, storing its fd first when new;
  // counts one more record needing it. The keeper holds the object while it
  // is stored (the store holds its memory anyway), so its address names it.
  absl::StatusOr<std::string> Need(std::shared_ptr<const void> object, int fd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // One record fewer needs each of `segments`; the store drops those no
  // record needs.
  void Release(const std::vector<std::string>& segments) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // Records a segment restored at start, stored already under `name`.
  void AdoptSegment(std::shared_ptr<const void> object, int fd, const std::string& name, Stored& stored)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  void Note(const absl::Status& status, const std::string& what) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // The state record of `model` in a sealed memfd, with an HMAC under key_.
  absl::StatusOr<ScopedFd> WriteRecord(const ModelGeneration& model, const std::vector<StoredSegment>& host,
                                       const std::vector<StoredSegment>& arenas, const LayoutsToStore& layouts) const;

  const RecordKey* key_;
  std::unique_ptr<FdStoreSink> sink_;
  // The queue, taken under the registry lock: never held while storing.
  mutable absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // What the store holds: changed by the worker (and Adopted/Drop at start).
  mutable absl::Mutex state_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::map<std::string, Stored> models_ ABSL_GUARDED_BY(state_mu_);
  struct Segment {
    std::string name;
    std::shared_ptr<const void> object;  // held while stored
    int fd = -1;                         // the object's own fd
  };
  std::map<const void*, Segment> segment_names_ ABSL_GUARDED_BY(state_mu_);
  std::map<std::string, int> segment_refs_ ABSL_GUARDED_BY(state_mu_);
  uint64_t next_segment_ ABSL_GUARDED_BY(state_mu_) = 1;
  uint64_t errors_ ABSL_GUARDED_BY(state_mu_) = 0;
  uint64_t next_rewrite_ ABSL_GUARDED_BY(state_mu_) = 1;  // suffix of a rewritten record's name
  std::thread worker_;
};

// A sealed memfd holding `bytes` (a state record), named
// "wd-state:<model>" (not "weightd:", the prefix of segments in
// /proc/PID/fd). RESOURCE_EXHAUSTED when memory or fds are short.
absl::StatusOr<ScopedFd> SealedMemfd(const std::string& model, const std::string& bytes);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_RESTART_FD_STORE_H_
