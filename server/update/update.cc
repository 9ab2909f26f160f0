#include "server/update/update.h"

#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <functional>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/parallel.h"
#include "common/base/status.h"
#include "common/base/align.h"
#include "server/load/loader.h"
#include "server/load/plan.h"

namespace weightd {
namespace {

bool IsHashHex(const std::string& s) {
  return s.size() == 16 && std::all_of(s.begin(), s.end(), [](char c) { return absl::ascii_isxdigit(c); });
}

// Copies base segment `base` into a new, writable memfd whose size is sealed.
absl::StatusOr<std::shared_ptr<HostSegment>> CopySegment(const std::string& name, const HostSegment& base) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<HostSegment> copy,
                           HostSegment::Create(name, base.size()));
  constexpr uint64_t kSlice = 16ull << 20;
  for (uint64_t at = 0; at < base.size(); at += kSlice) {
    WEIGHTD_RETURN_IF_ERROR(copy->Write(at, base.data() + at, std::min(kSlice, base.size() - at)));
  }
  WEIGHTD_RETURN_IF_ERROR(copy->SealSize());
  return std::shared_ptr<HostSegment>(std::move(copy));
}

// The arena holding rank `rank`'s copy of `record` in generation `g`.
DeviceArena& ArenaOf(const ModelGeneration& g, size_t rank, const TensorRecord& record) {
  return *g.arenas[g.segments[g.ranks[rank].segments[record.segment]].owner];
}

// Bytes of the whole checkpoint tensor of which `record` is one rank's part.
uint64_t FullBytes(const TensorRecord& record, size_t tp_size) {
  return record.split_dim < 0 ? record.nbytes : record.nbytes * tp_size;
}

// A split tensor is [outer][tp_size * slice][row] (server/load/plan.h): rank r
// holds, for each outer index o, the `part` bytes at o * full + r * part.
uint64_t OuterOf(const TensorRecord& record) {
  uint64_t outer = 1;
  for (int32_t d = 0; d < record.split_dim; ++d) outer *= record.full_shape[d];
  return outer;
}

// Gathers device tensor `i` (index into each rank's manifest) of `g` from
// every rank's arena into `dst` (FullBytes bytes), as the checkpoint holds it.
absl::Status GatherDeviceTensor(const ModelGeneration& g, size_t i, char* dst) {
  const TensorRecord& r0 = g.ranks[0].tensors[i];
  if (r0.split_dim < 0) return ArenaOf(g, 0, r0).CopyToHost(r0.offset, dst, r0.nbytes);
  uint64_t outer = OuterOf(r0), part = r0.nbytes / outer, full = part * g.ranks.size();
  std::string slice(r0.nbytes, '\0');
  for (size_t r = 0; r < g.ranks.size(); ++r) {
    const TensorRecord& rec = g.ranks[r].tensors[i];
    WEIGHTD_RETURN_IF_ERROR(ArenaOf(g, r, rec).CopyToHost(rec.offset, slice.data(), rec.nbytes));
    for (uint64_t o = 0; o < outer; ++o) std::memcpy(dst + o * full + r * part, slice.data() + o * part, part);
  }
  return absl::OkStatus();
}

// Writes rank `rank`'s part of device tensor `record` from the whole
// tensor at `full_bytes` into `arena` at the record's offset.
absl::Status ScatterDeviceTensor(const TensorRecord& record, size_t rank, size_t tp_size, const char* full_bytes,
                                 DeviceArena& arena) {
  std::string slice(record.nbytes, '\0');
  if (record.split_dim < 0) {
    std::memcpy(slice.data(), full_bytes, record.nbytes);
  } else {
    uint64_t outer = OuterOf(record), part = record.nbytes / outer, full = part * tp_size;
    for (uint64_t o = 0; o < outer; ++o) std::memcpy(slice.data() + o * part, full_bytes + o * full + rank * part, part);
  }
  WEIGHTD_RETURN_IF_ERROR(arena.CopyFromHost(record.offset, 0, slice.data(), 0, record.nbytes, 1));
  WEIGHTD_ASSIGN_OR_RETURN(uint64_t fence, arena.RecordFence());
  return arena.WaitFence(fence);
}

// A fresh arena on `old`'s device holding `old`'s bytes.
absl::StatusOr<std::shared_ptr<DeviceArena>> CopyArena(DeviceBackend& backend, DeviceArena& old) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<DeviceArena> fresh, backend.Allocate(old.device(), old.size()));
  constexpr uint64_t kChunk = 16ull << 20;
  std::string bounce(std::min(kChunk, old.size()), '\0');
  for (uint64_t at = 0; at < old.size(); at += kChunk) {
    uint64_t n = std::min(kChunk, old.size() - at);
    WEIGHTD_RETURN_IF_ERROR(old.CopyToHost(at, bounce.data(), n));
    WEIGHTD_RETURN_IF_ERROR(fresh->CopyFromHost(at, 0, bounce.data(), 0, n, 1));
    WEIGHTD_ASSIGN_OR_RETURN(uint64_t fence, fresh->RecordFence());
    WEIGHTD_RETURN_IF_ERROR(fresh->WaitFence(fence));
  }
  return std::shared_ptr<DeviceArena>(std::move(fresh));
}

// Every byte of the sealed staged copy `staged` (the `index`th) outside the
// byte ranges `covered` (its tensors, sorted) equals the base segment's, up
// to the end of its last page; FAILED_PRECONDITION naming the first that
// differs.
absl::Status CheckUncoveredBytes(const ModelGeneration& base, const StagedSegment& staged, size_t index,
                                 const std::vector<std::pair<uint64_t, uint64_t>>& covered) {
  const HostSegment& from = *base.host_segments[base.segments[staged.base_id].owner];
  const HostSegment& copy = *staged.memory;
  if (copy.size() != from.size()) {
    return absl::InternalError(absl::StrCat("staged segment ", index, " is ", copy.size(), " bytes, its base ", from.size()));
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t end = copy.size() == 0 ? 0 : (copy.size() + page - 1) / page * page;  // mapped whole pages
  auto check = [&](uint64_t begin, uint64_t stop) -> absl::Status {
    if (begin >= stop || memcmp(copy.data() + begin, from.data() + begin, stop - begin) == 0) return absl::OkStatus();
    uint64_t at = begin;
    while (copy.data()[at] == from.data()[at]) ++at;
    return absl::FailedPreconditionError(
        absl::StrCat("staged segment ", index, ": byte ", at, " lies outside every tensor and was changed (",
                     at >= copy.size() ? "the tail of the last page" : "padding between tensors",
                     "); a writer may change tensor bytes only"));
  };
  uint64_t at = 0;
  for (const auto& [begin, stop] : covered) {
    WEIGHTD_RETURN_IF_ERROR(check(at, std::min(begin, end)));
    at = std::max(at, stop);
  }
  return check(std::min(at, end), end);
}

// A writer may change tensor bytes only: every byte of a sealed staged host
// copy that no tensor covers (alignment padding between tensors, and the
// tail of the last page past the segment's size, which every mapping of that
// page shows) must equal the base segment's. The device staging segment is
// copied to arenas tensor by tensor, so its other bytes are never served.
absl::Status CheckUncoveredBytes(const StagedUpdate& update) {
  const ModelGeneration& base = *update.base;
  absl::flat_hash_map<uint32_t, size_t> staged;  // base segment id -> index into update.segments
  for (size_t i = 0; i < update.segments.size(); ++i) {
    if (update.segments[i].base_id != kDeviceStaging) staged[update.segments[i].base_id] = i;
  }
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> covered(update.segments.size());  // [begin, end)
  for (const RankManifest& rank : base.ranks) {
    for (const TensorRecord& t : rank.tensors) {
      if (t.placement != Placement::kHost) continue;
      auto it = staged.find(rank.segments[t.segment]);
      if (it != staged.end()) covered[it->second].emplace_back(t.offset, t.offset + t.nbytes);
    }
  }
  for (size_t i = 0; i < update.segments.size(); ++i) {
    if (update.segments[i].base_id == kDeviceStaging) continue;
    std::sort(covered[i].begin(), covered[i].end());
    WEIGHTD_RETURN_IF_ERROR(CheckUncoveredBytes(base, update.segments[i], i, covered[i]));
  }
  return absl::OkStatus();
}

// StageUpdate's phases.

// The indexes (into rank 0's manifest) of the tensors `tensors` names, in
// its order; every tensor when it is empty. INVALID_ARGUMENT for more names
// than the model has tensors, an empty, unknown or repeated name.
absl::StatusOr<std::vector<size_t>> NamedTensors(const ModelGeneration& base, const std::vector<std::string>& tensors) {
  const std::vector<TensorRecord>& all = base.ranks.at(0).tensors;
  const std::string& model = base.request.name;
  if (tensors.size() > all.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the update names ", tensors.size(), " tensors but model ",
                                                   QuoteName(model), " has ", all.size()));
  }
  std::vector<size_t> named;
  if (tensors.empty()) {
    for (size_t i = 0; i < all.size(); ++i) named.push_back(i);
    return named;
  }
  absl::flat_hash_map<std::string, size_t> index;
  for (size_t i = 0; i < all.size(); ++i) index.emplace(all[i].name, i);
  absl::flat_hash_set<std::string> seen;
  for (const std::string& name : tensors) {
    if (name.empty()) return absl::InvalidArgumentError("the update names an empty tensor name");
    auto it = index.find(name);
    if (it == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat("model ", QuoteName(model), " has no tensor ", QuoteName(name)));
    }
    if (!seen.insert(name).second) {
      return absl::InvalidArgumentError(absl::StrCat("the update names tensor ", QuoteName(name), " twice"));
    }
    named.push_back(it->second);
  }
  return named;
}

// Where the named tensors are staged: the base host segments that hold
// them (copied whole), and the device tensors, each whole at its offset in
// one host staging segment (see update.h).
struct StagingLayout {
  std::vector<uint32_t> host_ids;       // base segment ids, ascending, each once
  std::vector<size_t> device_named;     // indexes into rank 0's manifest
  std::vector<uint64_t> device_offset;  // parallel to device_named
  uint64_t device_bytes = 0;
  uint64_t staged_bytes = 0;  // host_ids' sizes + device_bytes
};

// FAILED_PRECONDITION naming a device tensor when there is no `backend`.
absl::StatusOr<StagingLayout> LayOutStaging(const ModelGeneration& base, const std::vector<size_t>& named,
                                            const DeviceBackend* backend) {
  const std::vector<TensorRecord>& all = base.ranks[0].tensors;
  StagingLayout layout;
  for (size_t i : named) {
    const TensorRecord& t = all[i];
    if (t.placement != Placement::kDevice) {
      layout.host_ids.push_back(base.ranks[0].segments[t.segment]);
      continue;
    }
    if (backend == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat("tensor ", QuoteName(t.name), " of model ",
                                                        QuoteName(base.request.name),
                                                        " is on devices but this daemon has no device backend"));
    }
    layout.device_named.push_back(i);
    layout.device_offset.push_back(AlignUp(layout.device_bytes, kHostAlignment));
    layout.device_bytes = layout.device_offset.back() + FullBytes(t, base.ranks.size());
  }
  std::sort(layout.host_ids.begin(), layout.host_ids.end());
  layout.host_ids.erase(std::unique(layout.host_ids.begin(), layout.host_ids.end()), layout.host_ids.end());
  layout.staged_bytes = layout.device_bytes;
  for (uint32_t id : layout.host_ids) layout.staged_bytes += base.segments[id].size;
  return layout;
}

// Writable, size-sealed copies of the base segments `ids`, made in parallel.
absl::StatusOr<std::vector<std::shared_ptr<HostSegment>>> CopyBaseSegments(const ModelGeneration& base,
                                                                           const std::vector<uint32_t>& ids) {
  const std::string& model = base.request.name;
  std::vector<std::shared_ptr<HostSegment>> copies(ids.size());
  WEIGHTD_RETURN_IF_ERROR(ParallelFor(ids.size(), [&](size_t k) -> absl::Status {
    const HostSegment& from = *base.host_segments[base.segments[ids[k]].owner];
    absl::StatusOr<std::shared_ptr<HostSegment>> copy = CopySegment(absl::StrCat(model, ":update", k), from);
    if (!copy.ok()) {
      return Annotate(copy.status(), absl::StrCat("staging a copy of segment ", ids[k], " of ", QuoteName(model)));
    }
    copies[k] = std::move(*copy);
    return absl::OkStatus();
  }));
  return copies;
}

// The device staging segment: each named device tensor gathered whole from
// every rank at its layout offset, size-sealed.
absl::StatusOr<std::shared_ptr<HostSegment>> StageDeviceTensors(const ModelGeneration& base,
                                                                const StagingLayout& layout) {
  absl::StatusOr<std::unique_ptr<HostSegment>> memory =
      HostSegment::Create(absl::StrCat(base.request.name, ":update-device"), layout.device_bytes);
  if (!memory.ok()) return Annotate(memory.status(), "staging device tensors in host memory");
  for (size_t k = 0; k < layout.device_named.size(); ++k) {
    size_t i = layout.device_named[k];
    absl::Status gathered = GatherDeviceTensor(base, i, (*memory)->writable() + layout.device_offset[k]);
    if (!gathered.ok()) return Annotate(gathered, absl::StrCat("reading tensor ", QuoteName(base.ranks[0].tensors[i].name)));
  }
  WEIGHTD_RETURN_IF_ERROR((*memory)->SealSize());
  return std::shared_ptr<HostSegment>(std::move(*memory));
}

// The writer's view of each named tensor, in staged-segment coordinates: a
// host tensor where its segment's copy holds it; a device tensor whole
// (the checkpoint tensor) in the device staging segment, the last one.
std::vector<StagedTensor> WritableTensors(const ModelGeneration& base, const std::vector<size_t>& named,
                                          const StagingLayout& layout, const std::vector<StagedSegment>& segments) {
  const std::vector<TensorRecord>& all = base.ranks[0].tensors;
  absl::flat_hash_map<uint32_t, uint32_t> staged_index;  // base id -> index into segments
  for (size_t k = 0; k < segments.size(); ++k) staged_index[segments[k].base_id] = static_cast<uint32_t>(k);
  std::vector<StagedTensor> writable;
  size_t next_device = 0;
  for (size_t i : named) {
    StagedTensor t{all[i], 0};
    if (all[i].placement == Placement::kDevice) {
      t.record.placement = Placement::kHost;
      t.record.segment = static_cast<uint32_t>(segments.size() - 1);
      t.record.offset = layout.device_offset[next_device++];
      t.record.nbytes = FullBytes(all[i], base.ranks.size());
      t.record.shape = all[i].full_shape;
      t.record.split_dim = -1;
      t.record.split_start = 0;
    } else {
      t.record.segment = staged_index.at(base.ranks[0].segments[all[i].segment]);
    }
    writable.push_back(std::move(t));
  }
  return writable;
}

// SealAndVerify's phases.

// Seals every staged memfd against writes (those sealed by an earlier try
// stay so); the first failure names its segment.
absl::Status SealStagedSegments(StagedUpdate& update, bool mlock) {
  for (size_t i = 0; i < update.segments.size(); ++i) {
    HostSegment& memory = *update.segments[i].memory;
    if (memory.sealed()) continue;
    absl::Status status = memory.Seal(mlock);
    if (!status.ok()) return Annotate(status, absl::StrCat("sealing staged segment ", i));
  }
  return absl::OkStatus();
}

// What the sealed bytes hold against the base.
struct TensorChanges {
  absl::flat_hash_map<std::string, uint64_t> new_hash;  // changed tensors: name -> content hash
  // Changed device tensors: index into the manifests, bytes in the staging segment.
  std::vector<std::pair<size_t, const char*>> device;
  uint32_t changed = 0;
};

// Hashes every tensor of a staged host segment (in parallel) and every
// named device tensor from the sealed bytes. FAILED_PRECONDITION when a
// tensor not named in the update changed (it shares a staged segment with
// one that is).
absl::StatusOr<TensorChanges> HashStagedTensors(const StagedUpdate& update) {
  const ModelGeneration& base = *update.base;
  absl::flat_hash_map<uint32_t, const HostSegment*> staged;  // base id -> sealed copy
  const HostSegment* device_staging = nullptr;
  for (const StagedSegment& s : update.segments) {
    if (s.base_id == kDeviceStaging) {
      device_staging = s.memory.get();
    } else {
      staged[s.base_id] = s.memory.get();
    }
  }
  std::vector<std::pair<const TensorRecord*, const HostSegment*>> to_hash;
  for (const TensorRecord& t : base.ranks[0].tensors) {
    if (t.placement != Placement::kHost) continue;
    auto it = staged.find(base.ranks[0].segments[t.segment]);
    if (it != staged.end()) to_hash.emplace_back(&t, it->second);
  }
  std::vector<uint64_t> hashes(to_hash.size());
  WEIGHTD_RETURN_IF_ERROR(ParallelFor(to_hash.size(), [&](size_t k) -> absl::Status {
    hashes[k] = TensorContentHash(to_hash[k].second->data() + to_hash[k].first->offset, to_hash[k].first->nbytes);
    return absl::OkStatus();
  }));
  absl::flat_hash_set<std::string> named(update.tensors.begin(), update.tensors.end());
  TensorChanges changes;
  for (size_t k = 0; k < to_hash.size(); ++k) {
    const TensorRecord& t = *to_hash[k].first;
    if (hashes[k] == t.content_hash) continue;
    if (!named.contains(t.name)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", QuoteName(t.name), " changed but is not in this update (it shares a staged segment with one that "
          "is); the update is aborted"));
    }
    changes.new_hash[t.name] = hashes[k];
    ++changes.changed;
  }
  absl::flat_hash_map<std::string, size_t> manifest_index;
  for (size_t i = 0; i < base.ranks[0].tensors.size(); ++i) manifest_index.emplace(base.ranks[0].tensors[i].name, i);
  for (const StagedTensor& w : update.writable) {
    size_t i = manifest_index.at(w.record.name);
    const TensorRecord& t = base.ranks[0].tensors[i];
    if (t.placement != Placement::kDevice) continue;
    const char* bytes = device_staging->data() + w.record.offset;
    uint64_t hash = TensorContentHash(bytes, w.record.nbytes);
    if (hash == t.content_hash) continue;
    changes.new_hash[t.name] = hash;
    changes.device.emplace_back(i, bytes);
    ++changes.changed;
  }
  return changes;
}

// Every expected hash equals the tensor's hash after the update (its new
// one, or the base's when unchanged); FAILED_PRECONDITION naming the first
// that does not.
absl::Status CheckExpectedHashes(const ModelGeneration& base, const TensorChanges& changes,
                                 const std::map<std::string, std::string>& expected_hashes) {
  for (const auto& [name, expected] : expected_hashes) {
    uint64_t actual = 0;
    if (auto it = changes.new_hash.find(name); it != changes.new_hash.end()) {
      actual = it->second;
    } else {
      for (const TensorRecord& t : base.ranks[0].tensors) {
        if (t.name == name) actual = t.content_hash;
      }
    }
    if (absl::AsciiStrToLower(expected) != ContentHashHex(actual)) {
      return absl::FailedPreconditionError(absl::StrCat("tensor ", QuoteName(name), " has content hash ",
                                                        ContentHashHex(actual), " but the writer expected ",
                                                        absl::AsciiStrToLower(expected), "; the update is aborted"));
    }
  }
  return absl::OkStatus();
}

// The base's layout, manifests and segments (all shared), labelled.
std::unique_ptr<ModelGeneration> CopyOfBase(const ModelGeneration& base, const std::string& version_label) {
  auto gen = std::make_unique<ModelGeneration>();
  gen->request = base.request;
  gen->files = base.files;
  gen->warnings = base.warnings;
  gen->host_segments = base.host_segments;
  gen->arenas = base.arenas;
  gen->segments = base.segments;
  gen->ranks = base.ranks;
  gen->tensor_count = base.tensor_count;
  gen->checkpoint_bytes = base.checkpoint_bytes;
  gen->version_label = version_label;
  gen->source = "writer";
  gen->from_files = base.from_files;  // files whose segments a commit rewrites lose their stamp (StampGeneration)
  // One copy: its host segments are the manifest's, replaced in place. More
  // copies are refused at BeginUpdate (ModelRegistry).
  if (base.numa_copies.size() == 1) gen->numa_copies = base.numa_copies;
  return gen;
}

// Puts each sealed staged host segment in place of its base segment; adds
// their ids to `replaced`.
void ReplaceStagedSegments(const StagedUpdate& update, ModelGeneration& gen, absl::flat_hash_set<uint32_t>& replaced) {
  for (const StagedSegment& s : update.segments) {
    if (s.base_id == kDeviceStaging) continue;  // uploaded by RewriteChangedArenas, then dropped with the update
    SegmentRecord& record = gen.segments[s.base_id];
    gen.host_segments[record.owner] = s.memory;
    record.fd = s.memory->fd();
    replaced.insert(s.base_id);
  }
}

// Each arena holding a changed device tensor is copied, the tensor's rank
// slices written into the copy by the daemon, and the copy sealed in place
// of the base's; the others stay shared. Adds their ids to `replaced`.
absl::Status RewriteChangedArenas(const StagedUpdate& update, const TensorChanges& changes, ModelGeneration& gen,
                                  absl::flat_hash_set<uint32_t>& replaced) {
  const ModelGeneration& base = *update.base;
  absl::flat_hash_map<uint32_t, std::shared_ptr<DeviceArena>> fresh;  // segment id -> new arena
  for (const auto& [i, bytes] : changes.device) {
    for (size_t r = 0; r < base.ranks.size(); ++r) {
      const TensorRecord& rec = base.ranks[r].tensors[i];
      uint32_t id = base.ranks[r].segments[rec.segment];
      auto it = fresh.find(id);
      if (it == fresh.end()) {
        absl::StatusOr<std::shared_ptr<DeviceArena>> copy =
            CopyArena(*update.backend, *base.arenas[base.segments[id].owner]);
        if (!copy.ok()) return Annotate(copy.status(), absl::StrCat("copying arena ", id, " for the update"));
        it = fresh.emplace(id, std::move(*copy)).first;
      }
      absl::Status written = ScatterDeviceTensor(rec, r, base.ranks.size(), bytes, *it->second);
      if (!written.ok()) return Annotate(written, absl::StrCat("writing tensor ", QuoteName(rec.name), " to rank ", r));
    }
  }
  for (auto& [id, arena] : fresh) {
    WEIGHTD_RETURN_IF_ERROR(arena->Seal());
    SegmentRecord& record = gen.segments[id];
    gen.arenas[record.owner] = arena;
    record.fd = arena->export_fd();
    record.handle = arena->export_handle();
    replaced.insert(id);
  }
  return absl::OkStatus();
}

// The new content hashes in every rank's manifest; a file with a rewritten
// segment loses its stamp, so a reload reads it again rather than share the
// writer's bytes as the file's; the byte counts and the fingerprint.
void StampGeneration(ModelGeneration& gen, const TensorChanges& changes, const absl::flat_hash_set<uint32_t>& replaced) {
  for (RankManifest& rank : gen.ranks) {
    for (TensorRecord& t : rank.tensors) {
      if (auto it = changes.new_hash.find(t.name); it != changes.new_hash.end()) t.content_hash = it->second;
    }
  }
  for (GenerationFile& f : gen.files) {
    bool rewritten = std::any_of(f.host_segments.begin(), f.host_segments.end(),
                                 [&](uint32_t id) { return replaced.contains(id); });
    for (const auto& ids : f.arenas) {
      rewritten |= std::any_of(ids.begin(), ids.end(), [&](uint32_t id) { return replaced.contains(id); });
    }
    if (rewritten) f.stamp = FileStamp{};
  }
  for (uint32_t id : replaced) gen.bytes_read += gen.segments[id].size;
  for (const SegmentRecord& record : gen.segments) gen.bytes_reused += record.size;
  gen.bytes_reused -= gen.bytes_read;
  for (const auto& segment : gen.host_segments) {
    gen.host_bytes += segment->size();
    gen.locked_bytes += segment->locked() ? segment->size() : 0;
    gen.huge_page_bytes += segment->huge_bytes();
  }
  gen.fingerprint = FingerprintOf(gen.ranks[0].tensors);
}

// Phases 3-6 of SealAndVerify, on sealed segments.
absl::StatusOr<CommitOutcome> VerifyAndBuild(const StagedUpdate& update, const CommitOptions& options) {
  WEIGHTD_RETURN_IF_ERROR(CheckUncoveredBytes(update));
  WEIGHTD_ASSIGN_OR_RETURN(TensorChanges changes, HashStagedTensors(update));
  WEIGHTD_RETURN_IF_ERROR(CheckExpectedHashes(*update.base, changes, options.expected_hashes));
  std::unique_ptr<ModelGeneration> gen = CopyOfBase(*update.base, options.version_label);
  absl::flat_hash_set<uint32_t> replaced;  // segment ids whose memory is new
  ReplaceStagedSegments(update, *gen, replaced);
  WEIGHTD_RETURN_IF_ERROR(RewriteChangedArenas(update, changes, *gen, replaced));
  StampGeneration(*gen, changes, replaced);
  return CommitOutcome{std::move(gen), changes.changed};
}

}  // namespace

absl::StatusOr<std::unique_ptr<StagedUpdate>> StageUpdate(std::shared_ptr<ModelGeneration> base,
                                                          const std::vector<std::string>& tensors,
                                                          HostMemoryAdmission* admission, DeviceBackend* backend) {
  WEIGHTD_ASSIGN_OR_RETURN(std::vector<size_t> named, NamedTensors(*base, tensors));
  WEIGHTD_ASSIGN_OR_RETURN(StagingLayout layout, LayOutStaging(*base, named, backend));
  HostMemoryAdmission::Reservation reservation;  // held until the staged memory exists
  if (admission != nullptr) {
    WEIGHTD_ASSIGN_OR_RETURN(reservation, admission->Reserve(base->request.name, layout.staged_bytes));
  }
  auto update = std::make_unique<StagedUpdate>();
  update->base = base;
  update->backend = backend;
  for (size_t i : named) update->tensors.push_back(base->ranks[0].tensors[i].name);
  WEIGHTD_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<HostSegment>> copies, CopyBaseSegments(*base, layout.host_ids));
  for (size_t k = 0; k < copies.size(); ++k) update->segments.push_back({layout.host_ids[k], std::move(copies[k])});
  if (!layout.device_named.empty()) {
    WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<HostSegment> device, StageDeviceTensors(*base, layout));
    update->segments.push_back({kDeviceStaging, std::move(device)});
  }
  update->writable = WritableTensors(*base, named, layout, update->segments);
  update->bytes_staged = layout.staged_bytes;
  for (const SegmentRecord& s : base->segments) update->bytes_shared += s.size;
  update->bytes_shared -= layout.staged_bytes - layout.device_bytes;
  return update;
}

absl::Status CheckCommitOptions(const StagedUpdate& update, const CommitOptions& options) {
  WEIGHTD_RETURN_IF_ERROR(ValidateVersionLabel(options.version_label));
  if (options.expected_hashes.size() > update.tensors.size()) {
    return absl::InvalidArgumentError(absl::StrCat(options.expected_hashes.size(), " expected hashes for an update of ",
                                                   update.tensors.size(), " tensors"));
  }
  absl::flat_hash_set<std::string> in_update(update.tensors.begin(), update.tensors.end());
  for (const auto& [name, hash] : options.expected_hashes) {
    if (!in_update.contains(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("an expected hash names tensor ", QuoteName(name), ", which is not in this update"));
    }
    if (!IsHashHex(hash)) {
      return absl::InvalidArgumentError(absl::StrCat("the expected hash of tensor ", QuoteName(name),
                                                     " must be 16 hex digits (TensorEntry.content_hash), got ",
                                                     QuoteName(hash.substr(0, 32))));
    }
  }
  return absl::OkStatus();
}

CommitAttempt SealAndVerify(StagedUpdate& update, const CommitOptions& options) {
  CommitAttempt attempt;
  if (absl::Status checked = CheckCommitOptions(update, options); !checked.ok()) {
    attempt.outcome = checked;
    return attempt;
  }
  if (absl::Status sealed = SealStagedSegments(update, options.mlock); !sealed.ok()) {
    attempt.outcome = sealed;
    return attempt;
  }
  attempt.sealed = true;
  attempt.outcome = VerifyAndBuild(update, options);
  return attempt;
}

CommitDecision DecideCommit(const CommitAttempt& attempt, bool base_still_served,
                            const std::optional<std::string>& abort_requested) {
  using Fate = CommitDecision::Fate;
  if (attempt.outcome.ok() && base_still_served) return {Fate::kPublish};
  if (abort_requested.has_value()) return {Fate::kAbort, *abort_requested};
  if (attempt.outcome.ok()) return {Fate::kAbort, "superseded"};
  const absl::Status& error = attempt.outcome.status();
  bool fixable = absl::IsInvalidArgument(error) || absl::IsFailedPrecondition(error);
  if (!attempt.sealed && base_still_served && fixable) return {Fate::kRetry};
  if (attempt.sealed) return {Fate::kAbort, "verification_failed"};
  return {Fate::kAbort, base_still_served ? "aborted_by_writer" : "superseded"};
}

}  // namespace weightd
