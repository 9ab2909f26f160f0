// The load pipeline: catalog -> plan -> allocate -> parallel read + hash ->
// seal and export. Work is cut into blocks of at most kReadBlockBytes that a
// pool of threads takes in file order (CheckpointReader: buffered or
// O_DIRECT per --direct-io). Host tensors are read into a per-thread bounce
// buffer and written into their sealed-to-be memfd with pwrite(2) in 1 MiB
// slices, each hashed between the read and the write while it is in cache:
// writing through the file lets the kernel allocate the memfd's pages
// without a page fault each, which is what bounds a load from the page
// cache (docs/performance.md). A MFD_HUGETLB segment (huge page pool
// configured) is read straight into its mapping instead. Device tensors are
// read into a bounded ring of pinned staging buffers (two per thread) and
// copied asynchronously to every rank that needs them: whole for
// replicated tensors, one contiguous range per rank for a split on dim 0, 2D
// strided copies for other split dims; a buffer is reused only after its
// copies' fences complete. Peak host memory: host-resident bytes +
// threads * (2 * kReadBlockBytes staging + one block of bounce buffer).
//
// Content hash of a tensor: see common/format/content_hash.h (each read
// block is one hash block, hashed as it is read). The model fingerprint is XXH3-128 over, for each tensor in
// name order, "name\0dtype\0dim,dim,...\0<16 hex hash>\n".
#ifndef WEIGHTD_SERVER_LOADER_H_
#define WEIGHTD_SERVER_LOADER_H_

#include <atomic>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "common/format/catalog.h"
#include "common/format/content_hash.h"
#include "server/memory_admission.h"
#include "server/model.h"
#include "server/plan.h"
#include "server/reader.h"

namespace weightd {

inline constexpr uint64_t kReadBlockBytes = 16ull << 20;

struct LoadProgress {
  enum class Phase { kCatalog, kPlan, kAllocate, kRead, kSeal, kDone };
  Phase phase = Phase::kCatalog;
  uint64_t bytes_done = 0;
  uint64_t bytes_total = 0;   // tensor bytes to read from storage
  uint64_t bytes_reused = 0;  // tensor bytes of unchanged files, shared with the generation before
  uint32_t files_done = 0;
  uint32_t files_total = 0;
  double seconds = 0;
};
using ProgressFn = std::function<void(const LoadProgress&)>;

// Where a load's host-resident tensor bytes come from instead of the
// checkpoint's files (peer seeding, server/peer_join.h). Read() fills bytes
// [offset, offset + n) of the plan's host segment `segment` (an index into
// LoadPlan::host_segments; n <= kReadBlockBytes) into `dst`, which the
// caller owns; it is called from every load thread at once. The loader
// hashes what it returns exactly as it hashes bytes read from storage.
class HostSource {
 public:
  virtual ~HostSource() = default;
  virtual absl::Status Read(uint32_t segment, uint64_t offset, uint64_t n, char* dst) = 0;
};

struct LoaderOptions {
  int threads = 0;     // 0: one per core
  bool mlock = true;   // lock host segments when RLIMIT_MEMLOCK allows
  DirectIo direct_io = DirectIo::kAuto;  // see server/reader.h
  bool huge_pages = true;  // MFD_HUGETLB host segments when the huge page pool has room
  DeviceBackend* device_backend = nullptr;  // null: host only; not owned
  uint64_t max_arena_bytes = kDefaultMaxArenaBytes;
  // Where a load's host-resident bytes are admitted before anything is
  // allocated (server/memory_admission.h): a plan needing more than the
  // node and the daemon's cgroup can give, minus what loads in flight were
  // promised, is RESOURCE_EXHAUSTED rather than meeting the OOM killer
  // mid-load. Not owned; null: a check of this load alone against
  // host_memory_limit, or the running system when that is 0.
  HostMemoryAdmission* admission = nullptr;
  uint64_t host_memory_limit = 0;  // bytes; for tests without an admission
  // When set and true, the load stops at the next block with UNAVAILABLE
  // (daemon shutdown). Not owned.
  const std::atomic<bool>* cancel = nullptr;
  // When set, host tensors are filled from it, device tensors still from
  // storage; `previous` must then be null. Not owned.
  HostSource* host_source = nullptr;
};

// Loads `catalog` (already validated) into a new generation placed per
// `request`. With `previous` (the READY generation of the name, loaded with
// the same plan; not owned, must outlive the call), every catalog file whose
// FileStamp equals one of `previous`'s files is not read: its host segments
// and arenas are shared with `previous` by reference and its tensors keep
// their content hashes; only the other files are read. Progress is reported from the calling thread only, at most every
// 100 ms and at each phase change. On any error everything allocated is freed
// before returning. Errors name the file and byte offset of a failed read.
absl::StatusOr<std::unique_ptr<ModelGeneration>> LoadGeneration(const Catalog& catalog, const LoadRequest& request,
                                                                 const LoaderOptions& options,
                                                                 const ProgressFn& progress,
                                                                 const ModelGeneration* previous = nullptr);

// The model fingerprint (above) of a rank's manifest, from each tensor's
// name, dtype, full (checkpoint) shape and content hash: one formula for
// loads and for a writer's commits.
std::string FingerprintOf(const std::vector<TensorRecord>& tensors);

// The stamp of a cataloged file: its name, identity and header hash.
FileStamp StampOf(const CatalogFile& file);


}  // namespace weightd

#endif  // WEIGHTD_SERVER_LOADER_H_
