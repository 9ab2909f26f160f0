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

}  // namespace

absl::StatusOr<std::unique_ptr<StagedUpdate>> StageUpdate(std::shared_ptr<ModelGeneration> base,
                                                          const std::vector<std::string>& tensors,
                                                          HostMemoryAdmission* admission, DeviceBackend* backend) {
  const std::vector<TensorRecord>& all = base->ranks.at(0).tensors;
  const std::string& model = base->request.name;
  if (tensors.size() > all.size()) {
    return absl::InvalidArgumentError(absl::StrCat("the update names ", tensors.size(), " tensors but model ",
                                                   QuoteName(model), " has ", all.size()));
  }
  absl::flat_hash_map<std::string, size_t> index;
  for (size_t i = 0; i < all.size(); ++i) index.emplace(all[i].name, i);
  auto update = std::make_unique<StagedUpdate>();
  update->base = base;
  update->backend = backend;
  std::vector<size_t> named;
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
  if (tensors.empty()) {
    for (size_t i = 0; i < all.size(); ++i) named.push_back(i);
  }
  // The base segments to copy, in base id order.
  std::vector<uint32_t> ids;
  std::vector<size_t> device_named;   // staged whole in host memory (see update.h)
  std::vector<uint64_t> device_offset;  // within the device staging segment
  uint64_t device_bytes = 0;
  for (size_t i : named) {
    const TensorRecord& t = all[i];
    update->tensors.push_back(t.name);
    if (t.placement == Placement::kDevice) {
      if (backend == nullptr) {
        return absl::FailedPreconditionError(absl::StrCat("tensor ", QuoteName(t.name), " of model ", QuoteName(model),
                                                          " is on devices but this daemon has no device backend"));
      }
      device_named.push_back(i);
      device_offset.push_back(AlignUp(device_bytes, kHostAlignment));
      device_bytes = device_offset.back() + FullBytes(t, base->ranks.size());
      continue;
    }
    ids.push_back(base->ranks[0].segments[t.segment]);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  uint64_t staged = device_bytes;
  for (uint32_t id : ids) staged += base->segments[id].size;
  HostMemoryAdmission::Reservation reservation;
  if (admission != nullptr) {
    WEIGHTD_ASSIGN_OR_RETURN(reservation, admission->Reserve(model, staged));
  }
  absl::flat_hash_map<uint32_t, uint32_t> staged_index;  // base id -> index into update->segments
  std::vector<std::shared_ptr<HostSegment>> copies(ids.size());
  WEIGHTD_RETURN_IF_ERROR(ParallelFor(ids.size(), [&](size_t k) -> absl::Status {
    const HostSegment& from = *base->host_segments[base->segments[ids[k]].owner];
    absl::StatusOr<std::shared_ptr<HostSegment>> copy = CopySegment(absl::StrCat(model, ":update", k), from);
    if (!copy.ok()) return Annotate(copy.status(), absl::StrCat("staging a copy of segment ", ids[k], " of ", QuoteName(model)));
    copies[k] = std::move(*copy);
    return absl::OkStatus();
  }));
  for (size_t k = 0; k < ids.size(); ++k) {
    staged_index[ids[k]] = static_cast<uint32_t>(update->segments.size());
    update->segments.push_back({ids[k], std::move(copies[k])});
  }
  if (!device_named.empty()) {
    absl::StatusOr<std::unique_ptr<HostSegment>> memory =
        HostSegment::Create(absl::StrCat(model, ":update-device"), device_bytes);
    if (!memory.ok()) return Annotate(memory.status(), "staging device tensors in host memory");
    for (size_t k = 0; k < device_named.size(); ++k) {
      absl::Status gathered = GatherDeviceTensor(*base, device_named[k], (*memory)->writable() + device_offset[k]);
      if (!gathered.ok()) return Annotate(gathered, absl::StrCat("reading tensor ", QuoteName(all[device_named[k]].name)));
    }
    WEIGHTD_RETURN_IF_ERROR((*memory)->SealSize());
    update->segments.push_back({kDeviceStaging, std::move(*memory)});
  }
  size_t next_device = 0;
  for (size_t i : named) {
    StagedTensor t{all[i], 0};
    if (all[i].placement == Placement::kDevice) {
      // The whole checkpoint tensor, in the device staging segment (the last one).
      t.record.placement = Placement::kHost;
      t.record.segment = static_cast<uint32_t>(update->segments.size() - 1);
      t.record.offset = device_offset[next_device++];
      t.record.nbytes = FullBytes(all[i], base->ranks.size());
      t.record.shape = all[i].full_shape;
      t.record.split_dim = -1;
      t.record.split_start = 0;
    } else {
      t.record.segment = staged_index[base->ranks[0].segments[all[i].segment]];
    }
    update->writable.push_back(std::move(t));
  }
  update->bytes_staged = staged;
  for (const SegmentRecord& s : base->segments) update->bytes_shared += s.size;
  update->bytes_shared -= staged - device_bytes;
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

absl::StatusOr<CommitOutcome> SealAndVerify(StagedUpdate& update, const CommitOptions& options, bool* sealed) {
  *sealed = false;
  WEIGHTD_RETURN_IF_ERROR(CheckCommitOptions(update, options));
  const ModelGeneration& base = *update.base;
  for (size_t i = 0; i < update.segments.size(); ++i) {
    HostSegment& memory = *update.segments[i].memory;
    if (memory.sealed()) continue;  // sealed by an earlier attempt
    absl::Status status = memory.Seal(options.mlock);
    if (!status.ok()) return Annotate(status, absl::StrCat("sealing staged segment ", i));
  }
  *sealed = true;
  WEIGHTD_RETURN_IF_ERROR(CheckUncoveredBytes(update));

  // Every tensor held by a staged segment, hashed from the sealed bytes.
  absl::flat_hash_map<uint32_t, const HostSegment*> staged;  // base id -> sealed copy
  const HostSegment* device_staging = nullptr;
  for (const StagedSegment& s : update.segments) {
    if (s.base_id == kDeviceStaging) {
      device_staging = s.memory.get();
    } else {
      staged[s.base_id] = s.memory.get();
    }
  }
  absl::flat_hash_set<std::string> named(update.tensors.begin(), update.tensors.end());
  absl::flat_hash_map<std::string, uint64_t> new_hash;
  uint32_t changed = 0;
  // Every tensor of a staged segment, hashed from the sealed bytes in parallel.
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
  for (size_t k = 0; k < to_hash.size(); ++k) {
    const TensorRecord& t = *to_hash[k].first;
    if (hashes[k] == t.content_hash) continue;
    if (!named.contains(t.name)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", QuoteName(t.name), " changed but is not in this update (it shares a staged segment with one that "
          "is); the update is aborted"));
    }
    new_hash[t.name] = hashes[k];
    ++changed;
  }
  // Device tensors, whole in the device staging segment; index into the manifests.
  std::vector<std::pair<size_t, const char*>> device_changed;
  absl::flat_hash_map<std::string, size_t> manifest_index;
  for (size_t i = 0; i < base.ranks[0].tensors.size(); ++i) manifest_index.emplace(base.ranks[0].tensors[i].name, i);
  for (const StagedTensor& w : update.writable) {
    size_t i = manifest_index.at(w.record.name);
    const TensorRecord& t = base.ranks[0].tensors[i];
    if (t.placement != Placement::kDevice) continue;
    const char* bytes = device_staging->data() + w.record.offset;
    uint64_t hash = TensorContentHash(bytes, w.record.nbytes);
    if (hash == t.content_hash) continue;
    new_hash[t.name] = hash;
    device_changed.emplace_back(i, bytes);
    ++changed;
  }
  for (const auto& [name, expected] : options.expected_hashes) {
    auto it = new_hash.find(name);
    uint64_t actual = 0;
    if (it != new_hash.end()) {
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
  gen->version_label = options.version_label;
  gen->source = "writer";
  absl::flat_hash_set<uint32_t> replaced;  // segment ids whose memory is new
  for (const StagedSegment& s : update.segments) {
    if (s.base_id == kDeviceStaging) continue;  // uploaded below, then dropped with the update
    SegmentRecord& record = gen->segments[s.base_id];
    gen->host_segments[record.owner] = s.memory;
    record.fd = s.memory->fd();
    replaced.insert(s.base_id);
  }
  // Each arena holding a changed device tensor is copied and rewritten; the
  // others stay shared.
  absl::flat_hash_map<uint32_t, std::shared_ptr<DeviceArena>> fresh;  // segment id -> new arena
  for (const auto& [i, bytes] : device_changed) {
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
    SegmentRecord& record = gen->segments[id];
    gen->arenas[record.owner] = arena;
    record.fd = arena->export_fd();
    record.handle = arena->export_handle();
    replaced.insert(id);
  }
  for (uint32_t id : replaced) gen->bytes_read += gen->segments[id].size;
  for (const SegmentRecord& record : gen->segments) gen->bytes_reused += record.size;
  gen->bytes_reused -= gen->bytes_read;
  for (RankManifest& rank : gen->ranks) {
    for (TensorRecord& t : rank.tensors) {
      if (auto it = new_hash.find(t.name); it != new_hash.end()) t.content_hash = it->second;
    }
  }
  // A file with a rewritten segment no longer matches its stamp: a reload
  // must read it again rather than share the writer's bytes as the file's.
  for (GenerationFile& f : gen->files) {
    bool rewritten = std::any_of(f.host_segments.begin(), f.host_segments.end(),
                                 [&](uint32_t id) { return replaced.contains(id); });
    for (const auto& ids : f.arenas) {
      rewritten |= std::any_of(ids.begin(), ids.end(), [&](uint32_t id) { return replaced.contains(id); });
    }
    if (rewritten) f.stamp = FileStamp{};
  }
  for (const auto& segment : gen->host_segments) {
    gen->host_bytes += segment->size();
    gen->locked_bytes += segment->locked() ? segment->size() : 0;
    gen->huge_page_bytes += segment->huge_bytes();
  }
  gen->fingerprint = FingerprintOf(gen->ranks[0].tensors);
  return CommitOutcome{std::move(gen), changed};
}

}  // namespace weightd
