// ModelRegistry's runtime layouts (registry.h, server/layout/layout_publish.h).
#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "server/registry/registry.h"

namespace weightd {
namespace {

ModelEvent LayoutEvent(ModelEvent::Kind kind, const ModelGeneration& model, const Layout& layout) {
  ModelEvent e{kind, model.request.name, model.generation, model.version_label, layout.fingerprint, UnixSecondsNow()};
  e.layout = layout.key;
  e.rank = layout.rank;
  return e;
}

// The keys, quoted; the first 8 and "and N more" beyond them, so a long
// list cannot outgrow a status message (kMaxStatusMessageBytes).
std::string QuotedKeys(const std::vector<std::string>& keys) {
  constexpr size_t kShown = 8;
  if (keys.empty()) return "none";
  std::vector<std::string> quoted;
  for (size_t i = 0; i < keys.size() && i < kShown; ++i) quoted.push_back(QuoteName(keys[i]));
  std::string list = absl::StrJoin(quoted, ", ");
  if (keys.size() > kShown) absl::StrAppend(&list, " and ", keys.size() - kShown, " more");
  return list;
}

}  // namespace

absl::StatusOr<DeviceInfo> ModelRegistry::LayoutDeviceLocked(const ModelGeneration& model, uint32_t rank,
                                                             const std::string& gpu_uuid) const {
  DeviceBackend* backend = options_.loader.device_backend;
  if (backend == nullptr) {
    return absl::FailedPreconditionError(
        "the layout has DEVICE tensors but the daemon runs without a device backend (--device-backend)");
  }
  std::string uuid = gpu_uuid;
  if (uuid.empty()) {
    for (uint32_t id : model.ranks[rank].segments) {
      if (model.segments[id].placement == Placement::kDevice) uuid = model.segments[id].gpu_uuid;
    }
  }
  if (uuid.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank, " of model ", QuoteName(model.request.name),
                                                      " has no GPU in its plan; name the GPU of the layout's DEVICE "
                                                      "tensors (gpu_uuid)"));
  }
  WEIGHTD_ASSIGN_OR_RETURN(std::vector<DeviceInfo> devices, backend->Devices());
  for (const DeviceInfo& d : devices) {
    if (d.uuid == uuid) return d;
  }
  return absl::FailedPreconditionError(absl::StrCat("GPU ", QuoteName(uuid), " is not one of the daemon's ",
                                                    backend->name(), " devices (", DeviceList(devices), ")"));
}

absl::Status ModelRegistry::AdmitDeviceBytesLocked(const DeviceInfo& device, uint64_t bytes) const {
  if (bytes == 0 || device.total_bytes == 0) return absl::OkStatus();
  uint64_t held = 0;
  absl::flat_hash_set<const DeviceArena*> seen;  // generations share arenas: count each once
  auto add = [&](const ModelGeneration& m) {
    for (const auto& arena : m.arenas) {
      if (arena->device().uuid == device.uuid && seen.insert(arena.get()).second) held += arena->size();
    }
    for (const auto& layout : m.layouts->List()) {
      if (layout->gpu_uuid == device.uuid) held += layout->device_bytes;
    }
  };
  for (const auto& [name, model] : current_) add(*model);
  for (const auto& model : draining_) add(*model);
  if (held + bytes > device.total_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the layout needs ", bytes, " bytes on ", device.uuid, ", which has ",
                                                     device.total_bytes, " bytes of which weightd holds ", held));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelRegistry::LayoutGrant> ModelRegistry::BeginLayout(LayoutRequest request) {
  WEIGHTD_RETURN_IF_ERROR(ValidateModelName(request.model));
  WEIGHTD_RETURN_IF_ERROR(ValidateLayoutRequest(request));
  const absl::Time wait_until = absl::Now() + absl::Seconds(request.wait_seconds);
  const bool has_device = std::any_of(request.tensors.begin(), request.tensors.end(),
                                      [](const LayoutTensorSpec& t) { return t.placement == Placement::kDevice; });
  while (true) {
    LayoutWriters::Slot slot;
    DeviceInfo device;
    std::string id;
    {
      absl::MutexLock lock(&mu_);
      WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<ModelGeneration> model, GetRankLocked(request.model, request.rank));
      if (request.generation != 0 && request.generation != model->generation) {
        return absl::FailedPreconditionError(absl::StrCat("model ", QuoteName(request.model), " is at generation ",
                                                          model->generation, ", not ", request.generation,
                                                          "; a layout belongs to the current generation"));
      }
      slot = {request.model, model->generation, request.key, request.rank};
      if (std::shared_ptr<const Layout> published = model->layouts->Find(request.key, request.rank)) {
        if (request.wait_seconds > 0) return LayoutGrant{"", nullptr, published, model->generation};
        return absl::AlreadyExistsError(absl::StrCat(
            "layout ", QuoteName(request.key), " of rank ", request.rank, " of model ", QuoteName(request.model),
            " generation ", model->generation, " is published already; attach it, or drop it first"));
      }
      if (has_device) {
        WEIGHTD_ASSIGN_OR_RETURN(device, LayoutDeviceLocked(*model, request.rank, request.gpu_uuid));
      }
      absl::StatusOr<std::string> opened = layout_writers_.Open(slot, Now() + options_.claim_timeout);
      if (opened.ok()) {
        id = *opened;
      } else if (!absl::IsAlreadyExists(opened.status()) || request.wait_seconds <= 0) {
        return opened.status();
      }
    }
    if (id.empty()) {
      absl::Status freed = layout_writers_.AwaitFree(slot, wait_until);
      if (absl::IsDeadlineExceeded(freed)) {
        return absl::DeadlineExceededError(absl::StrCat(freed.message(), " after ", request.wait_seconds, " s"));
      }
      WEIGHTD_RETURN_IF_ERROR(freed);
      continue;  // committed (published) or aborted (free): look again
    }
    const std::string name = request.model;
    absl::StatusOr<std::unique_ptr<StagedLayout>> staged = StageLayout(
        std::move(request), slot.generation, device, options_.loader.device_backend, options_.loader.admission);
    std::shared_ptr<StagedLayout> held;  // dropped after the lock when not handed out
    absl::MutexLock lock(&mu_);
    if (staged.ok() && staged->get()->device_bytes > 0) {
      if (absl::Status admitted = AdmitDeviceBytesLocked(device, staged->get()->device_bytes); !admitted.ok()) {
        staged = admitted;
      }
    }
    if (!staged.ok()) {
      (void)layout_writers_.End(id);
      return staged.status();
    }
    held = std::move(*staged);
    if (!layout_writers_.SetStaged(id, held, Now() + options_.claim_timeout).ok()) {
      return absl::AbortedError(absl::StrCat("model ", QuoteName(name), " generation ", slot.generation,
                                             " was unloaded or replaced while the layout was being staged"));
    }
    NotifyMemory();
    return LayoutGrant{id, held, nullptr, slot.generation};
  }
}

std::shared_ptr<StagedLayout> ModelRegistry::FinishLayoutWriterLocked(LayoutWriters::Ended ended,
                                                                      const std::string& reason) {
  if (!reason.empty()) {
    if (listener_) listener_->OnLayoutAborted(ended.slot.model, reason);
    LogInfo(absl::StrCat("layout ", QuoteName(ended.slot.key), " of rank ", ended.slot.rank, " of model ",
                         QuoteName(ended.slot.model), " generation ", ended.slot.generation,
                         ": publish ended without a layout (", reason, ")"));
    if (ended.staged != nullptr) DiscardStagedLayout(*ended.staged);
  }
  return std::move(ended.staged);
}

absl::StatusOr<std::shared_ptr<const StagedLayout>> ModelRegistry::ClaimLayoutWriter(const std::string& writer_id) {
  return layout_writers_.Claim(writer_id);
}

bool ModelRegistry::IsLayoutWriterOpen(const std::string& writer_id) const { return layout_writers_.IsOpen(writer_id); }

absl::StatusOr<std::shared_ptr<const Layout>> ModelRegistry::CommitLayout(
    const std::string& writer_id, const std::map<std::string, std::string>& expected_hashes) {
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<StagedLayout> staged, layout_writers_.BeginCommit(writer_id));
  LayoutCommitAttempt attempt = SealLayout(*staged, expected_hashes, options_.loader.mlock);
  std::shared_ptr<StagedLayout> dropped;  // freed after the lock
  absl::MutexLock lock(&mu_);
  const std::string& name = staged->request.model;
  auto current = current_.find(name);
  const bool generation_current = current != current_.end() && current->second->generation == staged->generation;
  const std::optional<std::string> abort_requested = layout_writers_.AbortRequested(writer_id);
  if (!attempt.layout.ok() || !generation_current) {
    const absl::Status error = attempt.layout.ok() ? absl::OkStatus() : attempt.layout.status();
    const bool fixable = absl::IsInvalidArgument(error) || absl::IsFailedPrecondition(error);
    if (!error.ok() && !attempt.sealed && generation_current && fixable && !abort_requested.has_value()) {
      layout_writers_.Reopen(writer_id);
      return error;
    }
    std::string reason = abort_requested.value_or(attempt.sealed && !error.ok() ? "verification_failed"
                                                  : generation_current       ? "aborted_by_writer"
                                                                             : "superseded");
    if (absl::StatusOr<LayoutWriters::Ended> ended = layout_writers_.End(writer_id); ended.ok()) {
      dropped = FinishLayoutWriterLocked(std::move(*ended), reason);
    }
    NotifyMemory();
    if (!error.ok()) return Annotate(error, "the layout is not published");
    return absl::FailedPreconditionError(absl::StrCat("model ", QuoteName(name), " no longer serves generation ",
                                                      staged->generation, " (", reason, "); the layout is not published"));
  }
  std::shared_ptr<Layout> layout = std::move(*attempt.layout);
  layout->published_at = UnixSecondsNow();
  if (absl::StatusOr<LayoutWriters::Ended> ended = layout_writers_.End(writer_id); ended.ok()) {
    dropped = FinishLayoutWriterLocked(std::move(*ended), "");
  }
  if (!current->second->layouts->Add(layout)) {
    return absl::AlreadyExistsError(absl::StrCat("layout ", QuoteName(layout->key), " of rank ", layout->rank,
                                                 " of model ", QuoteName(name), " generation ", layout->generation,
                                                 " was published meanwhile"));
  }
  events_->Publish(LayoutEvent(ModelEvent::Kind::kLayoutPublished, *current->second, *layout));
  if (listener_) listener_->OnLayoutPublished(*layout);
  if (listener_) listener_->OnLayoutsChanged(current->second);
  LogInfo(absl::StrCat("published layout ", QuoteName(layout->key), " of rank ", layout->rank, " of model ",
                       QuoteName(name), " generation ", layout->generation, ": ", layout->tensors.size(), " tensors, ",
                       layout->host_bytes, " bytes on the host",
                       layout->gpu_uuid.empty() ? "" : absl::StrCat(", ", layout->device_bytes, " on ", layout->gpu_uuid),
                       ", sealed and hashed in ",
                       absl::StrFormat("%.3f", layout->publish_seconds), " s, fingerprint ", layout->fingerprint));
  NotifyMemory();
  return std::shared_ptr<const Layout>(std::move(layout));
}

absl::Status ModelRegistry::AbortLayout(const std::string& writer_id, const std::string& reason) {
  std::shared_ptr<StagedLayout> dropped;  // freed after the lock
  absl::MutexLock lock(&mu_);
  WEIGHTD_ASSIGN_OR_RETURN(LayoutWriters::Ended ended, layout_writers_.Abort(writer_id, reason));
  dropped = FinishLayoutWriterLocked(std::move(ended), reason);
  NotifyMemory();
  return absl::OkStatus();
}

absl::StatusOr<int> ModelRegistry::DropLayout(const std::string& name, const std::string& key,
                                              std::optional<uint32_t> rank) {
  std::vector<std::shared_ptr<const Layout>> removed;  // freed after the lock
  absl::MutexLock lock(&mu_);
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<ModelGeneration> model, GetLocked(name));
  removed = model->layouts->Remove(key, rank);
  if (removed.empty()) {
    std::vector<std::string> keys;
    for (const auto& l : model->layouts->List()) keys.push_back(absl::StrCat(l->key, "@rank", l->rank));
    return absl::NotFoundError(absl::StrCat("model ", QuoteName(name), " generation ", model->generation,
                                            " has no layout ", QuoteName(key),
                                            rank.has_value() ? absl::StrCat(" of rank ", *rank) : "",
                                            "; it has: ", QuotedKeys(keys)));
  }
  for (const auto& layout : removed) {
    events_->Publish(LayoutEvent(ModelEvent::Kind::kLayoutDropped, *model, *layout));
    LogInfo(absl::StrCat("dropped layout ", QuoteName(layout->key), " of rank ", layout->rank, " of model ",
                         QuoteName(name), " generation ", model->generation, " (", layout->leases.load(),
                         " lease(s) keep it until they end)"));
  }
  if (listener_) listener_->OnLayoutsChanged(model);
  NotifyMemory();
  for (auto& layout : removed) ReleaseLater(std::move(layout));
  return static_cast<int>(removed.size());
}

absl::StatusOr<std::shared_ptr<const Layout>> ModelRegistry::FindLayoutLocked(const ModelGeneration& model,
                                                                              uint32_t rank,
                                                                              const AttachLayout& layout) const {
  WEIGHTD_RETURN_IF_ERROR(ValidateLayoutKey(layout.key));
  WEIGHTD_RETURN_IF_ERROR(ValidateLayoutIdentity(layout.identity));
  const std::string& name = model.request.name;
  std::shared_ptr<const Layout> found = model.layouts->Find(layout.key, rank);
  if (found == nullptr) {
    if (listener_) listener_->OnLayoutAttach(name, "not_found");
    return absl::NotFoundError(absl::StrCat("model ", QuoteName(name), " generation ", model.generation,
                                            " has no layout ", QuoteName(layout.key), " for rank ", rank,
                                            "; published for this generation and rank: ",
                                            QuotedKeys(model.layouts->KeysOf(rank))));
  }
  if (std::string differs = IdentityDifference(found->identity, layout.identity); !differs.empty()) {
    if (listener_) listener_->OnLayoutAttach(name, "identity_mismatch");
    return absl::FailedPreconditionError(absl::StrCat("layout ", QuoteName(layout.key), " of rank ", rank, " of model ",
                                                      QuoteName(name), " generation ", model.generation,
                                                      " was published with another identity: ", differs));
  }
  if (listener_) listener_->OnLayoutAttach(name, "hit");
  return found;
}

void ModelRegistry::AnnounceLayouts(ModelEvent::Kind kind, const ModelGeneration& model) {
  for (const auto& layout : model.layouts->List()) events_->Publish(LayoutEvent(kind, model, *layout));
}

}  // namespace weightd
