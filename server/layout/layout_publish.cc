#include "server/layout/layout_publish.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/base/align.h"
#include "common/base/parallel.h"
#include "common/base/status.h"
#include "common/format/content_hash.h"

namespace weightd {
namespace {

bool IsKeyChar(char c) {
  return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == ':' || c == '/' || c == '+' || c == '=' || c == '-';
}
bool IsIdentityKeyChar(char c) { return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == '-'; }
bool IsHashHex(const std::string& s) {
  return s.size() == 16 && std::all_of(s.begin(), s.end(), [](char c) { return absl::ascii_isxdigit(c); });
}

absl::Status CheckTensorNames(const std::vector<LayoutTensorSpec>& tensors) {
  absl::flat_hash_set<std::string> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const std::string& name = tensors[i].name;
    if (name.empty()) return absl::InvalidArgumentError(absl::StrCat("layout tensor ", i, " has an empty name"));
    if (name.size() > kMaxLayoutTensorNameBytes) {
      return absl::InvalidArgumentError(absl::StrCat("layout tensor ", i, " has a name of ", name.size(),
                                                     " bytes; at most ", kMaxLayoutTensorNameBytes));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("layout tensor ", QuoteName(name), " appears twice"));
    }
  }
  return absl::OkStatus();
}

// Places `tensors` (their sizes in `bytes`) of placement `holds` one after
// another at kLayoutTensorAlignment; returns the segment's size (at least
// one alignment unit, so that no segment is empty).
uint64_t PlaceTensors(const std::vector<LayoutTensorSpec>& specs, const std::vector<uint64_t>& bytes, Placement holds,
                      uint32_t segment, std::vector<LayoutTensor>& out) {
  uint64_t at = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].placement != holds) continue;
    TensorRecord& r = out[i].record;
    r.segment = segment;
    r.offset = at;
    at = AlignUp(at + bytes[i], kLayoutTensorAlignment);
  }
  return std::max(at, kLayoutTensorAlignment);
}

absl::Status CheckExpectedHashes(const StagedLayout& staged, const std::map<std::string, std::string>& expected) {
  absl::flat_hash_set<std::string> names;
  for (const LayoutTensor& t : staged.tensors) names.insert(t.record.name);
  for (const auto& [name, hash] : expected) {
    if (!names.contains(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("an expected hash names tensor ", QuoteName(name), ", which is not in this layout"));
    }
    if (!IsHashHex(hash)) {
      return absl::InvalidArgumentError(absl::StrCat("the expected hash of tensor ", QuoteName(name),
                                                     " must be 16 hex digits, got ", QuoteName(hash.substr(0, 32))));
    }
  }
  return absl::OkStatus();
}

// Every byte of sealed staged segment `index` that no tensor covers, up to
// the end of its last page (which every mapping of that page shows), is
// still zero; FAILED_PRECONDITION naming the first that is not.
absl::Status CheckUncoveredBytes(const StagedLayout& staged, uint32_t index) {
  const HostSegment& memory = *staged.segments[index].memory;
  std::vector<std::pair<uint64_t, uint64_t>> covered;
  for (const LayoutTensor& t : staged.tensors) {
    if (t.record.segment == index) covered.emplace_back(t.record.offset, t.record.offset + t.record.nbytes);
  }
  std::sort(covered.begin(), covered.end());
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t end = AlignUp(memory.size(), page);
  auto check = [&](uint64_t begin, uint64_t stop) -> absl::Status {
    for (uint64_t at = begin; at < stop; ++at) {
      if (memory.data()[at] != 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "staged layout segment ", index, ": byte ", at, " lies outside every tensor and is not zero (",
            at >= memory.size() ? "the tail of the last page" : "padding between tensors",
            "); a writer may write its tensors' bytes only"));
      }
    }
    return absl::OkStatus();
  };
  uint64_t at = 0;
  for (const auto& [begin, stop] : covered) {
    WEIGHTD_RETURN_IF_ERROR(check(at, std::min(begin, end)));
    at = std::max(at, stop);
  }
  return check(std::min(at, end), end);
}

// A fresh, sealed arena on the staging's GPU holding the sealed device
// staging memfd's bytes.
absl::StatusOr<std::shared_ptr<DeviceArena>> UploadDeviceStaging(const StagedLayout& staged, const HostSegment& from) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<DeviceArena> arena, staged.backend->Allocate(staged.device, from.size()));
  constexpr uint64_t kChunk = 256ull << 20;
  for (uint64_t at = 0; at < from.size(); at += kChunk) {
    WEIGHTD_RETURN_IF_ERROR(arena->CopyFromHost(at, 0, from.data() + at, 0, std::min(kChunk, from.size() - at), 1));
  }
  WEIGHTD_ASSIGN_OR_RETURN(uint64_t fence, arena->RecordFence());
  WEIGHTD_RETURN_IF_ERROR(arena->WaitFence(fence));
  WEIGHTD_RETURN_IF_ERROR(arena->Seal());
  return std::shared_ptr<DeviceArena>(std::move(arena));
}

// Steps 3-5 of SealLayout, on sealed segments.
absl::StatusOr<std::shared_ptr<Layout>> BuildLayout(const StagedLayout& staged,
                                                    const std::map<std::string, std::string>& expected) {
  for (uint32_t i = 0; i < staged.segments.size(); ++i) WEIGHTD_RETURN_IF_ERROR(CheckUncoveredBytes(staged, i));
  auto layout = std::make_shared<Layout>();
  layout->tensors = staged.tensors;
  WEIGHTD_RETURN_IF_ERROR(ParallelFor(layout->tensors.size(), [&](size_t k) -> absl::Status {
    TensorRecord& r = layout->tensors[k].record;
    r.content_hash = TensorContentHash(staged.segments[r.segment].memory->data() + r.offset, r.nbytes);
    return absl::OkStatus();
  }));
  for (const LayoutTensor& t : layout->tensors) {
    auto it = expected.find(t.record.name);
    if (it != expected.end() && absl::AsciiStrToLower(it->second) != ContentHashHex(t.record.content_hash)) {
      return absl::FailedPreconditionError(absl::StrCat("layout tensor ", QuoteName(t.record.name), " has content hash ",
                                                        ContentHashHex(t.record.content_hash), " but the writer expected ",
                                                        absl::AsciiStrToLower(it->second)));
    }
  }
  for (const StagedLayoutSegment& s : staged.segments) {
    SegmentRecord record;
    record.placement = s.holds;
    if (s.holds == Placement::kHost) {
      record.size = s.memory->size();
      record.fd = s.memory->fd();
      record.owner = static_cast<uint32_t>(layout->host_segments.size());
      layout->host_segments.push_back(s.memory);
      layout->host_bytes += record.size;
    } else {
      absl::StatusOr<std::shared_ptr<DeviceArena>> arena = UploadDeviceStaging(staged, *s.memory);
      if (!arena.ok()) return Annotate(arena.status(), absl::StrCat("copying the device tensors to ", staged.device.uuid));
      record.size = (*arena)->size();
      record.backend = staged.backend->segment_backend();
      record.gpu_uuid = staged.device.uuid;
      record.fd = (*arena)->export_fd();
      record.handle = (*arena)->export_handle();
      record.owner = static_cast<uint32_t>(layout->arenas.size());
      layout->arenas.push_back(std::move(*arena));
      layout->device_bytes += record.size;
      layout->gpu_uuid = staged.device.uuid;
    }
    layout->segments.push_back(std::move(record));
  }
  layout->fingerprint = LayoutFingerprint(layout->tensors);
  return layout;
}

}  // namespace

absl::Status ValidateLayoutKey(const std::string& key) {
  if (key.empty() || key.size() > kMaxLayoutKeyBytes || !std::all_of(key.begin(), key.end(), IsKeyChar)) {
    return absl::InvalidArgumentError(absl::StrCat("layout key ", QuoteName(key), " must be 1..", kMaxLayoutKeyBytes,
                                                   " bytes of [A-Za-z0-9._:/+=-]"));
  }
  return absl::OkStatus();
}

absl::Status ValidateLayoutIdentity(const LayoutIdentity& identity) {
  if (identity.size() > kMaxIdentityEntries) {
    return absl::InvalidArgumentError(
        absl::StrCat("the layout identity has ", identity.size(), " fields; at most ", kMaxIdentityEntries));
  }
  for (const auto& [k, v] : identity) {
    if (k.empty() || k.size() > kMaxIdentityKeyBytes || !std::all_of(k.begin(), k.end(), IsIdentityKeyChar)) {
      return absl::InvalidArgumentError(absl::StrCat("layout identity field ", QuoteName(k), " must be 1..",
                                                     kMaxIdentityKeyBytes, " bytes of [A-Za-z0-9._-]"));
    }
    if (v.size() > kMaxIdentityValueBytes ||
        !std::all_of(v.begin(), v.end(), [](char c) { return c >= 0x20 && c < 0x7f; })) {
      return absl::InvalidArgumentError(absl::StrCat("layout identity field ", QuoteName(k), " must have a value of at most ",
                                                     kMaxIdentityValueBytes, " bytes of printable ASCII"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> LayoutTensorBytes(const LayoutTensorSpec& spec) {
  auto refuse = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("layout tensor ", QuoteName(spec.name), ": ", why));
  };
  if (spec.shape.size() > kMaxLayoutDims) return refuse(absl::StrCat(spec.shape.size(), " dims; at most ", kMaxLayoutDims));
  const int bits = DTypeBits(spec.dtype);
  const uint64_t too_big = kMaxLayoutBytes * 8;  // in bits, far below 2^64
  uint64_t elements = 1;
  bool empty = false;
  for (uint64_t d : spec.shape) {
    if (d == 0) empty = true;
    if (d != 0 && elements > too_big / d) return refuse(absl::StrCat("more than ", kMaxLayoutBytes, " bytes"));
    elements *= d == 0 ? 1 : d;
  }
  if (empty) return 0;
  if (!spec.strides.empty()) {
    if (spec.strides.size() != spec.shape.size()) {
      return refuse(absl::StrCat(spec.strides.size(), " strides for ", spec.shape.size(), " dims"));
    }
    if (bits % 8 != 0) return refuse(absl::StrCat("strides on packed dtype ", DTypeName(spec.dtype), " (", bits, " bits)"));
    uint64_t last = 0;  // the highest element index the strides reach
    for (size_t i = 0; i < spec.shape.size(); ++i) {
      uint64_t reach = spec.shape[i] - 1;
      if (reach != 0 && spec.strides[i] > too_big / reach) return refuse(absl::StrCat("more than ", kMaxLayoutBytes, " bytes"));
      last += reach * spec.strides[i];
      if (last > too_big) return refuse(absl::StrCat("more than ", kMaxLayoutBytes, " bytes"));
    }
    elements = last + 1;
  }
  if (elements > too_big / static_cast<uint64_t>(bits)) return refuse(absl::StrCat("more than ", kMaxLayoutBytes, " bytes"));
  uint64_t total_bits = elements * static_cast<uint64_t>(bits);
  if (total_bits % 8 != 0) {
    return refuse(absl::StrCat(elements, " elements of ", DTypeName(spec.dtype), " (", bits,
                               " bits) do not fill whole bytes (safetensors packs sub-byte dtypes)"));
  }
  if (total_bits / 8 > kMaxLayoutBytes) return refuse(absl::StrCat("more than ", kMaxLayoutBytes, " bytes"));
  return total_bits / 8;
}

absl::Status ValidateLayoutRequest(const LayoutRequest& request) {
  WEIGHTD_RETURN_IF_ERROR(ValidateLayoutKey(request.key));
  WEIGHTD_RETURN_IF_ERROR(ValidateLayoutIdentity(request.identity));
  if (request.tensors.empty() || request.tensors.size() > kMaxLayoutTensors) {
    return absl::InvalidArgumentError(
        absl::StrCat("a layout holds 1..", kMaxLayoutTensors, " tensors; this one declares ", request.tensors.size()));
  }
  if (!(request.wait_seconds >= 0 && request.wait_seconds <= kMaxLayoutWaitSeconds)) {
    return absl::InvalidArgumentError(absl::StrCat("wait_seconds must be within [0, ", kMaxLayoutWaitSeconds, "]"));
  }
  WEIGHTD_RETURN_IF_ERROR(CheckTensorNames(request.tensors));
  uint64_t total = 0;
  for (const LayoutTensorSpec& spec : request.tensors) {
    if (spec.placement != Placement::kHost && spec.placement != Placement::kDevice) {
      return absl::InvalidArgumentError(absl::StrCat("layout tensor ", QuoteName(spec.name), " has no placement"));
    }
    WEIGHTD_ASSIGN_OR_RETURN(uint64_t bytes, LayoutTensorBytes(spec));
    total += AlignUp(bytes, kLayoutTensorAlignment);
    if (total > kMaxLayoutBytes) {
      return absl::InvalidArgumentError(absl::StrCat("the layout's tensors exceed ", kMaxLayoutBytes, " bytes"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StagedLayout>> StageLayout(LayoutRequest request, uint64_t generation,
                                                          const DeviceInfo& device, DeviceBackend* backend,
                                                          HostMemoryAdmission* admission) {
  auto staged = std::make_unique<StagedLayout>();
  staged->generation = generation;
  staged->device = device;
  staged->backend = backend;
  std::vector<uint64_t> bytes;
  bool any[2] = {false, false};  // host, device
  for (const LayoutTensorSpec& spec : request.tensors) {
    WEIGHTD_ASSIGN_OR_RETURN(uint64_t n, LayoutTensorBytes(spec));
    bytes.push_back(n);
    any[spec.placement == Placement::kDevice] = true;
    LayoutTensor t;
    t.record.name = spec.name;
    t.record.dtype = spec.dtype;
    t.record.shape = spec.shape;
    t.record.placement = spec.placement;
    t.record.nbytes = n;
    t.strides = spec.strides;
    staged->tensors.push_back(std::move(t));
  }
  if (any[1] && backend == nullptr) {
    return absl::FailedPreconditionError("the layout has device tensors but the daemon has no device backend");
  }
  std::vector<std::pair<Placement, uint64_t>> sizes;  // per staged segment, host first
  for (Placement holds : {Placement::kHost, Placement::kDevice}) {
    if (!any[holds == Placement::kDevice]) continue;
    uint32_t segment = static_cast<uint32_t>(sizes.size());
    sizes.emplace_back(holds, PlaceTensors(request.tensors, bytes, holds, segment, staged->tensors));
  }
  for (const auto& [holds, size] : sizes) {
    staged->bytes_staged += size;
    if (holds == Placement::kDevice) staged->device_bytes += size;
  }
  if (admission != nullptr) {
    WEIGHTD_ASSIGN_OR_RETURN(staged->reservation, admission->Reserve(request.model, staged->bytes_staged));
  }
  for (const auto& [holds, size] : sizes) {
    WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<HostSegment> memory,
                             HostSegment::Create(holds == Placement::kHost ? "layout-host" : "layout-device-staging", size));
    WEIGHTD_RETURN_IF_ERROR(memory->SealSize());
    staged->segments.push_back({std::shared_ptr<HostSegment>(std::move(memory)), holds});
  }
  request.tensors.clear();
  staged->request = std::move(request);
  return staged;
}

LayoutCommitAttempt SealLayout(StagedLayout& staged, const std::map<std::string, std::string>& expected_hashes,
                               bool mlock) {
  LayoutCommitAttempt attempt;
  auto started = std::chrono::steady_clock::now();
  if (absl::Status checked = CheckExpectedHashes(staged, expected_hashes); !checked.ok()) {
    attempt.layout = checked;
    return attempt;
  }
  for (size_t i = 0; i < staged.segments.size(); ++i) {
    HostSegment& memory = *staged.segments[i].memory;
    if (memory.sealed()) continue;
    absl::Status sealed = memory.Seal(mlock && staged.segments[i].holds == Placement::kHost);
    if (!sealed.ok()) {
      attempt.layout = Annotate(sealed, absl::StrCat("sealing staged layout segment ", i));
      return attempt;
    }
  }
  attempt.sealed = true;
  absl::StatusOr<std::shared_ptr<Layout>> layout = BuildLayout(staged, expected_hashes);
  if (layout.ok()) {
    Layout& l = **layout;
    l.model = staged.request.model;
    l.generation = staged.generation;
    l.key = staged.request.key;
    l.rank = staged.request.rank;
    l.identity = staged.request.identity;
    l.publish_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  }
  attempt.layout = std::move(layout);
  return attempt;
}

void DiscardStagedLayout(StagedLayout& staged) {
  for (StagedLayoutSegment& s : staged.segments) s.memory->Discard();
}

}  // namespace weightd
