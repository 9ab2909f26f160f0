#include "client/pin.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/memory/host_registrar.h"

namespace weightd {

absl::Status CheckPinOptions(const AttachOptions& options) {
  if (options.pin.patterns.empty()) return absl::OkStatus();
  if (options.copy_on_write) {
    return absl::InvalidArgumentError(
        "pin cannot be combined with copy_on_write: a page written after registration would be copied for this "
        "process while the GPU kept reading the shared one");
  }
  if (options.pin.chunk_bytes < kPinPageBytes || options.pin.chunk_bytes > kMaxPinChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("pin chunk_bytes ", options.pin.chunk_bytes, " is outside [",
                                                   kPinPageBytes, ", ", kMaxPinChunkBytes, "]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<size_t>> SelectPinnedTensors(const Manifest& manifest, const PinOptions& pin) {
  std::vector<size_t> selected;
  if (pin.patterns.empty()) return selected;
  std::vector<size_t> host_matches(pin.patterns.size()), device_matches(pin.patterns.size());
  for (size_t i = 0; i < manifest.tensors.size(); ++i) {
    const TensorInfo& t = manifest.tensors[i];
    bool host = t.location == Location::kHost, any = false;
    for (size_t p = 0; p < pin.patterns.size(); ++p) {
      if (!absl::StrContains(t.name, pin.patterns[p])) continue;
      any = true;
      ++(host ? host_matches : device_matches)[p];
    }
    if (any && host) selected.push_back(i);
  }
  for (size_t p = 0; p < pin.patterns.size(); ++p) {
    if (host_matches[p] > 0) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "pin pattern ", QuoteName(pin.patterns[p]), " matches no host tensor of model ", QuoteName(manifest.model),
        " rank ", manifest.rank, " (it matches ", device_matches[p], " device-placed tensors; only host tensors are pinned)"));
  }
  return selected;
}

absl::StatusOr<std::unique_ptr<HostPinner>> StartPinning(const Manifest& manifest, const std::vector<size_t>& selected,
                                                         const std::vector<const char*>& bases, uint64_t chunk_bytes,
                                                         int ordinal) {
  PinInput input;
  input.chunk_bytes = chunk_bytes;
  for (size_t s = 0; s < manifest.segments.size(); ++s) {
    bool host = manifest.segments[s].location == Location::kHost;
    input.segment_bases.push_back(host && s < bases.size() ? bases[s] : nullptr);
    input.segment_sizes.push_back(manifest.segments[s].size);
  }
  for (size_t i : selected) {
    const TensorInfo& t = manifest.tensors[i];
    input.tensors.push_back({t.name, t.segment, t.offset, t.nbytes});
  }
  return HostPinner::Start(std::move(input), [ordinal] { return MakeCudaHostRegistrar(ordinal); });
}

PinStatus ToPinStatus(const PinProgress& p) {
  PinStatus s;
  s.state = PinStateName(p.state);
  s.bytes_done = p.bytes_done;
  s.bytes_total = p.bytes_total;
  s.chunks_done = p.chunks_done;
  s.chunks_total = p.chunks_total;
  s.tensors = p.tensors;
  s.read_only = p.read_only;
  s.device_ordinal = p.device_ordinal;
  s.register_seconds = p.register_seconds;
  s.seconds = p.seconds;
  s.error = p.error;
  return s;
}

}  // namespace weightd
