#include "server/registry.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/cleanup/cleanup.h"
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
                     [](const std::unique_ptr<DeviceArena>& arena) { return arena->export_fd() < 0; });
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

bool LoadRequest::SamePlan(const LoadRequest& o) const {
  auto same_rules = [&] {
    if (tp_rules.size() != o.tp_rules.size()) return false;
    for (size_t i = 0; i < tp_rules.size(); ++i) {
      if (tp_rules[i].pattern != o.tp_rules[i].pattern || tp_rules[i].dim != o.tp_rules[i].dim) return false;
    }
    return true;
  };
  return checkpoint_path == o.checkpoint_path && host_resident_patterns == o.host_resident_patterns &&
         tp_size == o.tp_size && devices == o.devices && same_rules();
}

absl::Status ValidateModelName(const std::string& name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat("model name must be 1 to 128 characters, got ", name.size()));
  }
  for (char c : name) {
    if (!(isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) {
      return absl::InvalidArgumentError(
          absl::StrCat("model name '", name, "' may hold only letters, digits, '.', '_' and '-'"));
    }
  }
  return absl::OkStatus();
}

ModelRegistry::ModelRegistry(RegistryOptions options, RegistryListener* listener)
    : admission_(options.host_memory_probe),
      options_(std::move(options)),
      listener_(listener),
      events_(std::make_shared<ModelEventHub>(options_.watch)) {
  options_.loader.cancel = &cancel_loads_;
  if (options_.loader.admission == nullptr) options_.loader.admission = &admission_;
}

absl::StatusOr<std::string> ModelRegistry::ResolvePath(const std::string& path) const {
  if (path.empty()) return absl::InvalidArgumentError("checkpoint path is empty");
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
  if (!model.request.SamePlan(request) || model.files.size() != catalog.files.size()) return nullptr;
  for (size_t i = 0; i < catalog.files.size(); ++i) {
    const CatalogFile& f = catalog.files[i];
    if (!(model.files[i] == FileStamp{f.name, f.size, f.mtime_ns})) return nullptr;
  }
  return it->second;
}

absl::StatusOr<ModelRegistry::LoadResult> ModelRegistry::Load(LoadRequest request, const ProgressFn& progress) {
  WEIGHTD_RETURN_IF_ERROR(ValidateModelName(request.name));
  if (request.tp_size == 0) request.tp_size = 1;
  WEIGHTD_ASSIGN_OR_RETURN(request.checkpoint_path, ResolvePath(request.checkpoint_path));
  auto record = std::make_shared<ModelGeneration>();  // LOADING
  record->request = request;
  {
    absl::MutexLock lock(&mu_);
    if (!loading_.emplace(request.name, record).second) {
      return absl::AlreadyExistsError(absl::StrCat("model '", request.name, "' is already being loaded"));
    }
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
  {
    absl::MutexLock lock(&mu_);
    if (std::shared_ptr<ModelGeneration> same = Reusable(request, *catalog)) {
      loading_.erase(request.name);
      failed_.erase(request.name);
      return LoadResult{same, true};
    }
  }
  ProgressFn track = [&](const LoadProgress& p) {
    accepted = accepted || p.phase >= LoadProgress::Phase::kAllocate;
    record->bytes_done = p.bytes_done;
    if (progress) progress(p);
  };
  absl::StatusOr<std::unique_ptr<ModelGeneration>> loaded = LoadGeneration(*catalog, request, options_.loader, track);
  if (!loaded.ok()) return fail(loaded.status());
  return Publish(std::move(*loaded), *catalog);
}

ModelRegistry::LoadResult ModelRegistry::Publish(std::unique_ptr<ModelGeneration> loaded, const Catalog& catalog) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<ModelGeneration> model = std::move(loaded);
  const std::string& name = model->request.name;
  model->warnings = catalog.warnings;
  model->generation = next_generation_++;
  model->state = ModelState::kReady;
  loading_.erase(name);  // one load of a name at a time: this load's record
  failed_.erase(name);
  std::shared_ptr<ModelGeneration> previous = std::exchange(current_[name], model);
  AnnouncePublished(*model);
  if (previous) Retire(std::move(previous));
  if (listener_) {
    listener_->OnLoadFinished(*model, catalog.total_bytes(), model->load_seconds);
    listener_->OnModelServing(name, true);
  }
  NotifyMemory();
  return LoadResult{model, false};
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
  auto it = current_.find(name);
  if (it == current_.end()) return UnloadDraining(name, force, std::move(failed));
  std::shared_ptr<ModelGeneration> model = std::move(it->second);
  current_.erase(it);
  if (listener_) listener_->OnModelServing(name, false);
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
  if (expired) NotifyMemory();
  return expired;
}

void ModelRegistry::NotifyMemory() {
  if (!listener_) return;
  uint64_t host = 0, locked = 0;
  auto add = [&](const ModelGeneration& m) {
    host += m.host_bytes;
    locked += m.locked_bytes;
  };
  for (const auto& [name, model] : current_) add(*model);
  for (const auto& model : draining_) add(*model);
  listener_->OnMemoryChanged(host, locked);
}

}  // namespace weightd
