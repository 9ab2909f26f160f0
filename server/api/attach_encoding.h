// Attach's reply body for each rank: the segment descriptors and the tensors
// in the encoding the client asked for, serialized once per generation and
// reused by every lease (the reply prepends the per-lease header fields;
// protobuf messages concatenate).
//
//   TENSOR_ENTRIES:   AttachResponse.segments + .tensors (one TensorEntry each)
//   PACKED_TABLE_V1:  AttachResponse.segments + .packed_tensors, one byte string
//                     (common/format/packed_manifest.h; docs/api.md)
//
// Thread-safety: any thread; each encoding is built under its own
// std::once_flag of the generation.
#ifndef WEIGHTD_SERVER_API_ATTACH_ENCODING_H_
#define WEIGHTD_SERVER_API_ATTACH_ENCODING_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/model/model.h"

namespace weightd {

// Rank `rank` (< m.ranks.size()) as TENSOR_ENTRIES; owned by `m`.
const std::string& EntriesEncoding(ModelGeneration& m, uint32_t rank);

// Rank `rank` as PACKED_TABLE_V1, shared so that a reply can hold it without
// a copy; null when the rank's tensors do not fit a packed table (the caller
// then answers with EntriesEncoding).
std::shared_ptr<const std::string> PackedEncoding(ModelGeneration& m, uint32_t rank);

// The packed tensor table of one rank. INVALID_ARGUMENT when it does not fit
// (PackedManifestWriter::Finish).
absl::StatusOr<std::string> PackRankTensors(const RankManifest& rank);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_API_ATTACH_ENCODING_H_
