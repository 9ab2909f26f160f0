#include "common/memory/segment_backend.h"

#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

struct Named {
  SegmentBackend backend;
  absl::string_view name;
};
constexpr Named kNames[] = {
    {SegmentBackend::kMemfd, "memfd"},
    {SegmentBackend::kCudaVmm, "cuda-vmm"},
    {SegmentBackend::kCudaLegacyIpc, "cuda-legacy-ipc"},
    {SegmentBackend::kEmulated, "emulated"},
};

}  // namespace

absl::string_view SegmentBackendName(SegmentBackend backend) {
  for (const Named& n : kNames) {
    if (n.backend == backend) return n.name;
  }
  return "unknown";
}

absl::StatusOr<SegmentBackend> ParseSegmentBackend(absl::string_view name) {
  for (const Named& n : kNames) {
    if (n.name == name) return n.backend;
  }
  if (name == "cuda") return SegmentBackend::kCudaVmm;
  return absl::InvalidArgumentError(absl::StrCat("unknown segment backend '", name, "'"));
}

bool ExportsFd(SegmentBackend backend) { return backend != SegmentBackend::kCudaLegacyIpc; }

}  // namespace weightd
