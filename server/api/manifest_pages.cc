#include "server/api/manifest_pages.h"

#include <google/protobuf/wire_format_lite.h>

#include <algorithm>

#include "server/api/convert.h"

namespace weightd {
namespace {

// Bytes `entry` adds to a ManifestPage: the tag of field 6, the length, the message.
size_t EncodedEntryBytes(const v1::TensorEntry& entry) {
  return 1 + google::protobuf::internal::WireFormatLite::LengthDelimitedSize(entry.ByteSizeLong());
}

}  // namespace

uint32_t ManifestPageTensors(uint32_t requested) {
  if (requested == 0) return kDefaultManifestPageTensors;
  return std::min(requested, kMaxManifestPageTensors);
}

size_t FillManifestPage(const ModelGeneration& m, uint32_t rank, size_t first, uint32_t max_tensors,
                        v1::ManifestPage* page) {
  const RankManifest& r = m.ranks[rank];
  page->set_model(m.request.name);
  page->set_generation(m.generation);
  page->set_rank(rank);
  page->set_fingerprint(m.fingerprint);
  page->set_version_label(m.version_label);
  page->set_total_tensors(static_cast<uint32_t>(r.tensors.size()));
  if (first == 0) {
    for (uint32_t s = 0; s < r.segments.size(); ++s) ToProto(m.segments[r.segments[s]], s, page->add_segments());
  }
  size_t bytes = page->ByteSizeLong();
  size_t i = first;
  for (; i < r.tensors.size() && static_cast<uint32_t>(page->tensors_size()) < max_tensors; ++i) {
    v1::TensorEntry entry;
    ToProto(r.tensors[i], &entry);
    size_t n = EncodedEntryBytes(entry);
    if (page->tensors_size() > 0 && bytes + n > kMaxManifestPageBytes) break;
    bytes += n;
    page->add_tensors()->Swap(&entry);
  }
  return i;
}

}  // namespace weightd
