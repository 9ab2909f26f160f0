// Placement and tensor-parallel (TP) plan: which tensors live on the host
// (one shared copy) and which on each rank's device, split or replicated, and
// where every byte goes. Pure functions of the catalog and the request, so a
// bad plan is refused before any byte is read or any memory allocated.
//
// Rules (issue "Device shards"):
//  - a tensor whose name contains a host-resident pattern is placed on the
//    host; with no devices every tensor is on the host;
//  - otherwise it is placed on every rank's device; if its name contains the
//    pattern of a TP rule (first match wins) it is split evenly along the
//    rule's dim and rank r holds slice r, else it is replicated;
//  - a rule's dim must be < the tensor's rank, the dim divisible by tp_size,
//    and for sub-byte dtypes (F4, F6) a slice row must be whole bytes;
//  - host tensors are packed at 64-byte alignment into host segments (one
//    memfd each): every checkpoint file's host tensors, in file order, into
//    chunks of at most HostChunkBytes(file) (a larger tensor gets its own);
//    each rank's device tensors at 256-byte alignment (cudaMalloc's
//    guarantee) into arenas of at most max_arena_bytes, again never mixing
//    two files (a larger tensor gets its own).
//
// Why segments follow files and bounded chunks (issue "Generations from a
// writer"): a segment is the unit that generations share by reference. A
// reload that finds one file of a sharded checkpoint changed re-reads just
// that file's segments and shares the rest; a writer that updates a few
// tensors copies just the chunks holding them. Chunk size is a function of
// the file alone, max(64 MiB, file's host bytes / 16), so one file's layout
// never depends on another's and a model gets at most ~16 segments per file:
// few enough that Attach stays a handful of fds and mmaps, small enough that
// an update of a tenth of the tensors copies little more than a tenth.
#ifndef WEIGHTD_SERVER_LOAD_PLAN_H_
#define WEIGHTD_SERVER_LOAD_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/format/catalog.h"
#include "server/model/model.h"

namespace weightd {

inline constexpr uint64_t kHostAlignment = 64;
inline constexpr uint64_t kDeviceAlignment = 256;
inline constexpr uint64_t kDefaultMaxArenaBytes = 2ull << 30;

// Where one rank's copy of a device tensor goes.
struct RankSlot {
  uint32_t arena = 0;   // index into RankPlan::arena_bytes
  uint64_t offset = 0;  // byte offset within the arena
};

// How one checkpoint tensor is placed.
struct TensorPlan {
  Placement placement = Placement::kHost;
  uint32_t host_segment = 0;    // host tensors: index into LoadPlan::host_segments
  uint64_t host_offset = 0;     // host tensors: byte offset within that segment
  int32_t split_dim = -1;       // device tensors: -1 = replicated
  uint64_t slice_elements = 0;  // split tensors: shape[split_dim] / tp_size
  uint64_t row_bytes = 0;       // split tensors: bytes of one index of split_dim's inner block
  uint64_t outer = 1;           // split tensors: product of dims before split_dim
  std::vector<RankSlot> ranks;  // device tensors: one per rank
};

struct RankPlan {
  std::vector<uint64_t> arena_bytes;
  std::vector<uint32_t> arena_file;   // parallel to arena_bytes: the catalog file whose tensors it holds
  // The rank's manifest, parallel to catalog.tensors. TensorRecord::segment
  // indexes the rank's segments: the host segments first (in
  // LoadPlan::host_segments order), then this rank's arenas.
  std::vector<TensorRecord> tensors;
};

// One host segment: tensors of one catalog file.
struct HostChunk {
  uint32_t file = 0;   // index into catalog.files
  uint64_t bytes = 0;  // end of its last tensor
};

inline constexpr uint64_t kMinHostChunkBytes = 64ull << 20;
inline constexpr uint64_t kHostChunksPerFile = 16;
// The chunk bound for a file with `file_host_bytes` of host tensors.
uint64_t HostChunkBytes(uint64_t file_host_bytes);

struct LoadPlan {
  uint64_t host_bytes = 0;  // sum of host_segments' bytes
  std::vector<HostChunk> host_segments;
  std::vector<TensorPlan> tensors;  // parallel to catalog.tensors
  std::vector<RankPlan> ranks;      // tp_size entries
  uint64_t device_bytes_per_rank(uint32_t rank) const;
};

// Keeps only the tensors `request` selects (LoadRequest::Selects: its
// include and exclude patterns) in `catalog`, before it is planned: what a
// subset load reads, places, hashes and fingerprints. Files stay (their
// headers were read and checked; a file with no selected tensor adds no
// segment and no byte to read). INVALID_ARGUMENT when no tensor is left,
// naming the checkpoint, its tensor count and the patterns.
absl::Status SelectTensors(const LoadRequest& request, Catalog& catalog);

// INVALID_ARGUMENT naming the tensor, its shape and the plan for a rule that
// cannot apply. `device_count` is the number of devices (0: host only; else
// must equal tp_size).
absl::StatusOr<LoadPlan> MakeLoadPlan(const Catalog& catalog, const LoadRequest& request, size_t device_count,
                                      uint64_t max_arena_bytes = kDefaultMaxArenaBytes);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_LOAD_PLAN_H_
