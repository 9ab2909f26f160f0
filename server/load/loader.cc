#include "server/load/loader.h"

#include <optional>

#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/base/log.h"
#include "common/base/parallel.h"
#include "common/io/proc_files.h"
#include "server/load/host_fill.h"
#include "server/load/reader.h"
#include "server/load/shared_segments.h"
#include "server/load/source_fill.h"

namespace weightd {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One block of one checkpoint tensor: tensor bytes [start, start + n).
struct ReadTask {
  uint32_t tensor;
  uint64_t start;
  uint64_t n;
  uint32_t block;  // index of the block within its tensor
};

// A device arena and the lock that serialises copies into it (fences and
// sealing are safe without it). A reused arena (sealed, from the generation
// before) takes no copies.
struct ArenaSlot {
  std::shared_ptr<DeviceArena> arena;
  bool fresh = true;
  absl::Mutex mu;
};

// A pinned staging buffer and the fences of the copies still reading it.
struct Staging {
  std::unique_ptr<PinnedBuffer> buffer;
  std::vector<std::pair<ArenaSlot*, uint64_t>> fences;
};

// A host segment of the plan: a fresh one being filled, or a sealed one
// shared with the generation before.
struct HostSlot {
  std::shared_ptr<HostSegment> fresh;
  std::shared_ptr<const HostSegment> reused;
};

struct Allocation {
  std::vector<HostSlot> host;                                   // parallel to plan.host_segments
  std::vector<std::vector<std::unique_ptr<ArenaSlot>>> arenas;  // [rank][arena]
};

absl::StatusOr<std::vector<DeviceInfo>> ResolveDevices(const LoadRequest& request, DeviceBackend* backend) {
  if (request.devices.empty()) return std::vector<DeviceInfo>{};
  if (backend == nullptr) {
    return absl::InvalidArgumentError(
        "devices were requested but this daemon has no device backend (start it with --device-backend "
        "auto|cuda|cuda-legacy-ipc|emulated)");
  }
  WEIGHTD_ASSIGN_OR_RETURN(std::vector<DeviceInfo> available, backend->Devices());
  std::vector<DeviceInfo> out;
  for (const std::string& want : request.devices) {
    auto it = std::find_if(available.begin(), available.end(), [&](const DeviceInfo& d) {
      return d.uuid == want || std::to_string(d.ordinal) == want;
    });
    if (it == available.end()) {
      std::vector<std::string> names;
      for (const DeviceInfo& d : available) names.push_back(absl::StrCat(d.ordinal, "=", d.uuid));
      return absl::InvalidArgumentError(absl::StrCat("no device ", QuoteName(want), " on the ", backend->name(),
                                                     " backend (available: ", absl::StrJoin(names, ", "), ")"));
    }
    for (size_t r = 0; r < out.size(); ++r) {
      if (out[r].uuid == it->uuid) {
        return absl::InvalidArgumentError(absl::StrCat("device ", QuoteName(want), " (", it->uuid, ") is given for ranks ",
                                                       r, " and ", out.size(), ": one GPU per rank"));
      }
    }
    out.push_back(*it);
  }
  return out;
}

// The blocks of every tensor that is read (`read[i]`).
std::vector<ReadTask> MakeTasks(const Catalog& catalog, const std::vector<bool>& read) {
  std::vector<ReadTask> tasks;
  for (uint32_t i = 0; i < catalog.tensors.size(); ++i) {
    if (!read[i]) continue;
    uint64_t nbytes = catalog.tensors[i].nbytes;
    for (uint64_t start = 0, b = 0; start < nbytes; start += kReadBlockBytes, ++b) {
      tasks.push_back({i, start, std::min(kReadBlockBytes, nbytes - start), static_cast<uint32_t>(b)});
    }
  }
  return tasks;
}

// What one worker takes at a time: tasks [first, end) of the sorted task list.
struct WorkUnit {
  size_t first = 0;
  size_t end = 0;
  uint64_t bytes = 0;
};

// Orders `tasks` so that each host segment's blocks are adjacent and cuts
// them into units: one per host segment, so that no two threads ever fill
// one memfd (pwrite serialises on the inode lock: 12.7% of load samples
// spun in rwsem_down_write_slowpath, docs/performance.md), largest first so
// that the threads finish together; then one per device block, in file order.
std::vector<WorkUnit> MakeUnits(const LoadPlan& plan, std::vector<ReadTask>& tasks) {
  auto segment_of = [&](const ReadTask& t) -> uint64_t {
    const TensorPlan& tp = plan.tensors[t.tensor];
    return tp.placement == Placement::kHost ? tp.host_segment : UINT64_MAX;
  };
  std::stable_sort(tasks.begin(), tasks.end(),
                   [&](const ReadTask& a, const ReadTask& b) { return segment_of(a) < segment_of(b); });
  std::vector<WorkUnit> host, device;
  for (size_t i = 0; i < tasks.size(); ++i) {
    uint64_t segment = segment_of(tasks[i]);
    if (segment != UINT64_MAX && !host.empty() && segment_of(tasks[host.back().first]) == segment) {
      host.back().end = i + 1;
      host.back().bytes += tasks[i].n;
      continue;
    }
    (segment == UINT64_MAX ? device : host).push_back({i, i + 1, tasks[i].n});
  }
  std::stable_sort(host.begin(), host.end(), [](const WorkUnit& a, const WorkUnit& b) { return a.bytes > b.bytes; });
  host.insert(host.end(), device.begin(), device.end());
  return host;
}

// Promises `host_bytes` of new host memory to this load (LoaderOptions::admission).
absl::StatusOr<HostMemoryAdmission::Reservation> AdmitHostMemory(const std::string& name, uint64_t host_bytes,
                                                                 const LoaderOptions& options) {
  // Staging buffers are small and bounded; the host segments are what can be huge.
  if (options.admission != nullptr) return options.admission->Reserve(name, host_bytes);
  HostMemoryAdmission::Probe fixed;
  if (options.host_memory_limit > 0) {
    fixed = [limit = options.host_memory_limit]() -> absl::StatusOr<HostMemoryBudget> {
      return HostMemoryBudget{limit, "the loader's host_memory_limit"};
    };
  }
  HostMemoryAdmission alone(std::move(fixed));
  WEIGHTD_RETURN_IF_ERROR(alone.Reserve(name, host_bytes).status());
  return HostMemoryAdmission::Reservation();
}

// What a load takes from the segments this node already serves
// (server/load/shared_segments.h): for each host segment and arena of the
// plan, the served segment with the same contents, or null (a fresh one is
// made and filled); which tensors must be read (those with any fresh
// destination); and the content hashes of the others.
struct Reuse {
  std::vector<SharedSegments::HostHit> host;                // parallel to plan.host_segments; null: fresh
  std::vector<std::vector<SharedSegments::ArenaHit>> arenas;  // [rank][arena]; null: fresh
  std::vector<bool> read;                                       // parallel to catalog.tensors
  std::vector<uint64_t> hashes;                                 // of tensors not read
};

// `host_node`: the NUMA node the load binds its (first copy of) host
// segments to, -1 for none: part of a host segment's key.
Reuse FindReusable(const Catalog& catalog, const LoadPlan& plan, const std::vector<DeviceInfo>& devices,
                   const SharedSegments* shared, int host_node) {
  Reuse reuse;
  reuse.host.assign(plan.host_segments.size(), {});
  reuse.arenas.resize(devices.empty() ? 0 : plan.ranks.size());
  for (size_t r = 0; r < reuse.arenas.size(); ++r) reuse.arenas[r].assign(plan.ranks[r].arena_bytes.size(), {});
  reuse.read.assign(catalog.tensors.size(), true);
  reuse.hashes.assign(catalog.tensors.size(), 0);
  if (shared == nullptr) return reuse;
  const size_t host_count = plan.host_segments.size();
  // What each segment of the plan holds, as its rank manifests say.
  std::vector<std::vector<SegmentContent>> host_contents(host_count);
  std::vector<std::vector<std::vector<SegmentContent>>> arena_contents(reuse.arenas.size());
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    if (r < arena_contents.size()) arena_contents[r].resize(plan.ranks[r].arena_bytes.size());
    for (const TensorRecord& t : plan.ranks[r].tensors) {
      SegmentContent c{t.name, t.offset, t.nbytes, t.split_dim, t.split_start};
      if (t.placement == Placement::kHost) {
        if (r == 0) host_contents[t.segment].push_back(std::move(c));
      } else if (r < arena_contents.size()) {
        arena_contents[r][t.segment - host_count].push_back(std::move(c));
      }
    }
  }
  for (size_t i = 0; i < host_count; ++i) {
    const CatalogFile& file = catalog.files[plan.host_segments[i].file];
    reuse.host[i] = shared->FindHost(SegmentKey(StampOf(file), "", host_node, std::move(host_contents[i])));
    // An equal key holds the same tensors at the same offsets; the size
    // check guards the mappings anyway.
    if (reuse.host[i].segment && reuse.host[i].segment->size() < plan.host_segments[i].bytes) reuse.host[i] = {};
  }
  for (size_t r = 0; r < reuse.arenas.size(); ++r) {
    for (size_t i = 0; i < reuse.arenas[r].size(); ++i) {
      const CatalogFile& file = catalog.files[plan.ranks[r].arena_file[i]];
      reuse.arenas[r][i] =
          shared->FindArena(SegmentKey(StampOf(file), devices[r].uuid, -1, std::move(arena_contents[r][i])));
      if (reuse.arenas[r][i].arena && reuse.arenas[r][i].arena->size() < plan.ranks[r].arena_bytes[i]) {
        reuse.arenas[r][i] = {};
      }
    }
  }
  for (size_t i = 0; i < catalog.tensors.size(); ++i) {
    const TensorPlan& tp = plan.tensors[i];
    const SharedSegments::Hashes* hashes = nullptr;
    bool fresh = false;
    if (tp.placement == Placement::kHost) {
      const SharedSegments::HostHit& h = reuse.host[tp.host_segment];
      fresh = h.segment == nullptr;
      if (!fresh) hashes = h.hashes;
    } else {
      for (size_t r = 0; r < tp.ranks.size() && r < reuse.arenas.size(); ++r) {
        const SharedSegments::ArenaHit& a = reuse.arenas[r][tp.ranks[r].arena];
        fresh |= a.arena == nullptr;
        if (a.arena != nullptr) hashes = a.hashes;
      }
      fresh |= reuse.arenas.empty();
    }
    if (fresh || hashes == nullptr) continue;
    auto it = hashes->find(catalog.tensors[i].name);
    if (it == hashes->end()) continue;  // cannot be: an equal key holds the same tensors; read it then
    reuse.read[i] = false;
    reuse.hashes[i] = it->second;
  }
  return reuse;
}

absl::StatusOr<Allocation> Allocate(const std::string& name, const LoadPlan& plan, const Reuse& reuse,
                                    const std::vector<DeviceInfo>& devices, DeviceBackend* backend,
                                    const PageChoice& pages) {
  Allocation a;
  for (size_t i = 0; i < plan.host_segments.size(); ++i) {
    const HostChunk& c = plan.host_segments[i];
    HostSlot slot;
    if (reuse.host[i].segment != nullptr) {
      slot.reused = reuse.host[i].segment;
    } else {
      WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<HostSegment> segment,
                               HostSegment::Create(absl::StrCat(name, ":host", i), c.bytes, pages));
      slot.fresh = std::move(segment);
    }
    a.host.push_back(std::move(slot));
  }
  a.arenas.resize(devices.empty() ? 0 : plan.ranks.size());
  for (size_t r = 0; r < a.arenas.size(); ++r) {
    for (size_t i = 0; i < plan.ranks[r].arena_bytes.size(); ++i) {
      uint64_t bytes = plan.ranks[r].arena_bytes[i];
      auto slot = std::make_unique<ArenaSlot>();
      if (reuse.arenas[r][i].arena != nullptr) {
        slot->arena = reuse.arenas[r][i].arena;
        slot->fresh = false;
        a.arenas[r].push_back(std::move(slot));
        continue;
      }
      absl::StatusOr<std::unique_ptr<DeviceArena>> arena = backend->Allocate(devices[r], bytes);
      if (!arena.ok()) {
        return Annotate(arena.status(), absl::StrCat("allocating a ", bytes, "-byte arena for rank ", r, " on ",
                                                     devices[r].uuid));
      }
      slot->arena = std::move(*arena);
      a.arenas[r].push_back(std::move(slot));
    }
  }
  return a;
}

// Enqueues the copies that place tensor bytes [b0, b1), staged at `src`,
// into every rank's arena.
absl::Status CopyBlockToRanks(const TensorPlan& tp, uint64_t b0, uint64_t b1, const char* src,
                              Allocation& a, Staging& staging) {
  for (size_t r = 0; r < tp.ranks.size(); ++r) {
    ArenaSlot& slot = *a.arenas[r][tp.ranks[r].arena];
    if (!slot.fresh) continue;  // shared: sealed, holds these bytes already
    absl::MutexLock lock(&slot.mu);
    uint64_t base = tp.ranks[r].offset;
    if (tp.split_dim < 0) {
      WEIGHTD_RETURN_IF_ERROR(slot.arena->CopyFromHost(base + b0, 0, src, 0, b1 - b0, 1));
    } else {
      // The tensor is [outer][tp * slice][row]; rank r's slice in outer row o
      // is bytes [o * full + r * part, + part).
      uint64_t part = tp.slice_elements * tp.row_bytes;
      uint64_t full = part * tp.ranks.size();
      uint64_t run_first = 0, run_rows = 0;  // a run of whole slices: one 2D copy
      auto flush = [&]() -> absl::Status {
        if (run_rows == 0) return absl::OkStatus();
        uint64_t s = run_first * full + r * part;
        absl::Status st = slot.arena->CopyFromHost(base + run_first * part, part, src + (s - b0), full, part, run_rows);
        run_rows = 0;
        return st;
      };
      for (uint64_t o = b0 / full; o < tp.outer && o * full < b1; ++o) {
        uint64_t s = o * full + r * part, e = s + part;
        uint64_t lo = std::max(s, b0), hi = std::min(e, b1);
        if (lo >= hi) continue;
        if (lo == s && hi == e) {
          if (run_rows == 0) run_first = o;
          ++run_rows;
          continue;
        }
        WEIGHTD_RETURN_IF_ERROR(flush());
        WEIGHTD_RETURN_IF_ERROR(slot.arena->CopyFromHost(base + o * part + (lo - s), 0, src + (lo - b0), 0, hi - lo, 1));
      }
      WEIGHTD_RETURN_IF_ERROR(flush());
    }
    WEIGHTD_ASSIGN_OR_RETURN(uint64_t fence, slot.arena->RecordFence());
    staging.fences.emplace_back(&slot, fence);
  }
  return absl::OkStatus();
}

absl::Status WaitStaging(Staging& staging) {
  for (auto& [slot, fence] : staging.fences) WEIGHTD_RETURN_IF_ERROR(slot->arena->WaitFence(fence));
  staging.fences.clear();
  return absl::OkStatus();
}

// Shared state of one parallel read; workers take units by atomic index.
class ReadJob {
 public:
  ReadJob(const Catalog& catalog, const LoadPlan& plan, const std::vector<ReadTask>& tasks,
          const std::vector<WorkUnit>& units, HostFill& fill, Allocation& alloc,
          std::vector<std::vector<uint64_t>>& block_hashes)
      : catalog_(catalog), plan_(plan), tasks_(tasks), units_(units), fill_(fill), alloc_(alloc),
        block_hashes_(block_hashes), file_remaining_(catalog.files.size()) {
    for (const ReadTask& t : tasks) file_remaining_[catalog.tensors[t.tensor].file] += t.n;
    for (const auto& r : file_remaining_) files_done_ += r.load() == 0;
  }

  // Blocks until every worker returned; reports progress meanwhile.
  absl::Status Run(int threads, DeviceBackend* backend, const std::function<void(uint64_t, uint32_t)>& report) {
    threads_ = threads;
    std::vector<std::thread> workers;
    for (int i = 0; i < threads; ++i) {
      workers.emplace_back([this, backend] { Finished(Work(backend)); });
    }
    for (bool all = false; !all;) {
      all = AwaitAllFinished(absl::Milliseconds(100));
      report(bytes_done_.load(), files_done_.load());
    }
    for (std::thread& w : workers) w.join();
    report(bytes_done_.load(), files_done_.load());  // the final state, however slow the callback
    absl::MutexLock lock(&mu_);
    return error_;
  }

  void set_cancel(const std::atomic<bool>* cancel) { cancel_ = cancel; }

 private:
  // A worker returned `status`; the first error is the job's.
  void Finished(absl::Status status) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (!status.ok() && error_.ok()) error_ = status;
    ++finished_;
  }
  // Whether every worker returned within `timeout`.
  bool AwaitAllFinished(absl::Duration timeout) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(this, &ReadJob::AllFinished), timeout);
  }
  bool AllFinished() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return finished_ == threads_; }

  absl::Status Work(DeviceBackend* backend) {
    Staging staging[2];
    // On every exit, wait for copies still reading a staging buffer before it is freed.
    struct Drain {
      Staging* s;
      ~Drain() {
        for (int i = 0; i < 2; ++i) (void)WaitStaging(s[i]);
      }
    } drain{staging};
    int turn = 0;
    FillThread thread;
    for (size_t u; (u = next_.fetch_add(1)) < units_.size();) {
      for (size_t i = units_[u].first; i < units_[u].end; ++i) {
        if (failed_.load()) return absl::OkStatus();
        if (cancel_ != nullptr && cancel_->load()) return Fail(absl::UnavailableError("load cancelled: weightd is shutting down"));
        const ReadTask& task = tasks_[i];
        const CatalogTensor& t = catalog_.tensors[task.tensor];
        const TensorPlan& tp = plan_.tensors[task.tensor];
        auto where = [&] { return absl::StrCat(ElideName(catalog_.files[t.file].name), ": tensor ", QuoteName(t.name)); };
        absl::StatusOr<uint64_t> hash;
        if (tp.placement == Placement::kHost) {
          hash = fill_.FillBlock(t.file, t.offset + task.start, task.n, *alloc_.host[tp.host_segment].fresh,
                                 tp.host_offset + task.start, thread);
        } else {
          Staging& stage = staging[turn ^= 1];
          WEIGHTD_RETURN_IF_ERROR(Fail(WaitStaging(stage)));
          if (!stage.buffer) {
            absl::StatusOr<std::unique_ptr<PinnedBuffer>> buffer = backend->AllocatePinned(kReadBlockBytes);
            WEIGHTD_RETURN_IF_ERROR(Fail(buffer.status()));
            stage.buffer = std::move(*buffer);
          }
          hash = fill_.ReadHashed(t.file, t.offset + task.start, task.n, stage.buffer->data(), thread);
          if (hash.ok()) {
            WEIGHTD_RETURN_IF_ERROR(
                Fail(CopyBlockToRanks(tp, task.start, task.start + task.n, stage.buffer->data(), alloc_, stage)));
          }
        }
        if (!hash.ok()) return Fail(Annotate(hash.status(), where()));
        block_hashes_[task.tensor][task.block] = *hash;
        Done(task, t);
      }
    }
    for (Staging& s : staging) WEIGHTD_RETURN_IF_ERROR(WaitStaging(s));
    return absl::OkStatus();
  }

  void Done(const ReadTask& task, const CatalogTensor& t) {
    bytes_done_.fetch_add(task.n);
    if (file_remaining_[t.file].fetch_sub(task.n) == task.n) files_done_.fetch_add(1);
  }

  absl::Status Fail(absl::Status status) {
    if (!status.ok()) failed_ = true;
    return status;
  }

  const Catalog& catalog_;
  const LoadPlan& plan_;
  const std::vector<ReadTask>& tasks_;
  const std::vector<WorkUnit>& units_;
  HostFill& fill_;
  Allocation& alloc_;
  std::vector<std::vector<uint64_t>>& block_hashes_;
  std::vector<std::atomic<uint64_t>> file_remaining_;
  std::atomic<size_t> next_{0};
  std::atomic<uint64_t> bytes_done_{0};
  std::atomic<uint32_t> files_done_{0};
  const std::atomic<bool>* cancel_ = nullptr;
  std::atomic<bool> failed_{false};
  int threads_ = 0;  // set before the workers start
  absl::Mutex mu_;
  int finished_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

// The fresh host segments of `alloc`, in plan order: what a HostSource fills
// (a load from one shares nothing, so that is every host segment).
std::vector<HostSegment*> FreshHostSegments(Allocation& alloc) {
  std::vector<HostSegment*> out;
  for (HostSlot& slot : alloc.host) {
    if (slot.fresh) out.push_back(slot.fresh.get());
  }
  return out;
}

// For each host segment, the tensors it holds; sizes `block_hashes` for them.
std::vector<std::vector<SegmentTensor>> SegmentTensors(const Catalog& catalog, const LoadPlan& plan, const Reuse& reuse,
                                                       std::vector<std::vector<uint64_t>>& block_hashes) {
  std::vector<std::vector<SegmentTensor>> out(plan.host_segments.size());
  for (uint32_t i = 0; i < catalog.tensors.size(); ++i) {
    const TensorPlan& tp = plan.tensors[i];
    if (tp.placement != Placement::kHost || !reuse.read[i]) continue;
    uint64_t nbytes = catalog.tensors[i].nbytes;
    out[tp.host_segment].push_back({i, tp.host_offset, nbytes});
    block_hashes[i].assign((nbytes + kHashBlockBytes - 1) / kHashBlockBytes, 0);
  }
  return out;
}

// The page choice of a load: what the kernel offers now (or the test's
// probe) for the fresh host segments of `plan`.
PageChoice ChooseLoadPages(const LoadPlan& plan, const Reuse& reuse, const LoaderOptions& options, bool allow_hugetlb) {
  uint64_t hugetlb_bytes = 0;
  for (size_t i = 0; i < plan.host_segments.size(); ++i) {
    const HostChunk& c = plan.host_segments[i];
    if (reuse.host[i].segment == nullptr && c.bytes >= kHugeSegmentMinBytes) {
      hugetlb_bytes += (c.bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    }
  }
  HugePageSystem system = options.huge_page_probe ? options.huge_page_probe() : ReadHugePageSystem();
  if (!allow_hugetlb) system.hugetlb_free_bytes = 0;  // the pool is per node: not for NUMA copies
  return ChoosePages(system, hugetlb_bytes, options.huge_pages);
}

// Records on each fresh THP segment how many of its bytes are on 2 MiB
// pages, from the ShmemPmdMapped of its writable mapping in /proc/self/smaps
// (proc(5)): measured, not assumed. Before sealing (which unmaps it).
void MeasureThp(Allocation& alloc) {
  bool any = false;
  for (const HostSlot& slot : alloc.host) any |= slot.fresh && slot.fresh->page_kind() == PageKind::kShmemThp;
  if (!any) return;
  absl::StatusOr<std::string> smaps = ReadPseudoFile("/proc/self/smaps", 256 << 20);
  if (!smaps.ok()) return;
  std::map<uint64_t, uint64_t> pmd = ParseSmapsField(*smaps, "ShmemPmdMapped");
  for (HostSlot& slot : alloc.host) {
    if (!slot.fresh || slot.fresh->page_kind() != PageKind::kShmemThp || slot.fresh->data() == nullptr) continue;
    // Sealed already (filled from a HostSource, then hashed): its read-only mapping.
    auto it = pmd.find(reinterpret_cast<uint64_t>(slot.fresh->data()));
    if (it != pmd.end()) slot.fresh->set_huge_bytes(std::min(it->second, slot.fresh->size()));
  }
}

// The load's one line about its pages; "" when it made no host segment.
std::string DescribePages(const std::string& name, const PageChoice& pages, const HostFill& fill,
                          const Allocation& alloc) {
  uint64_t fresh = 0, huge = 0;
  for (const HostSlot& slot : alloc.host) {
    if (!slot.fresh) continue;
    fresh += slot.fresh->size();
    huge += slot.fresh->huge_bytes();
  }
  if (fresh == 0) return "";
  std::string line = absl::StrFormat("load of '%s': host pages %s (%s): %d of %d MiB on 2 MiB pages", name,
                                     PageKindName(pages.kind), pages.reason, huge >> 20, fresh >> 20);
  if (fill.stalled()) absl::StrAppend(&line, "; ", fill.stall_note());
  return line;
}

// The nodes a load with numa_copies places copies on: every node of the
// topology (one copy each, by node id), or none when the kernel has no NUMA
// support (then one copy, unbound).
absl::StatusOr<std::vector<NumaNode>> CopyNodes(const LoadRequest& request, const LoaderOptions& options) {
  if (!request.numa_copies) return std::vector<NumaNode>{};
  Env& env = options.env != nullptr ? *options.env : *Env::Default();
  absl::StatusOr<std::vector<NumaNode>> nodes = env.NumaNodes();
  if (!nodes.ok()) return Annotate(nodes.status(), "numa_copies: reading the NUMA topology");
  return nodes;
}

// The extra NUMA copies of a load's host segments: for each node after the
// first, a segment per host slot of the same size, bound to that node
// before a byte is written, filled from the slot's segment (the fresh one's
// writable mapping, or a shared one's sealed mapping) and sealed. In
// parallel across segments; everything made is freed on an error.
absl::StatusOr<std::vector<std::vector<std::shared_ptr<const HostSegment>>>> MakeNumaCopies(
    const std::string& name, const std::vector<NumaNode>& nodes, const Allocation& alloc, const PageChoice& pages,
    Env& env, int threads) {
  std::vector<std::vector<std::shared_ptr<const HostSegment>>> copies(nodes.size() > 1 ? nodes.size() - 1 : 0);
  const size_t per_copy = alloc.host.size();
  std::vector<std::shared_ptr<HostSegment>> made(copies.size() * per_copy);
  constexpr uint64_t kPiece = 64ull << 20;
  absl::Status status = ParallelFor(
      made.size(),
      [&](size_t j) -> absl::Status {
        const size_t k = j / per_copy + 1, i = j % per_copy;
        const HostSlot& slot = alloc.host[i];
        const HostSegment& source = slot.fresh ? *slot.fresh : *slot.reused;
        const char* from = slot.fresh && !slot.fresh->sealed() ? slot.fresh->writable()
                           : slot.fresh                          ? slot.fresh->data()
                                                                 : slot.reused->data();
        WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<HostSegment> copy,
                                 HostSegment::Create(absl::StrCat(name, ":host", i, ":node", nodes[k].id),
                                                     source.size(), pages));
        WEIGHTD_RETURN_IF_ERROR(env.BindMemory(copy->fd(), copy->writable(), copy->size(), nodes[k].id));
        for (uint64_t at = 0; at < copy->size(); at += kPiece) {
          WEIGHTD_RETURN_IF_ERROR(copy->Write(at, from + at, std::min(kPiece, copy->size() - at)));
        }
        WEIGHTD_RETURN_IF_ERROR(copy->Seal(/*lock=*/false));
        made[j] = std::move(copy);
        return absl::OkStatus();
      },
      static_cast<size_t>(std::max(threads, 1)));
  if (!status.ok()) return Annotate(status, absl::StrCat("making the NUMA copies of '", name, "'"));
  for (size_t j = 0; j < made.size(); ++j) copies[j / per_copy].push_back(std::move(made[j]));
  return copies;
}

// Seals every fresh segment and moves all of them, with the manifests, into
// `gen`: host segments first (plan order), then each rank's arenas.
absl::Status Publish(const Catalog& catalog, const LoadPlan& plan, Allocation& alloc,
                     const std::vector<uint64_t>& hashes, DeviceBackend* backend, const std::vector<NumaNode>& nodes,
                     std::vector<std::vector<std::shared_ptr<const HostSegment>>> copies, ModelGeneration& gen) {
  gen.files.resize(catalog.files.size());
  for (size_t f = 0; f < catalog.files.size(); ++f) {
    gen.files[f].stamp = StampOf(catalog.files[f]);
    gen.files[f].arenas.resize(plan.ranks.size());
  }
  std::vector<uint32_t> host_ids;
  for (size_t i = 0; i < alloc.host.size(); ++i) {
    HostSlot& slot = alloc.host[i];
    if (slot.fresh != nullptr) {
      // Pinned after publishing (ModelRegistry); filled from a HostSource: sealed already.
      if (!slot.fresh->sealed()) WEIGHTD_RETURN_IF_ERROR(slot.fresh->Seal(/*lock=*/false));
      slot.reused = std::move(slot.fresh);
    } else {
      gen.bytes_reused += slot.reused->size();
    }
    const HostSegment& segment = *slot.reused;
    gen.host_bytes += segment.size();
    gen.locked_bytes += segment.locked() ? segment.size() : 0;
    gen.huge_page_bytes += segment.huge_bytes();
    uint32_t id = static_cast<uint32_t>(gen.segments.size());
    host_ids.push_back(id);
    gen.files[plan.host_segments[i].file].host_segments.push_back(id);
    gen.segments.push_back({Placement::kHost, segment.size(), SegmentBackend::kMemfd, "", segment.fd(), "",
                            static_cast<uint32_t>(gen.host_segments.size())});
    gen.host_segments.push_back(std::move(slot.reused));
  }
  if (!nodes.empty()) gen.numa_copies.push_back({nodes[0].id, nodes[0].cpus, host_ids});
  for (size_t k = 0; k < copies.size(); ++k) {
    NumaCopy copy{nodes[k + 1].id, nodes[k + 1].cpus, {}};
    for (std::shared_ptr<const HostSegment>& segment : copies[k]) {
      gen.host_bytes += segment->size();
      gen.huge_page_bytes += segment->huge_bytes();
      copy.host_segments.push_back(static_cast<uint32_t>(gen.segments.size()));
      gen.segments.push_back({Placement::kHost, segment->size(), SegmentBackend::kMemfd, "", segment->fd(), "",
                              static_cast<uint32_t>(gen.host_segments.size())});
      gen.host_segments.push_back(std::move(segment));
    }
    gen.numa_copies.push_back(std::move(copy));
  }
  for (size_t r = 0; r < plan.ranks.size(); ++r) {
    RankManifest rank;
    rank.segments = host_ids;
    static const std::vector<std::unique_ptr<ArenaSlot>> kNone;
    const auto& slots = r < alloc.arenas.size() ? alloc.arenas[r] : kNone;
    for (size_t i = 0; i < slots.size(); ++i) {
      ArenaSlot& slot = *slots[i];
      if (slot.fresh) {
        WEIGHTD_RETURN_IF_ERROR(slot.arena->Seal());
      } else {
        gen.bytes_reused += slot.arena->size();
      }
      DeviceArena& a = *slot.arena;
      uint32_t id = static_cast<uint32_t>(gen.segments.size());
      rank.segments.push_back(id);
      gen.files[plan.ranks[r].arena_file[i]].arenas[r].push_back(id);
      gen.segments.push_back({Placement::kDevice, a.size(), backend->segment_backend(), a.device().uuid, a.export_fd(),
                              a.export_handle(), static_cast<uint32_t>(gen.arenas.size())});
      gen.arenas.push_back(std::move(slot.arena));
    }
    rank.tensors = plan.ranks[r].tensors;
    for (size_t i = 0; i < rank.tensors.size(); ++i) rank.tensors[i].content_hash = hashes[i];
    gen.ranks.push_back(std::move(rank));
  }
  return absl::OkStatus();
}

}  // namespace

std::string FingerprintOf(const std::vector<TensorRecord>& tensors) {
  std::vector<const TensorRecord*> order;
  order.reserve(tensors.size());
  for (const TensorRecord& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const TensorRecord* a, const TensorRecord* b) { return a->name < b->name; });
  XXH3_state_t* state = XXH3_createState();
  XXH3_128bits_reset(state);
  for (const TensorRecord* t : order) {
    std::string line = absl::StrCat(t->name, std::string(1, '\0'), DTypeName(t->dtype), std::string(1, '\0'),
                                    absl::StrJoin(t->full_shape, ","), std::string(1, '\0'),
                                    ContentHashHex(t->content_hash), "\n");
    XXH3_128bits_update(state, line.data(), line.size());
  }
  XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

uint64_t SharedHostBytes(const Catalog& catalog, const LoadRequest& request, const LoaderOptions& options,
                         const SharedSegments& shared) {
  absl::StatusOr<PlannedLoad> planned = PlanLoad(catalog, request, options);
  absl::StatusOr<std::vector<NumaNode>> nodes = CopyNodes(request, options);
  if (!planned.ok() || !nodes.ok()) return 0;
  Reuse reuse = FindReusable(catalog, planned->plan, planned->devices, &shared, nodes->empty() ? -1 : (*nodes)[0].id);
  uint64_t bytes = 0;
  for (size_t i = 0; i < reuse.host.size(); ++i) {
    bytes += reuse.host[i].segment != nullptr ? planned->plan.host_segments[i].bytes : 0;
  }
  return bytes;
}

FileStamp StampOf(const CatalogFile& file) { return FileStamp{file.name, file.identity, file.header_hash}; }

absl::StatusOr<PlannedLoad> PlanLoad(const Catalog& catalog, const LoadRequest& request, const LoaderOptions& options) {
  PlannedLoad planned;
  WEIGHTD_ASSIGN_OR_RETURN(planned.devices, ResolveDevices(request, options.device_backend));
  WEIGHTD_ASSIGN_OR_RETURN(planned.plan, MakeLoadPlan(catalog, request, planned.devices.size(), options.max_arena_bytes));
  return planned;
}

absl::StatusOr<std::unique_ptr<ModelGeneration>> LoadGeneration(const Catalog& catalog, const LoadRequest& request,
                                                                 const LoaderOptions& options,
                                                                 const ProgressFn& progress,
                                                                 const SharedSegments* shared,
                                                                 const PlannedLoad* planned) {
  static_assert(kReadBlockBytes == kHashBlockBytes, "a read block is a hash block");
  if (options.host_source != nullptr && shared != nullptr) {
    return absl::InternalError("a load from a host source shares no segment");
  }
  auto start = std::chrono::steady_clock::now();
  LoadProgress p;
  p.files_total = static_cast<uint32_t>(catalog.files.size());
  p.bytes_total = catalog.total_bytes();  // until the plan tells what is shared
  auto report = [&](LoadProgress::Phase phase) {
    p.phase = phase;
    p.seconds = SecondsSince(start);
    if (progress) progress(p);
  };
  report(LoadProgress::Phase::kPlan);
  std::optional<PlannedLoad> own;
  if (planned == nullptr) {
    WEIGHTD_ASSIGN_OR_RETURN(own, PlanLoad(catalog, request, options));
    planned = &*own;
  }
  const std::vector<DeviceInfo>& devices = planned->devices;
  const LoadPlan& plan = planned->plan;
  WEIGHTD_ASSIGN_OR_RETURN(std::vector<NumaNode> nodes, CopyNodes(request, options));
  Reuse reuse = FindReusable(catalog, plan, devices, shared, nodes.empty() ? -1 : nodes[0].id);
  p.bytes_total = 0;
  for (size_t i = 0; i < catalog.tensors.size(); ++i) {
    (reuse.read[i] ? p.bytes_total : p.bytes_reused) += catalog.tensors[i].nbytes;
  }

  report(LoadProgress::Phase::kAllocate);
  Env& env = options.env != nullptr ? *options.env : *Env::Default();
  PageChoice pages = ChooseLoadPages(plan, reuse, options, /*allow_hugetlb=*/nodes.size() <= 1);
  uint64_t new_host_bytes = 0;
  for (size_t i = 0; i < plan.host_segments.size(); ++i) {
    new_host_bytes += reuse.host[i].segment == nullptr ? plan.host_segments[i].bytes : 0;
    // Every copy after the first is new, shared primary or not.
    if (nodes.size() > 1) new_host_bytes += (nodes.size() - 1) * plan.host_segments[i].bytes;
  }
  WEIGHTD_ASSIGN_OR_RETURN(HostMemoryAdmission::Reservation admitted,
                           AdmitHostMemory(request.name, new_host_bytes, options));
  WEIGHTD_ASSIGN_OR_RETURN(Allocation alloc,
                           Allocate(request.name, plan, reuse, devices, options.device_backend, pages));
  if (!nodes.empty()) {  // the first copy: the fresh segments' pages from the first node
    for (HostSlot& slot : alloc.host) {
      if (!slot.fresh) continue;
      absl::Status bound = env.BindMemory(slot.fresh->fd(), slot.fresh->writable(), slot.fresh->size(), nodes[0].id);
      if (!bound.ok()) return Annotate(bound, absl::StrCat("numa_copies: binding '", request.name, "' to node ", nodes[0].id));
    }
    if (nodes.size() == 1) {
      LogInfo(absl::StrFormat("load of '%s': numa_copies on a one-node machine: one copy of %d host bytes, bound to "
                              "node %d",
                              request.name, plan.host_bytes, nodes[0].id));
    }
  } else if (request.numa_copies) {
    LogInfo(absl::StrFormat("load of '%s': numa_copies, but this kernel shows no NUMA nodes (%s): one copy, not bound",
                            request.name, kNumaSysfsRoot));
  }
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader,
                           CheckpointReader::Open(catalog, {options.direct_io}));

  report(LoadProgress::Phase::kRead);
  std::vector<bool> from_files = reuse.read;
  for (size_t i = 0; i < from_files.size() && options.host_source != nullptr; ++i) {
    from_files[i] = from_files[i] && plan.tensors[i].placement != Placement::kHost;
  }
  std::vector<ReadTask> tasks = MakeTasks(catalog, from_files);
  std::vector<WorkUnit> units = MakeUnits(plan, tasks);
  std::vector<std::vector<uint64_t>> block_hashes(catalog.tensors.size());
  for (const ReadTask& t : tasks) block_hashes[t.tensor].resize(std::max<size_t>(block_hashes[t.tensor].size(), t.block + 1));
  const int cores = options.threads > 0 ? options.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  int threads = static_cast<int>(std::min<size_t>(cores, std::max<size_t>(units.size(), 1)));
  std::optional<SourceFill> from_source;
  if (options.host_source != nullptr) {
    from_source.emplace(*options.host_source, FreshHostSegments(alloc), SegmentTensors(catalog, plan, reuse, block_hashes),
                        block_hashes);
    for (HostSegment* segment : FreshHostSegments(alloc)) WEIGHTD_RETURN_IF_ERROR(segment->SealSize());
    from_source->set_cancel(options.cancel);
    from_source->set_hashing(options.source_hashing);
    from_source->Start(cores);
  }
  HostFill fill(*reader, options.huge_fill_budget);
  ReadJob job(catalog, plan, tasks, units, fill, alloc, block_hashes);
  job.set_cancel(options.cancel);
  absl::Status read = job.Run(threads, options.device_backend, [&](uint64_t bytes, uint32_t files_done) {
    p.bytes_done = bytes + (from_source ? from_source->bytes_hashed() : 0);
    p.files_done = files_done;
    report(LoadProgress::Phase::kRead);
  });
  if (from_source) {
    absl::Status filled = from_source->Wait();
    if (read.ok()) read = filled;
    p.bytes_done += from_source->bytes_hashed();
    report(LoadProgress::Phase::kRead);
  }
  WEIGHTD_RETURN_IF_ERROR(read);

  report(LoadProgress::Phase::kSeal);
  MeasureThp(alloc);
  std::string host_pages = DescribePages(request.name, pages, fill, alloc);
  if (!host_pages.empty()) LogInfo(host_pages);
  std::vector<uint64_t> hashes(catalog.tensors.size());
  for (size_t i = 0; i < hashes.size(); ++i) {
    hashes[i] = reuse.read[i] ? CombineBlockHashes(block_hashes[i]) : reuse.hashes[i];
  }
  std::vector<std::vector<std::shared_ptr<const HostSegment>>> copies;
  if (nodes.size() > 1) {
    auto copy_start = std::chrono::steady_clock::now();
    WEIGHTD_ASSIGN_OR_RETURN(copies, MakeNumaCopies(request.name, nodes, alloc, pages, env, threads));
    std::vector<std::string> ids;
    for (const NumaNode& n : nodes) ids.push_back(std::to_string(n.id));
    LogInfo(absl::StrFormat("load of '%s': %d NUMA copies of %d host bytes (nodes %s), each bound to its node, in %.3f s",
                            request.name, nodes.size(), plan.host_bytes, absl::StrJoin(ids, ","),
                            SecondsSince(copy_start)));
  }
  auto gen = std::make_unique<ModelGeneration>();
  WEIGHTD_RETURN_IF_ERROR(
      Publish(catalog, plan, alloc, hashes, options.device_backend, nodes, std::move(copies), *gen));
  gen->request = request;
  gen->host_pages = std::move(host_pages);
  gen->fingerprint = FingerprintOf(gen->ranks[0].tensors);
  gen->tensor_count = catalog.tensors.size();
  gen->checkpoint_bytes = catalog.total_bytes();
  gen->bytes_read = p.bytes_total;
  gen->source = "storage";
  gen->from_files = options.host_source == nullptr;  // a peer's host bytes match the seed's hashes, not the files
  gen->load_seconds = SecondsSince(start);
  return gen;
}

}  // namespace weightd
