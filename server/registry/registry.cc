#include "server/registry/registry.h"

#include <algorithm>
#include <cstring>
#include <random>
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

std::string NewLeaseId() {
  static absl::Mutex mu(absl::kConstInit);
  static std::random_device device ABSL_GUARDED_BY(mu);
  absl::MutexLock lock(&mu);
  return absl::StrFormat("%08x%08x%08x%08x", device(), device(), device(), device());
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
  record->bytes_total = catalog->total_bytes();
  std::shared_ptr<ModelGeneration> previous;  // the name's READY generation, when its plan is the same
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
  // A READY generation with the same plan (a reload) shares its unchanged
  // files instead: peers seed only names this node does not serve yet.
  if (options_.seed_source != nullptr && previous == nullptr) {
    loaded = options_.seed_source->Load(*catalog, request, options_.loader, track);  // each failure logged there
  }
  if (!loaded.ok()) loaded = LoadGeneration(*catalog, request, options_.loader, track, previous.get());
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
  if (previous) Retire(std::move(previous));
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
  std::string id = NewLeaseId();
  std::shared_ptr<ModelGeneration> base;
  {
    absl::MutexLock lock(&mu_);
    WEIGHTD_ASSIGN_OR_RETURN(base, GetLocked(name));
    if (updates_.count(name)) {
      return absl::AlreadyExistsError(
          absl::StrCat("model '", name, "' already has an open update (one writer per model at a time)"));
    }
    updates_[name] = OpenUpdate{id, nullptr, false, false, Now() + options_.claim_timeout};
  }
  absl::StatusOr<std::unique_ptr<StagedUpdate>> staged = StageUpdate(base, tensors, options_.loader.admission, options_.loader.device_backend);
  std::shared_ptr<StagedUpdate> dropped;  // freed after the lock
  absl::MutexLock lock(&mu_);
  auto it = updates_.find(name);
  bool ours = it != updates_.end() && it->second.id == id;
  if (!staged.ok()) {
    if (ours) updates_.erase(it);
    return staged.status();
  }
  if (!ours) {
    dropped = std::move(*staged);
    return absl::AbortedError(absl::StrCat("model '", name, "' was unloaded while the update was being staged"));
  }
  it->second.staged = std::move(*staged);
  it->second.deadline = Now() + options_.claim_timeout;
  if (listener_) listener_->OnUpdateStarted(name, it->second.staged->bytes_staged);
  NotifyMemory();
  return UpdateGrant{id, it->second.staged};
}

std::map<std::string, ModelRegistry::OpenUpdate>::iterator ModelRegistry::FindUpdateLocked(const std::string& id) {
  return std::find_if(updates_.begin(), updates_.end(), [&](const auto& u) { return u.second.id == id; });
}

std::shared_ptr<StagedUpdate> ModelRegistry::EndUpdateLocked(std::map<std::string, OpenUpdate>::iterator it,
                                                             const std::string& reason) {
  std::shared_ptr<StagedUpdate> staged = std::move(it->second.staged);
  std::string name = it->first;
  updates_.erase(it);
  if (!reason.empty()) {
    if (listener_) listener_->OnUpdateAborted(name, reason);
    // A writer may keep the fds of an update that ended: its pages must not
    // stay charged to the daemon. Sealed segments (a refused commit) cannot
    // be punched; they go when the writer closes them.
    if (staged != nullptr) {
      for (const StagedSegment& s : staged->segments) s.memory->Discard();
    }
  }
  return staged;
}

absl::StatusOr<std::shared_ptr<const StagedUpdate>> ModelRegistry::ClaimUpdate(const std::string& update_id) {
  absl::MutexLock lock(&mu_);
  auto it = FindUpdateLocked(update_id);
  if (it == updates_.end() || it->second.staged == nullptr) return absl::NotFoundError("unknown or ended update id");
  if (it->second.claimed) return absl::FailedPreconditionError("update already claimed on another connection");
  it->second.claimed = true;
  return std::shared_ptr<const StagedUpdate>(it->second.staged);
}

bool ModelRegistry::IsUpdateOpen(const std::string& update_id) const {
  absl::MutexLock lock(&mu_);
  return std::any_of(updates_.begin(), updates_.end(), [&](const auto& u) { return u.second.id == update_id; });
}

absl::StatusOr<ModelRegistry::CommitResult> ModelRegistry::CommitUpdate(const std::string& update_id,
                                                                        const CommitOptions& options) {
  auto start = std::chrono::steady_clock::now();
  std::shared_ptr<StagedUpdate> staged;
  {
    absl::MutexLock lock(&mu_);
    auto it = FindUpdateLocked(update_id);
    if (it == updates_.end() || it->second.staged == nullptr) return absl::NotFoundError("unknown or ended update id");
    if (it->second.committing) return absl::FailedPreconditionError("this update is already being committed");
    it->second.committing = true;
    staged = it->second.staged;
  }
  bool sealed = false;
  absl::StatusOr<CommitOutcome> outcome = SealAndVerify(*staged, options, &sealed);
  std::shared_ptr<StagedUpdate> dropped;  // freed after the lock
  absl::MutexLock lock(&mu_);
  auto it = FindUpdateLocked(update_id);
  if (it == updates_.end()) {
    return absl::AbortedError(absl::StrCat("model '", staged->base->request.name,
                                           "' was unloaded during the commit; the update is aborted"));
  }
  const std::string name = it->first;
  auto current = current_.find(name);
  bool base_current = current != current_.end() && current->second == staged->base;
  if (!outcome.ok()) {
    // Left open only for what the writer can fix and retry: a bad label or
    // expected hash (INVALID_ARGUMENT, before anything was sealed) or a
    // segment still mapped writable (FAILED_PRECONDITION before sealing),
    // and only while the update's base is still the served generation.
    bool retryable = !sealed && base_current && (absl::IsInvalidArgument(outcome.status()) ||
                                                 absl::IsFailedPrecondition(outcome.status()));
    if (retryable) {
      it->second.committing = false;
    } else {
      dropped = EndUpdateLocked(it, sealed ? "verification_failed" : base_current ? "aborted_by_writer" : "superseded");
      NotifyMemory();
    }
    return outcome.status();
  }
  if (!base_current) {
    uint64_t now = current == current_.end() ? 0 : current->second->generation;
    dropped = EndUpdateLocked(it, "superseded");
    NotifyMemory();
    return absl::FailedPreconditionError(absl::StrCat("model '", name, "' is at generation ", now,
                                                      " but this update began from generation ",
                                                      staged->base->generation, "; the update is aborted"));
  }
  std::shared_ptr<ModelGeneration> model = std::move(outcome->generation);
  model->load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  dropped = EndUpdateLocked(it, "");
  InstallLocked(model);
  CommitResult result{model, outcome->tensors_changed, model->bytes_read, model->bytes_reused, model->load_seconds};
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
  auto it = FindUpdateLocked(update_id);
  if (it == updates_.end()) return absl::NotFoundError("unknown or ended update id");
  if (it->second.committing) return absl::FailedPreconditionError("this update is being committed");
  dropped = EndUpdateLocked(it, reason);
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
  absl::MutexLock lock(&mu_);
  std::shared_ptr<ModelGeneration> failed;
  if (auto f = failed_.find(name); f != failed_.end()) {
    failed = std::move(f->second);
    failed_.erase(f);
  }
  std::shared_ptr<StagedUpdate> dropped_update;  // an open update of the name ends with it
  if (auto u = updates_.find(name); u != updates_.end() && !u->second.committing) {
    dropped_update = EndUpdateLocked(u, "unloaded");
  }
  auto it = current_.find(name);
  if (it == current_.end()) return UnloadDraining(name, force, std::move(failed));
  std::shared_ptr<ModelGeneration> model = std::move(it->second);
  current_.erase(it);
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

absl::StatusOr<ModelRegistry::Grant> ModelRegistry::Attach(const std::string& name, uint32_t rank) {
  absl::MutexLock lock(&mu_);  // one critical section: an Unload cannot slip in before the lease
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<ModelGeneration> model, GetRankLocked(name, rank));
  std::string id = NewLeaseId();
  auto now = Now();
  leases_[id] = Lease{model, rank, false, now, now + options_.claim_timeout};
  int count = ++model->leases;
  if (listener_) listener_->OnLeasesChanged(name, count);
  return Grant{id, model, rank};
}

absl::StatusOr<ModelRegistry::Grant> ModelRegistry::Claim(const std::string& lease_id) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return absl::NotFoundError("unknown or expired lease id");
  if (it->second.claimed) return absl::FailedPreconditionError("lease already claimed on another connection");
  it->second.claimed = true;
  if (listener_) {
    double seconds = std::chrono::duration<double>(Now() - it->second.attached).count();
    listener_->OnLeaseClaimed(it->second.model->request.name, seconds);
  }
  return Grant{lease_id, it->second.model, it->second.rank};
}

void ModelRegistry::DropLease(std::map<std::string, Lease>::iterator it) {
  std::shared_ptr<ModelGeneration> model = std::move(it->second.model);
  leases_.erase(it);
  int count = --model->leases;
  if (listener_) listener_->OnLeasesChanged(model->request.name, count);
  if (count == 0 && model->state == ModelState::kDraining) {
    std::erase(draining_, model);
  }
}

void ModelRegistry::DropLeasesOf(const std::string& name) {
  std::map<uint64_t, int> kept;  // generation -> claimed handle-exported leases left to their clients
  for (auto l = leases_.begin(); l != leases_.end();) {
    auto next = std::next(l);
    const Lease& lease = l->second;
    if (lease.model->request.name == name) {
      if (lease.claimed && HasHandleExportedArenas(*lease.model)) {
        ++kept[lease.model->generation];
      } else {
        DropLease(l);
      }
    }
    l = next;
  }
  for (const auto& [generation, count] : kept) {
    LogWarning(absl::StrCat("forced unload of model '", name, "' generation ", generation, ": ", count,
                            " claimed lease(s) on cuda-legacy-ipc arenas end only when their clients close them or "
                            "exit (freeing memory a client still has open is undefined in CUDA IPC)"));
  }
}

void ModelRegistry::Release(const std::string& lease_id) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return;
  DropLease(it);
  NotifyMemory();
}

absl::Status ModelRegistry::Detach(const std::string& lease_id) {
  if (!IsLeaseLive(lease_id)) return absl::NotFoundError("unknown or expired lease id");
  Release(lease_id);
  return absl::OkStatus();
}

bool ModelRegistry::IsLeaseLive(const std::string& lease_id) const {
  absl::MutexLock lock(&mu_);
  return leases_.count(lease_id) != 0;
}

int ModelRegistry::ExpirePending() {
  absl::MutexLock lock(&mu_);
  auto now = Now();
  int expired = 0;
  for (auto it = leases_.begin(); it != leases_.end();) {
    auto next = std::next(it);
    if (!it->second.claimed && it->second.deadline < now) {
      DropLease(it);
      ++expired;
    }
    it = next;
  }
  std::vector<std::shared_ptr<StagedUpdate>> dropped;  // freed after the lock
  for (auto it = updates_.begin(); it != updates_.end();) {
    auto next = std::next(it);
    if (it->second.staged != nullptr && !it->second.claimed && !it->second.committing && it->second.deadline < now) {
      LogWarning(absl::StrCat("update of model '", it->first, "' was not claimed on the fd socket within ",
                              options_.claim_timeout.count(), " ms; aborted"));
      dropped.push_back(EndUpdateLocked(it, "claim_timeout"));
      ++expired;
    }
    it = next;
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
  for (const auto& [name, model] : current_) add(*model);
  for (const auto& model : draining_) add(*model);
  for (const auto& [name, update] : updates_) {
    if (update.staged == nullptr) continue;
    for (const StagedSegment& s : update.staged->segments) host += s.memory->size();
  }
  listener_->OnMemoryChanged(host, locked);
}

}  // namespace weightd
