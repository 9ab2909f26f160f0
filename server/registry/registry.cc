#include "server/registry/registry.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/log.h"
#include "common/io/model_roots.h"
#include "common/base/status.h"

namespace weightd {
namespace {

// Some arena is exported by handle, not fd (cuda-legacy-ipc): its memory dies
// with cuMemFree whatever importers still have open.
bool HasHandleExportedArenas(const ModelGeneration& model) {
  return std::any_of(model.arenas.begin(), model.arenas.end(),
                     [](const std::shared_ptr<DeviceArena>& arena) { return arena->export_fd() < 0; });
}
bool HasHandleExportedArenas(const Layout& layout) {
  return std::any_of(layout.arenas.begin(), layout.arenas.end(),
                     [](const std::shared_ptr<DeviceArena>& arena) { return arena->export_fd() < 0; });
}

// "CODE: message", without the status's payloads.
std::string ErrorText(const absl::Status& status) {
  return absl::StrCat(absl::StatusCodeToString(status.code()), ": ", status.message());
}

// The FAILED record of a load that failed with `error` after `loading` (its
// LOADING record) had got this far.
std::shared_ptr<ModelGeneration> FailedRecord(const ModelGeneration& loading, const absl::Status& error) {
  auto failed = std::make_shared<ModelGeneration>();
  failed->request = loading.request;
  failed->bytes_done = loading.bytes_done.load();
  failed->bytes_total = loading.bytes_total.load();
  failed->error = ErrorText(error);
  failed->state = ModelState::kFailed;
  return failed;
}

ModelEvent EventOf(ModelEvent::Kind kind, const ModelGeneration& model) {
  return {kind, model.request.name, model.generation, model.version_label, model.fingerprint, UnixSecondsNow()};
}

// Erases `name` from `records` if it maps to `record`.
void EraseRecord(std::map<std::string, std::shared_ptr<ModelGeneration>>& records, const std::string& name,
                 const ModelGeneration* record) {
  auto it = records.find(name);
  if (it != records.end() && it->second.get() == record) records.erase(it);
}

}  // namespace

ModelRegistry::ModelRegistry(RegistryOptions options, RegistryListener* listener)
    : admission_(options.host_memory_probe),
      options_(std::move(options)),
      listener_(listener),
      events_(std::make_shared<ModelEventHub>(options_.watch)) {
  options_.loader.cancel = &cancel_loads_;
  if (options_.loader.admission == nullptr) options_.loader.admission = &admission_;
  if (options_.loader.env == nullptr) options_.loader.env = options_.env;  // one Env for catalogs, topology and binding
  release_thread_ = std::thread([this] { ReleaseLoop(); });
  pinner_ = std::make_unique<SegmentPinner>(
      [this](ModelGeneration& model, const PinResult& pinned) { ReportPinned(model, pinned); },
      options_.hold_pinning);
}

void ModelRegistry::ReportPinned(const ModelGeneration& model, const PinResult& pinned) {
  if (pinned.locked_bytes == pinned.host_bytes) {
    LogInfo(absl::StrFormat("pinned '%s' generation %d: %d host bytes mlock()ed in %.2f s", model.request.name,
                            model.generation, pinned.locked_bytes, pinned.seconds));
  } else {
    LogWarning(absl::StrFormat(
        "only %d of %d host bytes of '%s' generation %d are mlock()ed (%s): raise RLIMIT_MEMLOCK "
        "(LimitMEMLOCK=infinity) or give CAP_IPC_LOCK",
        pinned.locked_bytes, pinned.host_bytes, model.request.name, model.generation, std::strerror(pinned.lock_errno)));
  }
  absl::MutexLock lock(&mu_);
  NotifyMemory();
}

ModelRegistry::~ModelRegistry() {
  pinner_.reset();
  {
    absl::MutexLock lock(&release_mu_);
    stop_release_ = true;
  }
  release_thread_.join();
}

void ModelRegistry::ReleaseLater(std::shared_ptr<const void> held) {
  absl::MutexLock lock(&release_mu_);
  to_release_.push_back(std::move(held));
}

void ModelRegistry::ReleaseLoop() {
  for (;;) {
    std::vector<std::shared_ptr<const void>> batch;
    {
      absl::MutexLock lock(&release_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(release_mu_) { return stop_release_ || !to_release_.empty(); };
      release_mu_.Await(absl::Condition(&ready));
      batch.swap(to_release_);
      if (batch.empty() && stop_release_) return;
    }
    batch.clear();  // the frees, without any lock held
  }
}

absl::StatusOr<std::string> ModelRegistry::ResolvePath(const std::string& path) const {
  if (path.empty()) return absl::InvalidArgumentError("checkpoint path is empty");
  if (path.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError("checkpoint path contains a NUL byte");  // the C library would cut it there
  }
  if (options_.model_roots.empty()) {
    return absl::PermissionDeniedError("no --model-root is configured, so no checkpoint may be loaded");
  }
  std::vector<std::string> candidates;
  if (path[0] == '/') {
    candidates.push_back(path);
  } else {
    for (const std::string& root : options_.model_roots) candidates.push_back(root + "/" + path);
  }
  std::string resolved;
  absl::Status last = absl::NotFoundError("");
  for (const std::string& candidate : candidates) {
    absl::StatusOr<std::string> real = env().RealPath(candidate);
    if (real.ok()) {
      resolved = *real;
      break;
    }
    if (real.status().code() != absl::StatusCode::kNotFound) last = real.status();  // e.g. ELOOP, EACCES
  }
  if (resolved.empty()) {
    if (last.code() != absl::StatusCode::kNotFound) return last;
    return absl::NotFoundError(absl::StrCat(ElideName(path), ": no such checkpoint file or folder"));
  }
  ModelRoots roots = ModelRoots::Resolve(env(), options_.model_roots);
  if (roots.Contains(resolved)) return resolved;
  return absl::PermissionDeniedError(
      absl::StrCat(ElideName(path), ": resolves to ", resolved, ", outside every --model-root (", roots.Describe(), ")"));
}

std::shared_ptr<ModelGeneration> ModelRegistry::Reusable(const LoadRequest& request, const Catalog& catalog) const {
  auto it = current_.find(request.name);
  if (it == current_.end() || it->second->state != ModelState::kReady) return nullptr;
  const ModelGeneration& model = *it->second;
  if (model.request.checkpoint_path != request.checkpoint_path || !model.request.SamePlan(request) ||
      model.files.size() != catalog.files.size()) {
    return nullptr;
  }
  for (size_t i = 0; i < catalog.files.size(); ++i) {
    if (model.files[i].stamp != StampOf(catalog.files[i])) return nullptr;
  }
  return it->second;
}

void ModelRegistry::RefuseLoad(const LoadRequest& request, const absl::Status& status) {
  if (listener_ == nullptr) return;
  absl::Status refused = status;  // nothing was read yet: a bad argument is the request's
  if (refused.code() == absl::StatusCode::kInvalidArgument) refused.SetPayload(kInvalidLoadRequestPayload, absl::Cord());
  listener_->OnLoadFailed(request, refused);
}

absl::Status ModelRegistry::AdmitLoad(LoadRequest& request) const {
  WEIGHTD_RETURN_IF_ERROR(ValidateModelName(request.name));
  WEIGHTD_RETURN_IF_ERROR(CheckLoadPatterns(request));
  if (request.tp_size == 0) request.tp_size = 1;
  WEIGHTD_ASSIGN_OR_RETURN(request.checkpoint_path, ResolvePath(request.checkpoint_path));
  return absl::OkStatus();
}

absl::StatusOr<ModelRegistry::LoadResult> ModelRegistry::Load(LoadRequest request, const ProgressFn& progress) {
  if (absl::Status refused = AdmitLoad(request); !refused.ok()) {
    RefuseLoad(request, refused);  // the path as given: it did not resolve
    return refused;
  }
  auto record = std::make_shared<ModelGeneration>();  // LOADING
  record->request = request;
  bool busy = false;
  {
    absl::MutexLock lock(&mu_);
    busy = !loading_.emplace(request.name, record).second;
  }
  if (busy) {
    absl::Status refused = absl::AlreadyExistsError(absl::StrCat("model '", request.name, "' is already being loaded"));
    RefuseLoad(request, refused);
    return refused;
  }
  bool accepted = false;  // the plan was accepted: a failure from here on leaves a FAILED record
  absl::Status failure;
  absl::Cleanup end_load = [&] { EndLoad(request, *record, failure, accepted); };
  auto fail = [&failure](absl::Status status) {
    failure = status;
    return status;
  };
  if (progress) progress(LoadProgress{});
  absl::StatusOr<Catalog> catalog = BuildCatalog(request.checkpoint_path, CatalogOptions{&env(), options_.model_roots});
  if (!catalog.ok()) return fail(catalog.status());
  if (absl::Status none = SelectTensors(request, *catalog); !none.ok()) return fail(none);
  record->bytes_total = catalog->total_bytes();
  std::shared_ptr<ModelGeneration> previous;  // the name's READY generation, when its plan is the same
  // Every generation served now: their segments, indexed by what they hold
  // outside the lock, are what this load may share (server/load/
  // shared_segments.h; the index holds them weakly). The generations are
  // let go off the reply's path: one may be the last reference.
  auto served = std::make_shared<std::vector<std::shared_ptr<const ModelGeneration>>>();
  SharedSegments shared;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, model] : current_) served->push_back(model);
    for (const auto& model : draining_) served->push_back(model);
  }
  for (const auto& model : *served) shared.Add(*model);
  ReleaseLater(std::move(served));
  {
    absl::MutexLock lock(&mu_);
    if (std::shared_ptr<ModelGeneration> same = Reusable(request, *catalog)) {
      loading_.erase(request.name);
      failed_.erase(request.name);
      return LoadResult{same, true};
    }
    auto it = current_.find(request.name);
    if (it != current_.end() && it->second->state == ModelState::kReady && it->second->request.SamePlan(request)) {
      previous = it->second;
    }
  }
  ProgressFn track = [&](const LoadProgress& p) {
    accepted = accepted || p.phase >= LoadProgress::Phase::kAllocate;
    record->bytes_done = p.bytes_done;
    if (progress) progress(p);
  };
  absl::StatusOr<std::unique_ptr<ModelGeneration>> loaded = absl::NotFoundError("not seeded from a peer");
  // A READY generation with the same plan (a reload), or host segments this
  // node serves already (another name or plan over the same files), are
  // shared instead: peers seed only what this node holds none of.
  if (options_.seed_source != nullptr && previous == nullptr && SharedHostBytes(*catalog, request, options_.loader, shared) == 0) {
    loaded = options_.seed_source->Load(*catalog, request, options_.loader, track);  // each failure logged there
  }
  if (!loaded.ok()) loaded = LoadGeneration(*catalog, request, options_.loader, track, &shared);
  if (!loaded.ok()) return fail(loaded.status());
  LoadResult result = Publish(std::move(*loaded), *catalog);
  if (options_.loader.mlock) pinner_->Pin(result.model);
  if (previous != nullptr) ReleaseLater(std::move(previous));  // freed off the reply's path when unleased
  return result;
}

absl::StatusOr<ModelRegistry::LoadResult> ModelRegistry::Reload(const std::string& name,
                                                                const std::string& checkpoint_path,
                                                                const ProgressFn& progress) {
  LoadRequest request;
  absl::StatusOr<std::shared_ptr<ModelGeneration>> current;
  {
    absl::MutexLock lock(&mu_);
    current = GetLocked(name);
    if (current.ok()) request = (*current)->request;
  }
  if (!current.ok()) {
    RefuseLoad(LoadRequest{.name = name, .checkpoint_path = checkpoint_path}, current.status());
    return current.status();
  }
  if (!checkpoint_path.empty()) request.checkpoint_path = checkpoint_path;
  return Load(std::move(request), progress);
}

ModelRegistry::LoadResult ModelRegistry::Publish(std::unique_ptr<ModelGeneration> loaded, const Catalog& catalog) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<ModelGeneration> model = std::move(loaded);
  const std::string& name = model->request.name;
  model->warnings = catalog.warnings;
  loading_.erase(name);  // one load of a name at a time: this load's record
  failed_.erase(name);
  InstallLocked(model);
  if (listener_) listener_->OnLoadFinished(*model, catalog.total_bytes(), model->load_seconds);
  NotifyMemory();
  return LoadResult{model, false};
}

void ModelRegistry::InstallLocked(const std::shared_ptr<ModelGeneration>& model) {
  const std::string& name = model->request.name;
  model->generation = next_generation_++;
  model->state = ModelState::kReady;
  // Watchers see PUBLISHED of the new generation before DRAINING of the old.
  std::shared_ptr<ModelGeneration> previous = std::exchange(current_[name], model);
  AnnouncePublished(*model);
  // The old generation's layouts drain with it; engines publish again for
  // the new one, and writers still staging for the old one are refused.
  for (LayoutWriters::Ended& ended : layout_writers_.EndOf(name, model->generation, "superseded")) {
    ReleaseLater(FinishLayoutWriterLocked(std::move(ended), "superseded"));
  }
  if (previous) {
    // Nothing attaches the old generation's layouts any more: those without
    // a lease are freed now (a lease holds its own layout until it ends).
    AnnounceLayouts(ModelEvent::Kind::kLayoutDraining, *previous);
    for (auto& layout : previous->layouts->Clear()) ReleaseLater(std::move(layout));
    Retire(std::move(previous));
  }
  if (listener_) listener_->OnModelServing(name, true);
  if (listener_) listener_->OnGenerationPublished(model);
}

absl::Status ModelRegistry::Adopt(std::shared_ptr<ModelGeneration> model) {
  absl::MutexLock lock(&mu_);
  const std::string& name = model->request.name;
  if (current_.count(name)) return absl::AlreadyExistsError(absl::StrCat("model '", name, "' is loaded already"));
  next_generation_ = std::max(next_generation_, model->generation + 1);
  model->state = ModelState::kReady;
  current_[name] = model;
  AnnouncePublished(*model);
  if (listener_) listener_->OnModelServing(name, true);
  if (listener_) listener_->OnGenerationPublished(model);
  NotifyMemory();
  if (options_.loader.mlock) pinner_->Pin(model);  // adopted segments come unlocked
  return absl::OkStatus();
}

absl::StatusOr<ModelRegistry::UpdateGrant> ModelRegistry::BeginUpdate(const std::string& name,
                                                                      const std::vector<std::string>& tensors) {
  std::shared_ptr<ModelGeneration> base;
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    WEIGHTD_ASSIGN_OR_RETURN(base, GetLocked(name));
    if (base->numa_copies.size() > 1) {
      // A commit replaces the manifest's host segments; the other nodes'
      // copies would keep serving the old bytes. Not supported yet.
      return absl::FailedPreconditionError(absl::StrCat(
          "model '", name, "' has ", base->numa_copies.size(),
          " NUMA copies; a writer's update of a model loaded with numa_copies is not supported (load it without)"));
    }
    WEIGHTD_ASSIGN_OR_RETURN(id, updates_.Open(name, Now() + options_.claim_timeout));
  }
  absl::StatusOr<std::unique_ptr<StagedUpdate>> staged =
      StageUpdate(base, tensors, options_.loader.admission, options_.loader.device_backend);
  std::shared_ptr<StagedUpdate> update;  // dropped after the lock when not handed out
  absl::MutexLock lock(&mu_);
  if (!staged.ok()) {
    (void)updates_.End(id);  // unless an unload ended it already
    return staged.status();
  }
  update = std::move(*staged);
  if (!updates_.SetStaged(id, update, Now() + options_.claim_timeout).ok()) {
    return absl::AbortedError(absl::StrCat("model '", name, "' was unloaded while the update was being staged"));
  }
  if (listener_) listener_->OnUpdateStarted(name, update->bytes_staged);
  NotifyMemory();
  return UpdateGrant{id, update};
}

std::shared_ptr<StagedUpdate> ModelRegistry::FinishUpdateLocked(UpdateTable::Ended ended, const std::string& reason) {
  if (!reason.empty()) {
    if (listener_) listener_->OnUpdateAborted(ended.name, reason);
    // A writer may keep the fds of an update that ended: its pages must not
    // stay charged to the daemon. Sealed segments (a refused commit) cannot
    // be punched; they go when the writer closes them.
    if (ended.staged != nullptr) {
      for (const StagedSegment& s : ended.staged->segments) s.memory->Discard();
    }
  }
  return std::move(ended.staged);
}

absl::StatusOr<std::shared_ptr<const StagedUpdate>> ModelRegistry::ClaimUpdate(const std::string& update_id) {
  return updates_.Claim(update_id);
}

bool ModelRegistry::IsUpdateOpen(const std::string& update_id) const { return updates_.IsOpen(update_id); }

absl::StatusOr<ModelRegistry::CommitResult> ModelRegistry::CommitUpdate(const std::string& update_id,
                                                                        const CommitOptions& options) {
  auto start = std::chrono::steady_clock::now();
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<StagedUpdate> staged, updates_.BeginCommit(update_id));
  CommitAttempt attempt = SealAndVerify(*staged, options);
  std::shared_ptr<StagedUpdate> dropped;  // freed after the lock
  absl::MutexLock lock(&mu_);
  // Nothing ends an update under its commit (Unload and AbortUpdate record
  // their reason on it instead), so it is still in the table.
  const std::string name = updates_.NameOf(update_id).value_or(staged->base->request.name);
  auto current = current_.find(name);
  const bool base_current = current != current_.end() && current->second == staged->base;
  const std::optional<std::string> abort_requested = updates_.AbortRequested(update_id);
  CommitDecision decision = DecideCommit(attempt, base_current, abort_requested);
  if (decision.fate == CommitDecision::Fate::kRetry) {
    updates_.Reopen(update_id);
    return attempt.outcome.status();
  }
  if (decision.fate == CommitDecision::Fate::kAbort) {
    if (absl::StatusOr<UpdateTable::Ended> ended = updates_.End(update_id); ended.ok()) {
      dropped = FinishUpdateLocked(std::move(*ended), decision.abort_reason);
    }
    NotifyMemory();
    if (decision.abort_reason == "unloaded") {
      return absl::AbortedError(
          absl::StrCat("model '", name, "' was unloaded during the commit; the update is aborted"));
    }
    if (!attempt.outcome.ok()) return attempt.outcome.status();
    uint64_t now = current == current_.end() ? 0 : current->second->generation;
    return absl::FailedPreconditionError(absl::StrCat("model '", name, "' is at generation ", now,
                                                      " but this update began from generation ",
                                                      staged->base->generation, "; the update is aborted"));
  }
  std::shared_ptr<ModelGeneration> model = std::move(attempt.outcome->generation);
  model->load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (absl::StatusOr<UpdateTable::Ended> ended = updates_.End(update_id); ended.ok()) {
    dropped = FinishUpdateLocked(std::move(*ended), "");
  }
  InstallLocked(model);
  CommitResult result{model, attempt.outcome->tensors_changed, model->bytes_read, model->bytes_reused,
                      model->load_seconds};
  if (listener_) {
    listener_->OnUpdateCommitted(*model, result.bytes_written, result.bytes_shared, result.tensors_changed,
                                 result.seconds);
  }
  NotifyMemory();
  // `staged` holds the base generation: when no lease holds it either, it is
  // freed on the release thread rather than before this reply.
  ReleaseLater(std::move(staged));
  return result;
}

absl::Status ModelRegistry::AbortUpdate(const std::string& update_id, const std::string& reason) {
  std::shared_ptr<StagedUpdate> dropped;  // freed after the lock
  absl::MutexLock lock(&mu_);
  WEIGHTD_ASSIGN_OR_RETURN(UpdateTable::Ended ended, updates_.Abort(update_id, reason));
  dropped = FinishUpdateLocked(std::move(ended), reason);
  NotifyMemory();
  return absl::OkStatus();
}

void ModelRegistry::EndLoad(const LoadRequest& request, const ModelGeneration& record, const absl::Status& failure,
                            bool accepted) {
  absl::MutexLock lock(&mu_);
  EraseRecord(loading_, request.name, &record);
  if (failure.ok()) return;
  if (accepted) failed_[request.name] = FailedRecord(record, failure);
  if (listener_) listener_->OnLoadFailed(request, failure);
}

void ModelRegistry::Retire(std::shared_ptr<ModelGeneration> model) {
  if (model->leases.load() > 0) {
    model->state = ModelState::kDraining;
    Announce(ModelEvent::Kind::kDraining, *model);
    draining_.push_back(std::move(model));
  }
  // Otherwise the last reference goes out of scope here and frees the segments.
}

void ModelRegistry::Announce(ModelEvent::Kind kind, const ModelGeneration& model) {
  events_->Publish(EventOf(kind, model));
}

// FREED comes from the generation itself: its last reference may be a lease,
// a listing or a manifest page in flight, on any thread, after the registry
// let go. The hook holds the hub weakly: a generation may outlive it.
void ModelRegistry::AnnouncePublished(ModelGeneration& model) {
  Announce(ModelEvent::Kind::kPublished, model);
  ModelEvent freed = EventOf(ModelEvent::Kind::kFreed, model);
  model.on_freed.Set([hub = std::weak_ptr<ModelEventHub>(events_), freed]() mutable {
    if (std::shared_ptr<ModelEventHub> events = hub.lock()) {
      freed.unix_seconds = UnixSecondsNow();
      events->Publish(freed);
    }
  });
}

absl::StatusOr<std::shared_ptr<ModelEventHub::Watcher>> ModelRegistry::Watch(const std::string& name,
                                                                             std::function<void()> ready) {
  WEIGHTD_RETURN_IF_ERROR(ValidateModelName(name));
  absl::MutexLock lock(&mu_);
  std::optional<ModelEvent> current;
  if (auto it = current_.find(name); it != current_.end() && it->second->state == ModelState::kReady) {
    current = EventOf(ModelEvent::Kind::kCurrent, *it->second);
  }
  return events_->Subscribe(name, std::move(ready), std::move(current));
}

absl::StatusOr<ModelRegistry::UnloadResult> ModelRegistry::Unload(const std::string& name, bool force) {
  WEIGHTD_RETURN_IF_ERROR(ValidateModelName(name));  // before any message echoes it
  std::shared_ptr<StagedUpdate> dropped_update;  // an open update of the name ends with it, freed after the lock
  absl::MutexLock lock(&mu_);
  std::shared_ptr<ModelGeneration> failed;
  if (auto f = failed_.find(name); f != failed_.end()) {
    failed = std::move(f->second);
    failed_.erase(f);
  }
  if (std::optional<UpdateTable::Ended> ended = updates_.EndOf(name, "unloaded")) {
    dropped_update = FinishUpdateLocked(std::move(*ended), "unloaded");
  }
  for (LayoutWriters::Ended& ended : layout_writers_.EndOf(name, std::nullopt, "unloaded")) {
    ReleaseLater(FinishLayoutWriterLocked(std::move(ended), "unloaded"));
  }
  auto it = current_.find(name);
  if (it == current_.end()) return UnloadDraining(name, force, std::move(failed));
  std::shared_ptr<ModelGeneration> model = std::move(it->second);
  current_.erase(it);
  // Its layouts take no new attaches; leases on them keep their memory.
  AnnounceLayouts(ModelEvent::Kind::kLayoutDropped, *model);
  for (auto& layout : model->layouts->Clear()) ReleaseLater(std::move(layout));
  if (listener_) listener_->OnModelServing(name, false);
  if (listener_) listener_->OnModelUnloaded(name);
  Announce(ModelEvent::Kind::kUnloaded, *model);
  if (force) {
    DropLeasesOf(name);
  }
  bool freed = model->leases.load() == 0;
  Retire(model);
  NotifyMemory();
  return UnloadResult{model, freed};
}

absl::StatusOr<ModelRegistry::UnloadResult> ModelRegistry::UnloadDraining(const std::string& name, bool force,
                                                                           std::shared_ptr<ModelGeneration> failed) {
  auto draining = std::find_if(draining_.begin(), draining_.end(), [&](auto& m) { return m->request.name == name; });
  if (draining == draining_.end()) {
    if (failed != nullptr) return UnloadResult{std::move(failed), true};  // a record holds no memory
    return absl::NotFoundError(absl::StrCat("no model named '", name, "'"));
  }
  std::shared_ptr<ModelGeneration> model = *draining;  // the oldest draining generation of the name
  if (force) {
    DropLeasesOf(name);
    NotifyMemory();
  }
  return UnloadResult{model, model->leases.load() == 0};
}

uint64_t ModelRegistry::DropHostPageTables() {
  std::vector<std::shared_ptr<ModelGeneration>> held;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, model] : current_) held.push_back(model);
    held.insert(held.end(), draining_.begin(), draining_.end());
  }
  // Outside the lock: this takes ~70 ns a 4 KiB page, so up to 4 threads
  // share the segments (munlock(2) serialises on the address space's lock,
  // madvise(MADV_DONTNEED) does not: 2 threads take ~60% of one's time).
  // Segments shared by generations are dropped once.
  std::set<const HostSegment*> seen;
  std::vector<const HostSegment*> segments;
  for (const std::shared_ptr<ModelGeneration>& model : held) {
    for (const std::shared_ptr<const HostSegment>& segment : model->host_segments) {
      if (seen.insert(segment.get()).second) segments.push_back(segment.get());
    }
  }
  const size_t threads = std::min<size_t>({4, std::max(1u, std::thread::hardware_concurrency()), segments.size()});
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> bytes{0};
  auto drop = [&] {
    for (size_t i; (i = next.fetch_add(1)) < segments.size();) bytes += segments[i]->DropPageTables();
  };
  std::vector<std::thread> helpers;
  for (size_t t = 1; t < threads; ++t) helpers.emplace_back(drop);
  drop();
  for (std::thread& t : helpers) t.join();
  return bytes.load();
}

std::vector<std::shared_ptr<ModelGeneration>> ModelRegistry::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<ModelGeneration>> out;
  for (const auto& [name, model] : current_) out.push_back(model);
  out.insert(out.end(), draining_.begin(), draining_.end());
  return out;
}

std::vector<std::shared_ptr<ModelGeneration>> ModelRegistry::ListAll() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<ModelGeneration>> out;
  for (const auto& [name, model] : current_) out.push_back(model);
  for (const auto& [name, record] : loading_) out.push_back(record);
  for (const auto& [name, record] : failed_) out.push_back(record);
  out.insert(out.end(), draining_.begin(), draining_.end());
  return out;
}

absl::StatusOr<std::shared_ptr<ModelGeneration>> ModelRegistry::Get(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  return GetLocked(name);
}

absl::StatusOr<std::shared_ptr<ModelGeneration>> ModelRegistry::GetRank(const std::string& name, uint32_t rank) const {
  absl::MutexLock lock(&mu_);
  return GetRankLocked(name, rank);
}

absl::StatusOr<std::shared_ptr<ModelGeneration>> ModelRegistry::GetRankLocked(const std::string& name,
                                                                              uint32_t rank) const {
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<ModelGeneration> model, GetLocked(name));
  if (rank >= model->ranks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is out of range: model '", name, "' has ", model->ranks.size(), " rank(s)"));
  }
  return model;
}

absl::StatusOr<std::shared_ptr<ModelGeneration>> ModelRegistry::GetLocked(const std::string& name) const {
  WEIGHTD_RETURN_IF_ERROR(ValidateModelName(name));  // before any message echoes it
  auto it = current_.find(name);
  if (it == current_.end()) {
    if (loading_.count(name)) return absl::FailedPreconditionError(absl::StrCat("model '", name, "' is still loading"));
    if (auto failed = failed_.find(name); failed != failed_.end()) {
      return absl::FailedPreconditionError(absl::StrCat("model '", name, "' failed to load (", failed->second->error,
                                                        "); load it again or unload it"));
    }
    return absl::NotFoundError(absl::StrCat("no model named '", name, "'"));
  }
  return it->second;
}

absl::StatusOr<ModelRegistry::Grant> ModelRegistry::Attach(const std::string& name, uint32_t rank,
                                                           const AttachPlacement& placement, const AttachLayout& layout) {
  absl::MutexLock lock(&mu_);  // one critical section: an Unload cannot slip in before the lease
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<ModelGeneration> model, GetRankLocked(name, rank));
  std::shared_ptr<const Layout> found;
  int copy = -1;
  if (!layout.key.empty()) {
    WEIGHTD_ASSIGN_OR_RETURN(found, FindLayoutLocked(*model, rank, layout));
  } else {
    WEIGHTD_ASSIGN_OR_RETURN(copy, ChooseNumaCopy(model->numa_copies, placement.numa_node, placement.cpus));
  }
  auto now = Now();
  LeaseTable::Lease lease = leases_.Add(model, rank, now, now + options_.claim_timeout, copy, found);
  if (listener_) listener_->OnLeasesChanged(name, model->leases.load());
  return Grant{lease.id, model, rank, copy, found};
}

absl::StatusOr<ModelRegistry::Grant> ModelRegistry::Claim(const std::string& lease_id) {
  absl::MutexLock lock(&mu_);
  WEIGHTD_ASSIGN_OR_RETURN(LeaseTable::Lease lease, leases_.Claim(lease_id));
  if (listener_) {
    double seconds = std::chrono::duration<double>(Now() - lease.attached).count();
    listener_->OnLeaseClaimed(lease.model->request.name, seconds);
  }
  return Grant{lease.id, lease.model, lease.rank, lease.numa_copy, lease.layout};
}

void ModelRegistry::LeaseRemovedLocked(LeaseTable::Removed& removed) {
  // A dropped layout's last lease: free it on the release thread, not under the locks.
  if (removed.layout != nullptr) ReleaseLater(std::move(removed.layout));
  if (listener_) listener_->OnLeasesChanged(removed.model->request.name, removed.leases_left);
  if (removed.leases_left == 0 && removed.model->state == ModelState::kDraining) {
    std::erase(draining_, removed.model);
  }
}

void ModelRegistry::DropLeasesOf(const std::string& name) {
  std::map<uint64_t, int> kept;  // generation -> claimed handle-exported leases left to their clients
  std::vector<LeaseTable::Removed> removed = leases_.RemoveOf(name, [&](const LeaseTable::Lease& lease) {
    // A layout lease maps the layout's arenas, not the model's.
    bool keep = lease.claimed && (lease.layout != nullptr ? HasHandleExportedArenas(*lease.layout)
                                                          : HasHandleExportedArenas(*lease.model));
    if (keep) ++kept[lease.model->generation];
    return keep;
  });
  for (LeaseTable::Removed& r : removed) LeaseRemovedLocked(r);
  for (const auto& [generation, count] : kept) {
    LogWarning(absl::StrCat("forced unload of model '", name, "' generation ", generation, ": ", count,
                            " claimed lease(s) on cuda-legacy-ipc arenas end only when their clients close them or "
                            "exit (freeing memory a client still has open is undefined in CUDA IPC)"));
  }
}

void ModelRegistry::Release(const std::string& lease_id) {
  absl::MutexLock lock(&mu_);
  LeaseTable::Removed removed = leases_.Remove(lease_id);
  if (removed.model == nullptr) return;
  LeaseRemovedLocked(removed);
  NotifyMemory();
}

absl::Status ModelRegistry::Detach(const std::string& lease_id) {
  if (!IsLeaseLive(lease_id)) return absl::NotFoundError("unknown or expired lease id");
  Release(lease_id);
  return absl::OkStatus();
}

bool ModelRegistry::IsLeaseLive(const std::string& lease_id) const { return leases_.Contains(lease_id); }

int ModelRegistry::ExpirePending() {
  std::vector<std::shared_ptr<StagedUpdate>> dropped;  // freed after the lock
  absl::MutexLock lock(&mu_);
  auto now = Now();
  int expired = 0;
  for (LeaseTable::Removed& r : leases_.RemoveExpired(now)) {
    LeaseRemovedLocked(r);
    ++expired;
  }
  for (UpdateTable::Ended& ended : updates_.Expire(now)) {
    LogWarning(absl::StrCat("update of model '", ended.name, "' was not claimed on the fd socket within ",
                            options_.claim_timeout.count(), " ms; aborted"));
    dropped.push_back(FinishUpdateLocked(std::move(ended), "claim_timeout"));
    ++expired;
  }
  for (LayoutWriters::Ended& ended : layout_writers_.Expire(now)) {
    ReleaseLater(FinishLayoutWriterLocked(std::move(ended), "claim_timeout"));
    ++expired;
  }
  if (expired) NotifyMemory();
  return expired;
}

void ModelRegistry::NotifyMemory() {
  if (!listener_) return;
  uint64_t host = 0, locked = 0;
  absl::flat_hash_set<const HostSegment*> seen;  // generations share segments: count each once
  auto add = [&](const ModelGeneration& m) {
    for (const auto& segment : m.host_segments) {
      if (!seen.insert(segment.get()).second) continue;
      host += segment->size();
      locked += segment->locked() ? segment->size() : 0;
    }
  };
  auto add_layouts = [&](const ModelGeneration& m) {
    for (const auto& layout : m.layouts->List()) {
      for (const auto& segment : layout->host_segments) {
        if (!seen.insert(segment.get()).second) continue;
        host += segment->size();
        locked += segment->locked() ? segment->size() : 0;
      }
    }
  };
  for (const auto& [name, model] : current_) {
    add(*model);
    add_layouts(*model);
  }
  for (const auto& model : draining_) {
    add(*model);
    add_layouts(*model);
  }
  host += updates_.StagedBytes() + layout_writers_.StagedBytes();
  listener_->OnMemoryChanged(host, locked);
}

}  // namespace weightd
