#include "common/memory/pin_plan.h"

#include <algorithm>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/base/align.h"
#include "common/base/status.h"

namespace weightd {
namespace {

// Consecutive pages no registration may split: tensors sharing a page.
struct Atom {
  uint32_t segment = 0;
  uint64_t begin = 0, end = 0;  // page-aligned
  std::vector<size_t> tensors;
};

absl::Status CheckInside(const PinTensor& t, const std::vector<uint64_t>& segment_sizes) {
  if (t.segment >= segment_sizes.size() || t.offset > segment_sizes[t.segment] ||
      t.nbytes > segment_sizes[t.segment] - t.offset) {
    return absl::InvalidArgumentError(absl::StrCat("pinned tensor ", QuoteName(t.name), " (", t.nbytes,
                                                   " bytes at offset ", t.offset, ") lies outside segment ",
                                                   t.segment));
  }
  return absl::OkStatus();
}

// Rules 1 and 2: the non-empty tensors' page ranges, merged where they overlap.
std::vector<Atom> MakeAtoms(const std::vector<PinTensor>& tensors) {
  std::vector<size_t> order;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].nbytes > 0) order.push_back(i);
  }
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(tensors[a].segment, tensors[a].offset) < std::tie(tensors[b].segment, tensors[b].offset);
  });
  std::vector<Atom> atoms;
  for (size_t i : order) {
    const PinTensor& t = tensors[i];
    uint64_t begin = AlignDown(t.offset, kPinPageBytes);
    uint64_t end = AlignUp(t.offset + t.nbytes, kPinPageBytes);
    if (!atoms.empty() && atoms.back().segment == t.segment && begin < atoms.back().end) {
      atoms.back().end = std::max(atoms.back().end, end);
    } else {
      atoms.push_back({t.segment, begin, end, {}});
    }
    atoms.back().tensors.push_back(i);
  }
  return atoms;
}

}  // namespace

absl::StatusOr<PinPlan> PlanPinChunks(const std::vector<PinTensor>& tensors,
                                      const std::vector<uint64_t>& segment_sizes, uint64_t chunk_bytes) {
  if (chunk_bytes < kPinPageBytes || chunk_bytes > kMaxPinChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("pin chunk size ", chunk_bytes, " is outside [", kPinPageBytes,
                                                   ", ", kMaxPinChunkBytes, "] bytes"));
  }
  const uint64_t bound = AlignDown(chunk_bytes, kPinPageBytes);
  for (const PinTensor& t : tensors) WEIGHTD_RETURN_IF_ERROR(CheckInside(t, segment_sizes));
  PinPlan plan;
  plan.chunk_of.assign(tensors.size(), -1);
  // Rule 3: pack contiguous atoms up to the bound.
  for (Atom& atom : MakeAtoms(tensors)) {
    PinChunk* last = plan.chunks.empty() ? nullptr : &plan.chunks.back();
    bool joins = last != nullptr && last->segment == atom.segment && last->offset + last->bytes == atom.begin &&
                 atom.end - last->offset <= bound;
    if (!joins) {
      plan.chunks.push_back({atom.segment, atom.begin, 0, {}});
      last = &plan.chunks.back();
    }
    last->bytes = atom.end - last->offset;
    plan.bytes += atom.end - atom.begin;
    for (size_t i : atom.tensors) {
      last->tensors.push_back(i);
      plan.chunk_of[i] = static_cast<int64_t>(plan.chunks.size() - 1);
    }
  }
  return plan;
}

std::string DescribePinChunk(const PinPlan& plan, size_t c, const std::vector<PinTensor>& tensors) {
  const PinChunk& chunk = plan.chunks[c];
  std::string out = absl::StrCat("segment ", chunk.segment, " bytes [", chunk.offset, ", ", chunk.offset + chunk.bytes,
                                 ")");
  if (chunk.tensors.empty()) return out;
  absl::StrAppend(&out, " holding ", QuoteName(tensors[chunk.tensors.front()].name));
  if (chunk.tensors.size() > 1) absl::StrAppend(&out, " and ", chunk.tensors.size() - 1, " more");
  return out;
}

}  // namespace weightd
