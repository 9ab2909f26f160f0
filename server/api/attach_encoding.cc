#include "server/api/attach_encoding.h"

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/format/packed_manifest.h"
#include "server/api/convert.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {
namespace {

void AddSegments(const ModelGeneration& m, const RankManifest& rank, v1::AttachResponse* out) {
  for (uint32_t s = 0; s < rank.segments.size(); ++s) ToProto(m.segments[rank.segments[s]], s, out->add_segments());
}

}  // namespace

size_t AttachEncodingCache::DropFreedLocked() {
  return std::erase_if(entries_, [](const auto& e) { return e.second->model.expired(); });
}

size_t AttachEncodingCache::DropFreed() {
  absl::MutexLock lock(&mu_);
  return DropFreedLocked();
}

size_t AttachEncodingCache::size() {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

std::shared_ptr<AttachEncodingCache::Entry> AttachEncodingCache::EntryOf(
    const std::shared_ptr<const ModelGeneration>& m) {
  absl::MutexLock lock(&mu_);
  DropFreedLocked();  // also an entry whose generation's address `m` now reuses
  std::shared_ptr<Entry>& entry = entries_[m.get()];
  if (entry == nullptr) {
    entry = std::make_shared<Entry>();
    entry->model = m;
  }
  return entry;
}

std::shared_ptr<const std::string> AttachEncodingCache::Entries(const std::shared_ptr<const ModelGeneration>& m,
                                                                uint32_t rank) {
  std::shared_ptr<Entry> entry = EntryOf(m);
  std::call_once(entry->entries_once, [&] {
    for (const RankManifest& r : m->ranks) {
      v1::AttachResponse body;
      AddSegments(*m, r, &body);
      for (const TensorRecord& t : r.tensors) ToProto(t, body.add_tensors());
      entry->entries.push_back(std::make_shared<const std::string>(body.SerializeAsString()));
    }
  });
  return entry->entries[rank];
}

std::shared_ptr<const std::string> AttachEncodingCache::Packed(const std::shared_ptr<const ModelGeneration>& m,
                                                               uint32_t rank) {
  std::shared_ptr<Entry> entry = EntryOf(m);
  std::call_once(entry->packed_once, [&] {
    for (const RankManifest& r : m->ranks) {
      absl::StatusOr<std::string> table = PackRankTensors(r);
      if (!table.ok()) {
        LogWarning(absl::StrCat("model ", QuoteName(m->request.name), " generation ", m->generation,
                                ": packed tensor table refused (", table.status().message(),
                                "); clients get one TensorEntry per tensor"));
        entry->packed.push_back(nullptr);
        continue;
      }
      v1::AttachResponse body;
      AddSegments(*m, r, &body);
      body.set_packed_tensors(std::move(*table));
      entry->packed.push_back(std::make_shared<const std::string>(body.SerializeAsString()));
    }
  });
  return entry->packed[rank];
}

absl::StatusOr<std::string> PackRankTensors(const RankManifest& rank) {
  PackedManifestWriter writer;
  for (const TensorRecord& t : rank.tensors) {
    writer.Add({t.name, DTypeName(t.dtype), t.shape, t.full_shape,
                t.placement == Placement::kHost ? kPackedPlacementHost : kPackedPlacementDevice, t.segment, t.offset,
                t.nbytes, t.split_dim, t.split_start, t.content_hash});
  }
  return writer.Finish();
}

}  // namespace weightd
