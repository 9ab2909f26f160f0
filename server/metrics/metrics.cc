#include "server/metrics/metrics.h"

#include "server/model/layout.h"

#include <optional>

#include "absl/container/flat_hash_set.h"
#include "common/format/format_error.h"

namespace weightd {
namespace {

// The reasons of failures that carry no CheckpointRule, by status code.
constexpr absl::string_view kCodeReasons[] = {"invalid_request", "already_loading", "not_found", "permission_denied",
                                                "resource_exhausted", "io", "other"};

std::string ReasonByCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument: return std::string(CheckpointRuleName(CheckpointRule::kInvalid));
    case absl::StatusCode::kAlreadyExists: return "already_loading";  // a load of the name is running
    case absl::StatusCode::kNotFound: return "not_found";
    case absl::StatusCode::kPermissionDenied: return "permission_denied";
    case absl::StatusCode::kResourceExhausted: return "resource_exhausted";
    case absl::StatusCode::kDataLoss:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kOutOfRange: return "io";
    default: return "other";
  }
}

}  // namespace

ModelsSample SampleModels(const std::vector<std::shared_ptr<ModelGeneration>>& models) {
  ModelsSample s;
  for (ModelState state : {ModelState::kLoading, ModelState::kReady, ModelState::kFailed, ModelState::kDraining}) {
    s.by_state[ModelStateName(state)] = 0;
  }
  absl::flat_hash_set<const void*> seen;  // segments shared by generations count once
  for (const auto& m : models) {
    ++s.by_state[ModelStateName(m->state.load())];
    if (m->state.load() == ModelState::kReady) s.versions[m->request.name] = {m->generation, m->version_label};
    if (m->state.load() == ModelState::kReady) s.huge_page_bytes[m->request.name] = m->huge_page_bytes;
    s.leases[m->request.name] += m->leases.load();
    for (const SegmentRecord& seg : m->segments) {
      if (seg.placement != Placement::kDevice) continue;
      const void* arena = seg.owner < m->arenas.size() ? m->arenas[seg.owner].get() : nullptr;
      if (arena == nullptr || seen.insert(arena).second) s.device_bytes[seg.gpu_uuid] += seg.size;
    }
    for (const auto& layout : m->layouts->List()) {
      ++s.layouts[m->request.name];
      s.layout_host_bytes[m->request.name] += layout->host_bytes;
      if (layout->device_bytes > 0) s.layout_device_bytes[layout->gpu_uuid] += layout->device_bytes;
    }
    for (const NumaCopy& copy : m->numa_copies) {
      for (uint32_t id : copy.host_segments) {
        const SegmentRecord& seg = m->segments[id];
        const void* host = seg.owner < m->host_segments.size() ? m->host_segments[seg.owner].get() : nullptr;
        if (host == nullptr || seen.insert(host).second) s.numa_bytes[std::to_string(copy.node)] += seg.size;
      }
    }
  }
  return s;
}

std::string CheckpointErrorReason(const absl::Status& status) {
  if (std::optional<CheckpointRule> rule = CheckpointRuleOf(status)) return std::string(CheckpointRuleName(*rule));
  if (status.code() == absl::StatusCode::kInvalidArgument && status.GetPayload(kInvalidLoadRequestPayload)) {
    return "invalid_request";
  }
  return ReasonByCode(status.code());
}

std::vector<std::string> CheckpointErrorReasons() {
  std::vector<std::string> reasons;
  for (CheckpointRule rule : AllCheckpointRules()) reasons.emplace_back(CheckpointRuleName(rule));
  for (absl::string_view reason : kCodeReasons) reasons.emplace_back(reason);
  return reasons;
}

}  // namespace weightd
