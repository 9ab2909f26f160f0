// Which pages of a model's host mappings a GPU client registers with CUDA
// (cuMemHostRegister) to read the host tensors it asked to pin from GPU
// kernels: the plan of registrations, computed before any driver call.
//
// The rule (docs/api.md, "Pinned host tables"):
//   1. Each pinned tensor covers the pages [AlignDown(offset), AlignUp(offset
//      + nbytes)) of its segment's mapping; zero-byte tensors cover none.
//   2. Tensors whose page ranges overlap (they share a page) are one atom:
//      registrations cannot overlap (cuMemHostRegister fails with
//      CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED), so a shared page decides
//      which registration holds both.
//   3. Atoms are packed in offset order into chunks: an atom joins the
//      current chunk when it starts where the chunk ends (same segment, no
//      gap) and the chunk stays within `chunk_bytes`; else it starts a new
//      chunk. Pages no pinned tensor covers are never registered. An atom
//      larger than `chunk_bytes` is one chunk of its own.
// So every tensor lies inside exactly one chunk, and its device pointer is
// that chunk's device base plus its distance from the chunk's first byte.
// Pages are 4 KiB: cuMemHostRegister wanted page-aligned pointers and sizes
// up to CUDA 4.0 and registers whole pages since; huge-page segments are
// registered at the same 4 KiB granularity.
//
// Pure computation; thread-compatible.
#ifndef WEIGHTD_COMMON_MEMORY_PIN_PLAN_H_
#define WEIGHTD_COMMON_MEMORY_PIN_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace weightd {

inline constexpr uint64_t kPinPageBytes = 4096;
// The default bound of one registration: a detach waits for at most one
// registration in flight (about 0.1 s per GB, docs/api.md), and progress
// moves in steps of this size.
inline constexpr uint64_t kDefaultPinChunkBytes = uint64_t{1} << 30;
// The largest bound accepted (the design: "in chunks of at most 64 GiB").
inline constexpr uint64_t kMaxPinChunkBytes = uint64_t{64} << 30;

// A host tensor to pin: its bytes in a segment's mapping.
struct PinTensor {
  std::string name;  // for messages
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
};

// One registration: bytes [offset, offset + bytes) of a segment's mapping,
// both multiples of kPinPageBytes.
struct PinChunk {
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  std::vector<size_t> tensors;  // indices into the planned tensors, by offset
};

struct PinPlan {
  std::vector<PinChunk> chunks;   // by segment, then offset; disjoint
  std::vector<int64_t> chunk_of;  // per planned tensor: its chunk, or -1 (zero bytes)
  uint64_t bytes = 0;             // the sum of chunk bytes
};

// The plan for `tensors` in segments of `segment_sizes` bytes. `chunk_bytes`
// is rounded down to a multiple of kPinPageBytes. INVALID_ARGUMENT when
// chunk_bytes is below kPinPageBytes or above kMaxPinChunkBytes, or a tensor
// lies outside its segment (naming it).
absl::StatusOr<PinPlan> PlanPinChunks(const std::vector<PinTensor>& tensors,
                                      const std::vector<uint64_t>& segment_sizes, uint64_t chunk_bytes);

// "segment 2 bytes [0, 1048576) holding 'a.weight' and 3 more": chunk `c`
// of `plan` for messages.
std::string DescribePinChunk(const PinPlan& plan, size_t c, const std::vector<PinTensor>& tensors);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_MEMORY_PIN_PLAN_H_
