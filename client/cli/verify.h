// Verifies a mapped model against the checkpoint files: every tensor of the
// rank must equal its checkpoint tensor, or for a shard, the slice
// [split_start, split_start + shape[split_dim]) along split_dim; or a
// mapped runtime layout against its recorded content hashes.
#ifndef WEIGHTD_CLIENT_CLI_VERIFY_H_
#define WEIGHTD_CLIENT_CLI_VERIFY_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "weightd/client.h"

namespace weightd::cli {

struct VerifyResult {
  uint64_t tensors = 0;
  uint64_t bytes = 0;
};

// DATA_LOSS naming the tensor and the first differing byte on a mismatch;
// NOT_FOUND when a mapped tensor is not in the checkpoint.
absl::StatusOr<VerifyResult> VerifyAgainstCheckpoint(const MappedModel& model, const std::string& checkpoint_dir);

// Reads every tensor of an attached runtime layout (device tensors through
// MappedModel::CopyToHost, in 16 MiB blocks), recomputes its xxh3-64
// content hash and compares it with the one the daemon recorded at commit
// (TensorInfo::content_hash). DATA_LOSS naming the tensor and both hashes
// on a mismatch.
absl::StatusOr<VerifyResult> VerifyLayoutHashes(const MappedModel& model);

}  // namespace weightd::cli

#endif  // WEIGHTD_CLIENT_CLI_VERIFY_H_
