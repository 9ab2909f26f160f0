#include "server/load/plan.h"

#include <algorithm>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "common/format/format_error.h"
#include "common/base/align.h"
#include "common/format/shape.h"

namespace weightd {
namespace {


bool MatchesAny(const std::string& name, const std::vector<std::string>& patterns) {
  for (const std::string& p : patterns) {
    if (absl::StrContains(name, p)) return true;
  }
  return false;
}

const TpRule* RuleFor(const std::string& name, const std::vector<TpRule>& rules) {
  for (const TpRule& r : rules) {
    if (absl::StrContains(name, r.pattern)) return &r;
  }
  return nullptr;
}

absl::Status PlanSplit(const CatalogTensor& t, const TpRule& rule, uint32_t tp_size, TensorPlan& plan) {
  std::string where = absl::StrCat("tensor ", QuoteName(t.name), " of shape ", ShapeString(t.shape), ", TP rule ",
                                   QuoteName(absl::StrCat(rule.pattern, ":", rule.dim)), " with tp_size ", tp_size);
  if (rule.dim >= t.shape.size()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": dim ", rule.dim, " is out of range for rank ", t.shape.size()));
  }
  if (t.shape[rule.dim] % tp_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": dim ", rule.dim, " of size ", t.shape[rule.dim], " is not divisible by ", tp_size));
  }
  uint64_t inner = 1;
  for (size_t d = rule.dim + 1; d < t.shape.size(); ++d) inner *= t.shape[d];
  uint64_t bits = inner * static_cast<uint64_t>(DTypeBits(t.dtype));
  if (bits % 8 != 0) {
    return CheckpointError(CheckpointRule::kSubByteSize, absl::StrCat(where, ": a slice row of ", inner, " x ",
                                                                      DTypeName(t.dtype), " is not a whole number of bytes"));
  }
  plan.split_dim = static_cast<int32_t>(rule.dim);
  plan.slice_elements = t.shape[rule.dim] / tp_size;
  plan.row_bytes = bits / 8;
  for (uint32_t d = 0; d < rule.dim; ++d) plan.outer *= t.shape[d];
  return absl::OkStatus();
}

// Places `nbytes` of `file` in the rank's current arena, opening a new one
// when full or when the arena holds another file's tensors.
RankSlot Pack(RankPlan& rank, uint32_t file, uint64_t nbytes, uint64_t max_arena_bytes) {
  if (rank.arena_bytes.empty() || rank.arena_file.back() != file ||
      (rank.arena_bytes.back() > 0 && AlignUp(rank.arena_bytes.back(), kDeviceAlignment) + nbytes > max_arena_bytes)) {
    rank.arena_bytes.push_back(0);
    rank.arena_file.push_back(file);
  }
  uint64_t offset = AlignUp(rank.arena_bytes.back(), kDeviceAlignment);
  rank.arena_bytes.back() = offset + nbytes;
  return {static_cast<uint32_t>(rank.arena_bytes.size() - 1), offset};
}

}  // namespace

uint64_t HostChunkBytes(uint64_t file_host_bytes) {
  return std::max(kMinHostChunkBytes, (file_host_bytes + kHostChunksPerFile - 1) / kHostChunksPerFile);
}

uint64_t LoadPlan::device_bytes_per_rank(uint32_t rank) const {
  uint64_t total = 0;
  for (uint64_t b : ranks[rank].arena_bytes) total += b;
  return total;
}

absl::StatusOr<LoadPlan> MakeLoadPlan(const Catalog& catalog, const LoadRequest& request, size_t device_count,
                                      uint64_t max_arena_bytes) {
  uint32_t tp_size = std::max<uint32_t>(request.tp_size, 1);
  if (device_count == 0 && tp_size > 1) {
    return absl::InvalidArgumentError(absl::StrCat("tp_size ", tp_size, " needs one device per rank (--devices)"));
  }
  if (device_count != 0 && device_count != tp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("the plan has tp_size ", tp_size, " but ", device_count, " device(s); give one device per rank"));
  }
  if (device_count == 0 && !request.tp_rules.empty()) {
    return absl::InvalidArgumentError("TP rules need devices: with no --devices every tensor is on the host");
  }
  LoadPlan plan;
  plan.tensors.resize(catalog.tensors.size());
  plan.ranks.resize(tp_size);
  auto on_host = [&](const CatalogTensor& t) {
    return device_count == 0 || MatchesAny(t.name, request.host_resident_patterns);
  };
  std::vector<uint64_t> file_host_bytes(catalog.files.size());
  for (const CatalogTensor& t : catalog.tensors) {
    if (on_host(t)) file_host_bytes[t.file] += AlignUp(t.nbytes, kHostAlignment);
  }
  for (size_t i = 0; i < catalog.tensors.size(); ++i) {
    const CatalogTensor& t = catalog.tensors[i];
    TensorPlan& tp = plan.tensors[i];
    TensorRecord base{t.name, t.dtype, t.shape, Placement::kHost, 0, 0, t.nbytes, t.shape, -1, 0, 0};
    if (on_host(t)) {
      // The file's current chunk, or a new one when the file changes or the chunk is full.
      std::vector<HostChunk>& chunks = plan.host_segments;
      uint64_t limit = HostChunkBytes(file_host_bytes[t.file]);
      if (chunks.empty() || chunks.back().file != t.file ||
          (chunks.back().bytes > 0 && AlignUp(chunks.back().bytes, kHostAlignment) + t.nbytes > limit)) {
        chunks.push_back({t.file, 0});
      }
      tp.placement = Placement::kHost;
      tp.host_segment = static_cast<uint32_t>(chunks.size() - 1);
      tp.host_offset = AlignUp(chunks.back().bytes, kHostAlignment);
      chunks.back().bytes = tp.host_offset + t.nbytes;
      base.segment = tp.host_segment;
      base.offset = tp.host_offset;
      for (RankPlan& rank : plan.ranks) rank.tensors.push_back(base);
      continue;
    }
    tp.placement = Placement::kDevice;
    if (const TpRule* rule = RuleFor(t.name, request.tp_rules)) WEIGHTD_RETURN_IF_ERROR(PlanSplit(t, *rule, tp_size, tp));
    uint64_t rank_bytes = tp.split_dim < 0 ? t.nbytes : t.nbytes / tp_size;
    for (uint32_t r = 0; r < tp_size; ++r) {
      RankSlot slot = Pack(plan.ranks[r], t.file, rank_bytes, max_arena_bytes);
      tp.ranks.push_back(slot);
      TensorRecord rec = base;
      rec.placement = Placement::kDevice;
      rec.segment = slot.arena;  // offset by the host segment count below
      rec.offset = slot.offset;
      rec.nbytes = rank_bytes;
      if (tp.split_dim >= 0) {
        rec.shape[tp.split_dim] = tp.slice_elements;
        rec.split_dim = tp.split_dim;
        rec.split_start = r * tp.slice_elements;
      }
      plan.ranks[r].tensors.push_back(std::move(rec));
    }
  }
  uint32_t host_count = static_cast<uint32_t>(plan.host_segments.size());
  for (const HostChunk& c : plan.host_segments) plan.host_bytes += c.bytes;
  for (RankPlan& rank : plan.ranks) {
    for (TensorRecord& rec : rank.tensors) {
      if (rec.placement == Placement::kDevice) rec.segment += host_count;
    }
  }
  return plan;
}

absl::Status SelectTensors(const LoadRequest& request, Catalog& catalog) {
  if (request.include_patterns.empty() && request.exclude_patterns.empty()) return absl::OkStatus();
  size_t before = catalog.tensors.size();
  std::erase_if(catalog.tensors, [&](const CatalogTensor& t) { return !request.Selects(t.name); });
  if (catalog.tensors.empty()) {
    auto quoted = [](const std::vector<std::string>& patterns) {
      std::vector<std::string> out;
      for (const std::string& p : patterns) out.push_back(QuoteName(p));
      return out.empty() ? std::string("none") : absl::StrJoin(out, ", ");
    };
    absl::Status none = absl::InvalidArgumentError(
        absl::StrCat("the subset selects none of the ", before, " tensors of ", catalog.root, " (include ",
                     quoted(request.include_patterns), "; exclude ", quoted(request.exclude_patterns), ")"));
    none.SetPayload(kInvalidLoadRequestPayload, absl::Cord("1"));
    return none;
  }
  catalog.Finish();
  return absl::OkStatus();
}

}  // namespace weightd
