#include "server/update.h"

#include <xxhash.h>

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "server/loader.h"

namespace weightd {
namespace {

std::string HashHex(uint64_t hash) { return absl::StrFormat("%016x", hash); }

bool IsHashHex(const std::string& s) {
  return s.size() == 16 && std::all_of(s.begin(), s.end(), [](char c) { return absl::ascii_isxdigit(c); });
}

// Copies base segment `base` into a new, writable memfd whose size is sealed.
absl::StatusOr<std::shared_ptr<HostSegment>> CopySegment(const std::string& name, const HostSegment& base) {
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<HostSegment> copy,
                           HostSegment::Create(name, base.size(), HugePages::kNever));
  constexpr uint64_t kSlice = 16ull << 20;
  for (uint64_t at = 0; at < base.size(); at += kSlice) {
    WEIGHTD_RETURN_IF_ERROR(copy->Write(at, base.data() + at, std::min(kSlice, base.size() - at)));
  }
  WEIGHTD_RETURN_IF_ERROR(copy->SealSize());
  return std::shared_ptr<HostSegment>(std::move(copy));
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
                                    absl::StrJoin(t->full_shape, ","), std::string(1, '\0'), HashHex(t->content_hash),
                                    "\n");
    XXH3_128bits_update(state, line.data(), line.size());
  }
  XXH128_hash_t h = XXH3_128bits_digest(state);
  XXH3_freeState(state);
  return absl::StrFormat("%016x%016x", h.high64, h.low64);
}

absl::StatusOr<std::unique_ptr<StagedUpdate>> StageUpdate(std::shared_ptr<ModelGeneration> base,
                                                          const std::vector<std::string>& tensors,
                                                          HostMemoryAdmission* admission) {
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
  for (size_t i : named) {
    const TensorRecord& t = all[i];
    if (t.placement == Placement::kDevice) {
      return absl::UnimplementedError(absl::StrCat("tensor ", QuoteName(t.name), " of model ", QuoteName(model),
                                                   " is placed on devices; a writer updates host-resident tensors "
                                                   "(reload device shards from a checkpoint)"));
    }
    update->tensors.push_back(t.name);
    ids.push_back(base->ranks[0].segments[t.segment]);
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  uint64_t staged = 0;
  for (uint32_t id : ids) staged += base->segments[id].size;
  HostMemoryAdmission::Reservation reservation;
  if (admission != nullptr) {
    WEIGHTD_ASSIGN_OR_RETURN(reservation, admission->Reserve(model, staged));
  }
  absl::flat_hash_map<uint32_t, uint32_t> staged_index;  // base id -> index into update->segments
  for (uint32_t id : ids) {
    const HostSegment& from = *base->host_segments[base->segments[id].owner];
    absl::StatusOr<std::shared_ptr<HostSegment>> copy =
        CopySegment(absl::StrCat(model, ":update", update->segments.size()), from);
    if (!copy.ok()) return Annotate(copy.status(), absl::StrCat("staging a copy of segment ", id, " of ", QuoteName(model)));
    staged_index[id] = static_cast<uint32_t>(update->segments.size());
    update->segments.push_back({id, std::move(*copy)});
  }
  for (size_t i : named) {
    StagedTensor t{all[i], 0};
    t.record.segment = staged_index[base->ranks[0].segments[all[i].segment]];
    update->writable.push_back(std::move(t));
  }
  update->bytes_staged = staged;
  for (const SegmentRecord& s : base->segments) update->bytes_shared += s.size;
  update->bytes_shared -= staged;
  return update;
}

absl::Status CheckCommitOptions(const StagedUpdate& update, const CommitOptions& options) {
  const std::string& label = options.version_label;
  if (label.size() > kMaxVersionLabelBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("version label is ", label.size(), " bytes; at most ", kMaxVersionLabelBytes, " are allowed"));
  }
  for (char c : label) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError("version label may hold only printable ASCII characters");
    }
  }
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

  // Every tensor held by a staged segment, hashed from the sealed bytes.
  absl::flat_hash_map<uint32_t, const HostSegment*> staged;  // base id -> sealed copy
  for (const StagedSegment& s : update.segments) staged[s.base_id] = s.memory.get();
  absl::flat_hash_set<std::string> named(update.tensors.begin(), update.tensors.end());
  absl::flat_hash_map<std::string, uint64_t> new_hash;
  uint32_t changed = 0;
  for (const TensorRecord& t : base.ranks[0].tensors) {
    if (t.placement != Placement::kHost) continue;
    auto it = staged.find(base.ranks[0].segments[t.segment]);
    if (it == staged.end()) continue;
    uint64_t hash = TensorContentHash(it->second->data() + t.offset, t.nbytes);
    if (hash == t.content_hash) continue;
    if (!named.contains(t.name)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "tensor ", QuoteName(t.name), " changed but is not in this update (it shares a staged segment with one that "
          "is); the update is aborted"));
    }
    new_hash[t.name] = hash;
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
    if (absl::AsciiStrToLower(expected) != HashHex(actual)) {
      return absl::FailedPreconditionError(absl::StrCat("tensor ", QuoteName(name), " has content hash ",
                                                        HashHex(actual), " but the writer expected ",
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
  for (const StagedSegment& s : update.segments) {
    SegmentRecord& record = gen->segments[s.base_id];
    gen->host_segments[record.owner] = s.memory;
    record.fd = s.memory->fd();
    gen->bytes_read += s.memory->size();
  }
  gen->bytes_reused = update.bytes_shared;
  for (RankManifest& rank : gen->ranks) {
    for (TensorRecord& t : rank.tensors) {
      if (auto it = new_hash.find(t.name); it != new_hash.end()) t.content_hash = it->second;
    }
  }
  // A file with a rewritten segment no longer matches its stamp: a reload
  // must read it again rather than share the writer's bytes as the file's.
  for (GenerationFile& f : gen->files) {
    bool rewritten = std::any_of(f.host_segments.begin(), f.host_segments.end(),
                                 [&](uint32_t id) { return staged.contains(id); });
    if (rewritten) f.stamp = FileStamp{};
  }
  for (const auto& segment : gen->host_segments) {
    gen->host_bytes += segment->size();
    gen->locked_bytes += segment->locked() ? segment->size() : 0;
  }
  gen->fingerprint = FingerprintOf(gen->ranks[0].tensors);
  return CommitOutcome{std::move(gen), changed};
}

}  // namespace weightd
