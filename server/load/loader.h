// The load pipeline: catalog -> plan -> choose pages -> allocate -> parallel
// read + hash -> seal and export. Work is cut into blocks of at most
// kReadBlockBytes (CheckpointReader: buffered or O_DIRECT per --direct-io)
// and handed to a pool of threads in units: all blocks of one host segment
// form one unit, so each memfd has one writer (largest first), and each
// device block is a unit of its own.
//
// Host pages (common/memory/huge_pages.h): per load, 2 MiB hugetlb pages
// when the pool has room for all fresh segments, else 2 MiB shmem THP when
// shmem_enabled allows, else 4 KiB; one log line per load says which and
// why, and ModelGeneration::huge_page_bytes how many bytes got huge pages
// (for THP measured from /proc/self/smaps). How each kind is filled, with
// the hash of each 1 MiB slice taken while it is in cache, and the
// fall-back to 4 KiB pages on a compaction stall: server/load/host_fill.h.
// Device tensors are read (hashed per slice the same way) into a bounded
// ring of pinned staging buffers (two per thread) and
// copied asynchronously to every rank that needs them: whole for
// replicated tensors, one contiguous range per rank for a split on dim 0, 2D
// strided copies for other split dims; a buffer is reused only after its
// copies' fences complete. Peak host memory: host-resident bytes +
// threads * (2 * kReadBlockBytes staging + one block of bounce buffer).
//
// Host segments are sealed unlocked: mlock() is not on the load's critical
// path (it cost 27-36% of a load, docs/performance.md). ModelRegistry pins
// them once the generation is published (LoaderOptions::mlock).
//
// Content hash of a tensor: see common/format/content_hash.h (each read
// block is one hash block, hashed as it is read). The model fingerprint is XXH3-128 over, for each tensor in
// name order, "name\0dtype\0dim,dim,...\0<16 hex hash>\n".
#ifndef WEIGHTD_SERVER_LOAD_LOADER_H_
#define WEIGHTD_SERVER_LOAD_LOADER_H_

#include <atomic>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "common/format/catalog.h"
#include "common/format/content_hash.h"
#include "common/memory/huge_pages.h"
#include "server/model/memory_admission.h"
#include "server/model/model.h"
#include "server/load/host_fill.h"
#include "server/load/plan.h"
#include "server/load/reader.h"
#include "server/load/shared_segments.h"

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
// checkpoint's files (peer seeding, server/peer/peer_join.h). Fill() gets
// the plan's fresh host segments (writable and size-sealed, so their fds
// may go to another process: HostSegment::SealSize) and, for each, the byte
// ranges its tensors cover; it writes those ranges by any means, and calls
// `filled(i)` once segment i is complete and nothing of the source maps it
// writable any more. The loader takes none of that on trust
// (server/load/source_fill.h): `filled` seals the segment, returning
// FAILED_PRECONDITION when the kernel refuses because some process still
// maps it writable (Fill then stops and returns that error), and the
// segment is hashed only after its seal, as storage reads are hashed.
// Fill returns OK once every segment was reported, or the first error.
// Called once per load, from one thread; `filled` may be called from any
// thread, at most once per segment.
class HostSource {
 public:
  struct Range {
    uint64_t offset = 0;
    uint64_t n = 0;
  };
  virtual ~HostSource() = default;
  virtual absl::Status Fill(const std::vector<HostSegment*>& segments, const std::vector<std::vector<Range>>& ranges,
                            const std::function<absl::Status(uint32_t)>& filled) = 0;
};

struct LoaderOptions;

// When a HostSource's segments are hashed (--peer-verify): each as soon as
// it is sealed, while later ones still arrive (per segment, the default),
// or all of them after the last byte is in (per transfer: no hashing
// competes with the transfer for the cores, and all of it follows the
// transfer). Either way every byte is hashed after its segment's seal and
// before the generation exists (server/load/source_fill.h).
enum class SourceHashing { kPerSegment, kPerTransfer };

// A source of whole generations other than the checkpoint's files, asked
// before storage for a name this node does not serve yet: peer seeding
// (server/peer/peer_join.h) is one. Load makes a generation of `request`
// (`catalog` built from the local checkpoint; `loader` and `progress` as for
// LoadGeneration), or fails having freed whatever it received, each failure
// logged and counted by the source; the caller then reads storage.
// NOT_FOUND without a log line when it has nothing to offer this request
// (no peers named). Thread-safety: Load may be called from many threads.
class GenerationSource {
 public:
  virtual ~GenerationSource() = default;
  virtual absl::StatusOr<std::unique_ptr<ModelGeneration>> Load(const Catalog& catalog, const LoadRequest& request,
                                                                const LoaderOptions& loader,
                                                                const ProgressFn& progress) = 0;
};

struct LoaderOptions {
  int threads = 0;     // 0: one per core
  // Pin host segments (mlock, when RLIMIT_MEMLOCK allows) once published;
  // done by ModelRegistry off the load's path, not by LoadGeneration.
  bool mlock = true;
  DirectIo direct_io = DirectIo::kAuto;  // see server/load/reader.h
  bool huge_pages = true;  // false: always 4 KiB pages (--huge-pages false)
  // What the kernel offers for huge pages; empty: ReadHugePageSystem().
  // Tests hand in their own to force each branch of the choice.
  HugePageProbe huge_page_probe;
  HugeFillBudget huge_fill_budget;  // when a THP fill falls back to 4 KiB pages
  DeviceBackend* device_backend = nullptr;  // null: host only; not owned
  uint64_t max_arena_bytes = kDefaultMaxArenaBytes;
  // Where a load's host-resident bytes are admitted before anything is
  // allocated (server/model/memory_admission.h): a plan needing more than the
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
  // storage in the same load; `shared` must then be null. Not owned.
  HostSource* host_source = nullptr;
  SourceHashing source_hashing = SourceHashing::kPerSegment;  // with host_source
  // The NUMA topology and page binding (LoadRequest::numa_copies) come
  // from it; null: Env::Default(). Not owned.
  Env* env = nullptr;
};

// What a load does first: the devices `request` names, resolved through
// options.device_backend (common/memory/device.h), and the plan that places
// every tensor on them (server/load/plan.h). A caller that must look at the
// plan before loading (peer seeding compares it with the seed's) makes it
// once here and hands it to LoadGeneration, so the plan checked is the plan
// loaded. Errors: those of the device resolution and of MakeLoadPlan.
struct PlannedLoad {
  std::vector<DeviceInfo> devices;
  LoadPlan plan;
};
absl::StatusOr<PlannedLoad> PlanLoad(const Catalog& catalog, const LoadRequest& request, const LoaderOptions& options);

// Loads `catalog` (already validated) into a new generation placed per
// `request`. With `shared` (the segments this node serves, indexed by what
// they hold: server/load/shared_segments.h; not owned, must outlive the
// call), every host segment and arena of the plan whose contents equal a
// served one is that segment, shared by reference (no read, no new memory,
// its tensors keep their content hashes); only tensors with a fresh
// destination are read. A reload of one changed file of a sharded
// checkpoint reads that file; a second name, a subset or another TP plan
// over the same files reads what no served segment holds. Progress is reported from the calling thread only, at most every
// 100 ms and at each phase change. On any error everything allocated is freed
// before returning. Errors name the file and byte offset of a failed read.
// `planned`: PlanLoad's result for the same catalog, request and options
// (not owned); null: LoadGeneration makes it.
absl::StatusOr<std::unique_ptr<ModelGeneration>> LoadGeneration(const Catalog& catalog, const LoadRequest& request,
                                                                 const LoaderOptions& options,
                                                                 const ProgressFn& progress,
                                                                 const SharedSegments* shared = nullptr,
                                                                 const PlannedLoad* planned = nullptr);

// Bytes of the host segments `request`'s plan over `catalog` would share
// with `shared` instead of filling; 0 also when the plan cannot be made
// (LoadGeneration then reports why).
uint64_t SharedHostBytes(const Catalog& catalog, const LoadRequest& request, const LoaderOptions& options,
                         const SharedSegments& shared);

// The model fingerprint (above) of a rank's manifest, from each tensor's
// name, dtype, full (checkpoint) shape and content hash: one formula for
// loads and for a writer's commits.
std::string FingerprintOf(const std::vector<TensorRecord>& tensors);

// The stamp of a cataloged file: its name, identity and header hash.
FileStamp StampOf(const CatalogFile& file);


}  // namespace weightd

#endif  // WEIGHTD_SERVER_LOAD_LOADER_H_
