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

const std::string& EntriesEncoding(ModelGeneration& m, uint32_t rank) {
  std::call_once(m.encode_once, [&m] {
    for (const RankManifest& r : m.ranks) {
      v1::AttachResponse body;
      AddSegments(m, r, &body);
      for (const TensorRecord& t : r.tensors) ToProto(t, body.add_tensors());
      m.encoded_manifests.push_back(body.SerializeAsString());
    }
  });
  return m.encoded_manifests[rank];
}

std::shared_ptr<const std::string> PackedEncoding(ModelGeneration& m, uint32_t rank) {
  std::call_once(m.pack_once, [&m] {
    for (const RankManifest& r : m.ranks) {
      absl::StatusOr<std::string> table = PackRankTensors(r);
      if (!table.ok()) {
        LogWarning(absl::StrCat("model ", QuoteName(m.request.name), " generation ", m.generation,
                                ": packed tensor table refused (", table.status().message(),
                                "); clients get one TensorEntry per tensor"));
        m.packed_manifests.push_back(nullptr);
        continue;
      }
      v1::AttachResponse body;
      AddSegments(m, r, &body);
      body.set_packed_tensors(std::move(*table));
      m.packed_manifests.push_back(std::make_shared<const std::string>(body.SerializeAsString()));
    }
  });
  return m.packed_manifests[rank];
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
