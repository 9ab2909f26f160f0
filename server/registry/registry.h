// The model registry: names -> generations, their states, and leases.
// It composes the tables of what clients hold (LeaseTable, lease_table.h;
// UpdateTable, update_table.h), each with its own lock and contract, with
// the state of names (current, loading, failed and draining generations)
// under its own lock, taken first.
//
// Memory ownership: a generation is held by shared_ptr from the registry
// (while it is the current generation of its name, or DRAINING) and from
// every lease on it; its segments are freed when the last holder lets go.
// A lease is PENDING from Attach() until the client claims it on the fd
// socket (or it expires after claim_timeout), then ACTIVE until released.
//
// Thread-safety: every method may be called from any thread.
#ifndef WEIGHTD_SERVER_REGISTRY_REGISTRY_H_
#define WEIGHTD_SERVER_REGISTRY_REGISTRY_H_

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/io/env.h"
#include "absl/synchronization/mutex.h"
#include "server/load/loader.h"
#include "server/model/segment_pinner.h"
#include "server/model/model.h"
#include "server/layout/layout_publish.h"
#include "server/model/layout.h"
#include "server/registry/layout_writers.h"
#include "server/registry/lease_table.h"
#include "server/registry/update_table.h"
#include "server/update/update.h"
#include "server/model/model_events.h"

namespace weightd {

// Told about state changes (health, metrics). Called with the registry lock
// held: implementations must be quick, thread-safe, and never call back into
// the registry.
class RegistryListener {
 public:
  virtual ~RegistryListener() = default;
  virtual void OnModelServing(const std::string& name, bool serving) {}
  // `model` just became the READY generation of its name (a load, reload,
  // commit, or a restore at start); the name was unloaded.
  virtual void OnGenerationPublished(const std::shared_ptr<ModelGeneration>& model) {}
  virtual void OnModelUnloaded(const std::string& name) {}
  virtual void OnLoadFinished(const ModelGeneration& model, uint64_t bytes, double seconds) {}
  virtual void OnLoadFailed(const LoadRequest& request, const absl::Status& status) {}
  virtual void OnLeasesChanged(const std::string& name, int active) {}
  // A lease was claimed on the fd socket `seconds` after its Attach.
  virtual void OnLeaseClaimed(const std::string& name, double seconds) {}
  virtual void OnMemoryChanged(uint64_t host_bytes, uint64_t locked_bytes) {}
  // The writer path: an update was staged; committed as `model`; or aborted
  // for `reason` (one of kUpdateAbortReasons, server/update/update.h).
  virtual void OnUpdateStarted(const std::string& name, uint64_t bytes_staged) {}
  virtual void OnUpdateCommitted(const ModelGeneration& model, uint64_t bytes_written, uint64_t bytes_shared,
                                 uint32_t tensors_changed, double seconds) {}
  virtual void OnUpdateAborted(const std::string& name, const std::string& reason) {}
  // Runtime layouts: one was published; a publish ended without one for
  // `reason` (kLayoutAbortReasons); an attach asked for a layout: `result`
  // is "hit", "not_found" or "identity_mismatch". (Layouts held are
  // sampled from the generations at each scrape: metrics.h.)
  virtual void OnLayoutPublished(const Layout& layout) {}
  virtual void OnLayoutAborted(const std::string& name, const std::string& reason) {}
  virtual void OnLayoutAttach(const std::string& name, const std::string& result) {}
  // The layouts of `model` (a current generation) changed: one was
  // published on it or dropped from it (the fd store keeps them).
  virtual void OnLayoutsChanged(const std::shared_ptr<ModelGeneration>& model) {}
};

struct RegistryOptions {
  // A load path must resolve under one of these, and so must every file the
  // catalog opens (checked on the open file: see common/format/catalog.h).
  std::vector<std::string> model_roots;
  LoaderOptions loader;
  std::chrono::milliseconds claim_timeout{10000};
  // Reads the host memory budget for admission (server/model/memory_admission.h);
  // null: the running system. Used unless loader.admission is set.
  HostMemoryAdmission::Probe host_memory_probe;
  Env* env = nullptr;  // file access for paths and catalogs; null: Env::Default()
  // The time for lease deadlines and claim latency; null: steady_clock::now.
  // Tests inject a fake clock (tests/testing/fake_clock.h).
  std::function<std::chrono::steady_clock::time_point()> clock;
  // Bounds of the watch streams (Watch, --max-watchers).
  ModelEventHubOptions watch;
  // Asked first for a name with no READY generation of the same plan
  // (peer seeding: server/peer/peer_join.h seeds loads that name peers, in
  // LoadRequest::peers or the config); when it fails, storage is read.
  // null: storage only. Not owned.
  GenerationSource* seed_source = nullptr;
  // Queue the pinning of published generations (LoaderOptions::mlock) but
  // start none until ReleasePinning(): the daemon holds it while it starts,
  // so that re-pinning restored models does not slow a restart.
  bool hold_pinning = false;
};

class ModelRegistry {
 public:
  ModelRegistry(RegistryOptions options, RegistryListener* listener);
  // Waits for the releases handed to the release thread (see ReleaseLater).
  ~ModelRegistry();

  struct LoadResult {
    std::shared_ptr<ModelGeneration> model;
    bool reused = false;
  };
  // Validates the request, resolves the path under a model root (symlinks
  // included; PERMISSION_DENIED outside), catalogs, and loads a new
  // generation (from the first peer that serves the same checkpoint and
  // plan when peers are named and the name has no READY generation with
  // the same plan, see server/peer/peer_join.h; else, or when none does, from
  // storage); or reuses the READY one loaded from the same unchanged files
  // with the same plan. ALREADY_EXISTS while another load of the name runs.
  //
  // While it runs, ListAll() shows a LOADING record of the load with its
  // bytes done and total. A load that fails after its plan was accepted
  // (allocating, reading, sealing, or cancelled) leaves a FAILED record
  // holding its error and no memory, until the name is loaded again or
  // unloaded; an earlier failure (path, catalog, plan, devices) refuses the
  // request and leaves nothing. A READY generation of the name keeps
  // serving either way.
  absl::StatusOr<LoadResult> Load(LoadRequest request, const ProgressFn& progress);
  // Load() of the READY generation's request of `name`, from
  // `checkpoint_path` when not empty: the plan is kept, so every file whose
  // stamp is unchanged is shared, not read (see LoadGeneration). NOT_FOUND
  // or FAILED_PRECONDITION when the name has no READY generation.
  absl::StatusOr<LoadResult> Reload(const std::string& name, const std::string& checkpoint_path,
                                    const ProgressFn& progress);
  // Reports a load that the API layer refused before calling Load() (a
  // request over its bounds) to the listener's OnLoadFailed, so that it is
  // logged and counted like every other failed load. Load() and Reload()
  // report each of their own refusals (name, path, a load of the name
  // already running, no READY generation to reload) the same way.
  // Thread-safe.
  void RefuseLoad(const LoadRequest& request, const absl::Status& status);

  // Serves `model`, restored from the fd store at start (server/restart/fd_store.h),
  // as the READY generation of its name with its own generation number;
  // later generations are numbered above it. ALREADY_EXISTS when the name
  // has one.
  absl::Status Adopt(std::shared_ptr<ModelGeneration> model);

  struct UnloadResult {
    std::shared_ptr<ModelGeneration> model;
    bool freed = false;
  };
  // Stops new leases; frees at once when unleased, else DRAINING until the
  // last lease ends. Also drops the name's FAILED record: a name with only
  // that record reports it, freed. `force` revokes every lease of the name first. A name
  // with only DRAINING generations: `force` ends their leases; without it the
  // call reports the draining generation unchanged.
  //
  // Except claimed leases on arenas exported by handle rather than fd
  // (cuda-legacy-ipc): that memory is not reference-counted across
  // processes, and a cuMemFree before an importer's cuIpcCloseMemHandle is
  // undefined behaviour (CUDA Driver API, cuIpcOpenMemHandle): the importer
  // may read memory another allocation reuses. `force` leaves those leases to end
  // when their clients close the fd-socket connection (weightd's clients
  // unmap first) or exit, and says so in the log. fd-exported memory (memfd,
  // cuda VMM) is kept by the kernel and the driver until the last mapping
  // goes, so its leases end at once.
  absl::StatusOr<UnloadResult> Unload(const std::string& name, bool force);

  // The generations that hold memory: current ones by name, then draining.
  std::vector<std::shared_ptr<ModelGeneration>> List() const;
  // What ListModels shows: List()'s current generations, then a LOADING
  // record per load in flight and a FAILED record per failed load (by name),
  // then the draining generations. Records hold no segments and have
  // generation 0 (see Load).
  std::vector<std::shared_ptr<ModelGeneration>> ListAll() const;
  // The READY generation of `name`: NOT_FOUND, or FAILED_PRECONDITION when
  // loading or when its last load failed (naming the error). Get, GetRank,
  // Attach and Unload check the name with ValidateModelName first, so no
  // message echoes an over-long name.
  absl::StatusOr<std::shared_ptr<ModelGeneration>> Get(const std::string& name) const;
  // Get(), and INVALID_ARGUMENT when the model has no rank `rank`.
  absl::StatusOr<std::shared_ptr<ModelGeneration>> GetRank(const std::string& name, uint32_t rank) const;

  struct Grant {
    std::string lease_id;  // 32 hex digits
    std::shared_ptr<ModelGeneration> model;
    uint32_t rank = 0;
    int numa_copy = -1;  // index into model->numa_copies (ModelGeneration::SegmentsOf); -1: none
    // The node of that copy; -1 when the model has no NUMA copies.
    int numa_node() const { return numa_copy < 0 ? -1 : model->numa_copies[numa_copy].node; }
    // Set for a lease on a runtime layout: the client maps its segments.
    std::shared_ptr<const Layout> layout;
  };
  // Which NUMA copy a client wants (ChooseNumaCopy, server/model/model.h):
  // a named node, or its CPU affinity. Ignored for models without copies.
  struct AttachPlacement {
    std::optional<int> numa_node;
    std::vector<int> cpus;
  };
  // A runtime layout instead of the checkpoint tensors: `key` of the
  // current generation and `rank`, its identity checked when `identity` is
  // not empty (IdentityDifference). NOT_FOUND naming the keys published for
  // that generation and rank; FAILED_PRECONDITION naming every field that
  // differs.
  struct AttachLayout {
    std::string key;  // empty: the checkpoint tensors
    LayoutIdentity identity;
  };
  absl::StatusOr<Grant> Attach(const std::string& name, uint32_t rank, const AttachPlacement& placement = {},
                               const AttachLayout& layout = {});
  // PENDING -> ACTIVE. NOT_FOUND for an unknown or expired id,
  // FAILED_PRECONDITION for one already claimed.
  absl::StatusOr<Grant> Claim(const std::string& lease_id);
  // Ends a lease in any state; unknown ids are ignored.
  void Release(const std::string& lease_id);
  // Release() for clients: NOT_FOUND for an unknown id.
  absl::Status Detach(const std::string& lease_id);
  bool IsLeaseLive(const std::string& lease_id) const;
  // Drops PENDING leases older than claim_timeout; returns how many.
  int ExpirePending();

  // The writer path (server/update/update.h, docs/api.md). BeginUpdate stages an
  // update of `tensors` (empty: all) of the READY generation of `name`: one
  // open update per name (ALREADY_EXISTS for a second writer), claimed on
  // the fd socket within claim_timeout (else aborted, "claim_timeout").
  struct UpdateGrant {
    std::string update_id;  // kUpdateIdPrefix + 32 hex digits
    std::shared_ptr<const StagedUpdate> update;
  };
  absl::StatusOr<UpdateGrant> BeginUpdate(const std::string& name, const std::vector<std::string>& tensors);
  // The fd socket's claim of an update: the writer's connection is its
  // lease. NOT_FOUND for an unknown id, FAILED_PRECONDITION when claimed.
  // The result keeps the staged memfds open while their fds are sent.
  absl::StatusOr<std::shared_ptr<const StagedUpdate>> ClaimUpdate(const std::string& update_id);
  bool IsUpdateOpen(const std::string& update_id) const;
  struct CommitResult {
    std::shared_ptr<ModelGeneration> model;
    uint32_t tensors_changed = 0;
    uint64_t bytes_written = 0;
    uint64_t bytes_shared = 0;
    double seconds = 0;
  };
  // Seals, verifies and publishes (see SealAndVerify): Attach returns the
  // new generation from the moment this returns, the old one until then;
  // the old one drains as after a reload. Whether a failed commit leaves the
  // update open for a retry or aborts it is DecideCommit's (update.h).
  absl::StatusOr<CommitResult> CommitUpdate(const std::string& update_id, const CommitOptions& options);
  // Frees what the update staged; the served generation is untouched.
  // NOT_FOUND for an unknown id, FAILED_PRECONDITION while it commits.
  absl::Status AbortUpdate(const std::string& update_id, const std::string& reason);
  // Runtime layouts (server/layout/layout_publish.h, docs/api.md "Runtime
  // layouts"). BeginLayout checks `request` (ValidateLayoutRequest), then
  // opens the one writer of (model, current generation, key, rank) and
  // stages its memfds; the writer claims `writer_id` on the fd socket within
  // claim_timeout (else the publish ends, "claim_timeout"). ALREADY_EXISTS
  // when the slot has a writer or a published layout; with
  // request.wait_seconds, waits for a busy slot's writer to end instead and
  // answers `published` (its layout) or opens the slot when it aborted;
  // DEADLINE_EXCEEDED when it does neither in time. FAILED_PRECONDITION for
  // a generation other than the current one, or device tensors without a
  // GPU; RESOURCE_EXHAUSTED when the host or the GPU has no room.
  struct LayoutGrant {
    std::string writer_id;  // kLayoutWriterIdPrefix + 32 hex digits; empty when `published`
    std::shared_ptr<const StagedLayout> staged;
    std::shared_ptr<const Layout> published;  // the wait ended with another writer's commit
    uint64_t generation = 0;
  };
  absl::StatusOr<LayoutGrant> BeginLayout(LayoutRequest request);
  // The fd socket's claim of a layout writer: the writer's connection is its
  // lease. NOT_FOUND for an unknown id, FAILED_PRECONDITION when claimed.
  absl::StatusOr<std::shared_ptr<const StagedLayout>> ClaimLayoutWriter(const std::string& writer_id);
  bool IsLayoutWriterOpen(const std::string& writer_id) const;
  // Seals, hashes and publishes the layout (SealLayout) on its generation,
  // if that is still the current one. A commit refused before sealing
  // (INVALID_ARGUMENT, or FAILED_PRECONDITION such as a mapping still
  // writable) leaves the writer open for another try; any other failure
  // ends it (kLayoutAbortReasons).
  absl::StatusOr<std::shared_ptr<const Layout>> CommitLayout(const std::string& writer_id,
                                                             const std::map<std::string, std::string>& expected_hashes);
  // Ends an open writer and frees what it staged. NOT_FOUND for an unknown
  // id, FAILED_PRECONDITION while it commits.
  absl::Status AbortLayout(const std::string& writer_id, const std::string& reason);
  // Removes the layouts of `key` (of `rank` only, when given) from the
  // current generation of `name`: no new attaches; leases keep their
  // memory. Returns how many; NOT_FOUND naming the keys there are when none.
  absl::StatusOr<int> DropLayout(const std::string& name, const std::string& key, std::optional<uint32_t> rank);

  // Subscribes to the events of `name`, loaded or not (docs/api.md
  // "WatchModel"): CURRENT first when the name has a READY generation, then
  // every later PUBLISHED, DRAINING, FREED and UNLOADED of the name, in the
  // order they happened; none is missed or repeated, because the
  // subscription and CURRENT are taken under the lock every event is
  // published under. `ready` as in ModelEventHub::Subscribe; end the watch
  // with events().Unsubscribe. INVALID_ARGUMENT for a bad name,
  // RESOURCE_EXHAUSTED beyond options.watch.max_watchers, UNAVAILABLE after
  // StopWatches().
  absl::StatusOr<std::shared_ptr<ModelEventHub::Watcher>> Watch(const std::string& name, std::function<void()> ready);
  ModelEventHub& events() { return *events_; }
  // Ends every watch with UNAVAILABLE and refuses new ones; for shutdown,
  // before the gRPC servers wait for their calls.
  void StopWatches() { events_->Stop(); }

  std::chrono::milliseconds claim_timeout() const { return options_.claim_timeout; }
  // Makes loads in progress (and later ones) fail with UNAVAILABLE at their
  // next block; for shutdown.
  void CancelLoads() { cancel_loads_ = true; }
  // Stops the pinning thread (shutdown): its completions call the listener,
  // which may not outlive the daemon's shutdown.
  void StopPinning() { pinner_->Stop(); }
  // Starts the pinning held by RegistryOptions::hold_pinning. Idempotent.
  void ReleasePinning() { pinner_->Release(); }
  // Shutdown, after StopPinning() and while the listeners still answer:
  // HostSegment::DropPageTables() on the host segments of every generation
  // the registry holds (current, draining), so that the daemon's exit or an
  // upgrade's exec does not spend the down time tearing down page tables.
  // Attaches keep working (they pass fds); a read by the daemon faults pages
  // back in. Returns the bytes dropped.
  uint64_t DropHostPageTables() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::StatusOr<std::string> ResolvePath(const std::string& path) const;
  // The checks of a load before anything is recorded: the name, the TP
  // size's default, and the path resolved under a model root (in place).
  absl::Status AdmitLoad(LoadRequest& request) const;
  Env& env() const { return options_.env != nullptr ? *options_.env : *Env::Default(); }
  std::chrono::steady_clock::time_point Now() const {
    return options_.clock ? options_.clock() : std::chrono::steady_clock::now();
  }
  // Makes a loaded generation the current one of its name.
  LoadResult Publish(std::unique_ptr<ModelGeneration> loaded, const Catalog& catalog) ABSL_LOCKS_EXCLUDED(mu_);
  // Numbers `model`, makes it READY and the current generation of its name
  // (the one before drains), and tells the listener it serves.
  void InstallLocked(const std::shared_ptr<ModelGeneration>& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // An update taken out of updates_: tells the listener it ended for
  // `reason` (none for a commit) and frees its pages; returns what it
  // staged, to be dropped after the lock is released.
  std::shared_ptr<StagedUpdate> FinishUpdateLocked(UpdateTable::Ended ended, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A layout writer taken out of layout_writers_: as FinishUpdateLocked.
  std::shared_ptr<StagedLayout> FinishLayoutWriterLocked(LayoutWriters::Ended ended, const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The GPU for the device tensors of a layout of `rank` of `model`:
  // `gpu_uuid`, else the rank's GPU in the model's plan.
  absl::StatusOr<DeviceInfo> LayoutDeviceLocked(const ModelGeneration& model, uint32_t rank,
                                                const std::string& gpu_uuid) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when `bytes` more on `device` would exceed its
  // total, counting the arenas of every generation and layout held.
  absl::Status AdmitDeviceBytesLocked(const DeviceInfo& device, uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The layout an attach asks for, counted by the listener (OnLayoutAttach).
  absl::StatusOr<std::shared_ptr<const Layout>> FindLayoutLocked(const ModelGeneration& model, uint32_t rank,
                                                                 const AttachLayout& layout) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the watchers about each layout of `model` with `kind`.
  void AnnounceLayouts(ModelEvent::Kind kind, const ModelGeneration& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The end of every Load: drops its LOADING `record`; for a `failure`
  // after the plan was `accepted`, keeps a FAILED record instead.
  void EndLoad(const LoadRequest& request, const ModelGeneration& record, const absl::Status& failure, bool accepted)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::shared_ptr<ModelGeneration>> GetLocked(const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::shared_ptr<ModelGeneration>> GetRankLocked(const std::string& name, uint32_t rank) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // See Unload for the leases it keeps.
  void DropLeasesOf(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<UnloadResult> UnloadDraining(const std::string& name, bool force,
                                              std::shared_ptr<ModelGeneration> failed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<ModelGeneration> Reusable(const LoadRequest& request, const Catalog& catalog) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Retire(std::shared_ptr<ModelGeneration> model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the watchers of `model`'s name: published under mu_, so events of
  // a name keep the order of the registry's changes.
  void Announce(ModelEvent::Kind kind, const ModelGeneration& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Announces `model`, just made current, as PUBLISHED and arms its FREED
  // event (ModelGeneration::on_freed). Every path that publishes a
  // generation calls it.
  void AnnouncePublished(ModelGeneration& model) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A lease taken out of leases_: the listener's count, and a DRAINING
  // generation's last lease lets it go.
  void LeaseRemovedLocked(LeaseTable::Removed& removed) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void NotifyMemory() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The pinner finished `model`: logs what it locked and updates the gauges.
  void ReportPinned(const ModelGeneration& model, const PinResult& pinned) ABSL_LOCKS_EXCLUDED(mu_);
  // Drops `held` on the release thread: freeing a generation of many GiB
  // (munmap, close) takes a good part of a second, which a commit or reload
  // reply should not wait for. Memory gauges may lag by that long.
  void ReleaseLater(std::shared_ptr<const void> held) ABSL_LOCKS_EXCLUDED(release_mu_);
  void ReleaseLoop() ABSL_LOCKS_EXCLUDED(release_mu_);

  std::atomic<bool> cancel_loads_{false};
  HostMemoryAdmission admission_;
  RegistryOptions options_;  // options_.loader.cancel points at cancel_loads_, .admission at admission_ by default
  RegistryListener* listener_;
  // Shared with the FREED hooks of generations, which may outlive the registry.
  std::shared_ptr<ModelEventHub> events_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<ModelGeneration>> current_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<ModelGeneration>> draining_ ABSL_GUARDED_BY(mu_);
  // Records of loads in flight (LOADING) and of the last failed load of a name (FAILED).
  std::map<std::string, std::shared_ptr<ModelGeneration>> loading_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<ModelGeneration>> failed_ ABSL_GUARDED_BY(mu_);
  // Each with its own lock, taken after mu_. A change that spans a table
  // and the maps above (an attach, an unload, a commit) holds mu_ too.
  LeaseTable leases_;
  UpdateTable updates_;
  LayoutWriters layout_writers_;
  absl::Mutex release_mu_;
  std::vector<std::shared_ptr<const void>> to_release_ ABSL_GUARDED_BY(release_mu_);
  bool stop_release_ ABSL_GUARDED_BY(release_mu_) = false;
  std::thread release_thread_;  // started in the constructor, joined in the destructor
  // Pins the host segments of loaded generations after they are published
  // (LoaderOptions::mlock); stopped first in the destructor.
  std::unique_ptr<SegmentPinner> pinner_;
  uint64_t next_generation_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_REGISTRY_REGISTRY_H_
