// Attach's reply body for each rank: the segment descriptors and the tensors
// in the encoding the client asked for, serialized once per generation and
// reused by every lease (the reply prepends the per-lease header fields;
// protobuf messages concatenate).
//
//   TENSOR_ENTRIES:   AttachResponse.segments + .tensors (one TensorEntry each)
//   PACKED_TABLE_V1:  AttachResponse.segments + .packed_tensors, one byte string
//                     (common/format/packed_manifest.h; docs/api.md)
//
// The encodings are the API layer's, kept in an AttachEncodingCache beside
// the generations rather than in them: a ModelGeneration stays what the
// registry made, immutable once READY.
#ifndef WEIGHTD_SERVER_API_ATTACH_ENCODING_H_
#define WEIGHTD_SERVER_API_ATTACH_ENCODING_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "server/model/model.h"

namespace weightd {

// The encodings of the generations clients attach, built once per
// generation and encoding (on the first Attach that asks for it) and shared
// by every reply that sends them. An entry holds its generation weakly and
// goes once the generation is freed: at the next lookup, or at the next
// DropFreed (the daemon calls it from its self-check, every
// --self-check-interval-seconds), whichever comes first.
//
// Thread-safety: every method may be called from any thread; an encoding is
// built outside the cache's lock (under its own std::once_flag), so attaches
// of other generations do not wait for it.
class AttachEncodingCache {
 public:
  // Rank `rank` (< m->ranks.size()) as TENSOR_ENTRIES.
  std::shared_ptr<const std::string> Entries(const std::shared_ptr<const ModelGeneration>& m, uint32_t rank)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Rank `rank` as PACKED_TABLE_V1; null when the rank's tensors do not fit
  // a packed table (the caller then answers with Entries; logged once).
  std::shared_ptr<const std::string> Packed(const std::shared_ptr<const ModelGeneration>& m, uint32_t rank)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the entries of freed generations; returns how many.
  size_t DropFreed() ABSL_LOCKS_EXCLUDED(mu_);
  // Entries held, freed generations' included until dropped.
  size_t size() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    std::weak_ptr<const ModelGeneration> model;
    std::once_flag entries_once;
    std::vector<std::shared_ptr<const std::string>> entries;  // by rank
    std::once_flag packed_once;
    std::vector<std::shared_ptr<const std::string>> packed;  // by rank; null: does not fit
  };
  std::shared_ptr<Entry> EntryOf(const std::shared_ptr<const ModelGeneration>& m) ABSL_LOCKS_EXCLUDED(mu_);
  size_t DropFreedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::map<const ModelGeneration*, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

// The packed tensor table of one rank. INVALID_ARGUMENT when it does not fit
// (PackedManifestWriter::Finish).
absl::StatusOr<std::string> PackRankTensors(const RankManifest& rank);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_API_ATTACH_ENCODING_H_
