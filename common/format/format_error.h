// Why a checkpoint was refused, as data rather than prose.
//
// Each rule the format and catalog code checks (safetensors.cc, catalog.cc,
// and the TP plan's whole-bytes rule) names its reason where the rule is
// checked, through CheckpointError(). The reason travels with the
// absl::Status as a payload (through Annotate, WEIGHTD_RETURN_IF_ERROR and the
// registry), so the metric weightd_checkpoint_errors_total{reason} follows
// the rule, and rewording a message never relabels it. The names are the
// metric's label values: stable, because dashboards and alerts select on
// them (docs/operations.md lists them).
#ifndef WEIGHTD_COMMON_FORMAT_FORMAT_ERROR_H_
#define WEIGHTD_COMMON_FORMAT_FORMAT_ERROR_H_

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace weightd {

enum class CheckpointRule {
  kFileTooShort,           // fewer than the 8 bytes of the header length prefix
  kHeaderTooLarge,         // header length over the format's 100,000,000-byte limit
  kHeaderPastEof,          // header length past the end of the file
  kGitLfsPointer,          // a git-LFS pointer file instead of the weights
  kForeignFormat,          // a zip (PyTorch) or pickle file
  kHeaderNotUtf8,          // header bytes are not UTF-8
  kHeaderNotJson,          // header is not one JSON object (syntax, BOM, NUL padding, a scalar)
  kTruncated,              // the data section ends before the last tensor
  kTrailingBytes,          // the data section goes on after the last tensor
  kOverlappingTensors,     // two tensors share data bytes
  kHoleBetweenTensors,     // data bytes that belong to no tensor
  kOffsetsNotFromZero,     // the first tensor does not start at data byte 0
  kBadDataOffsets,         // data_offsets end before they begin
  kUnknownDtype,           // a dtype the format does not define
  kShapeOverflow,          // element count or byte size overflows 64 bits
  kSubByteSize,            // a tensor (or TP slice row) is not a whole number of bytes
  kSizeMismatch,           // shape x dtype disagrees with data_offsets
  kNegativeValue,          // a negative dimension or data offset
  kDuplicateKey,           // a tensor name, field or __metadata__ key given twice in one header
  kDuplicateTensor,        // one tensor name in two files
  kBadMetadata,            // __metadata__ is not a map of strings to strings
  kMissingShard,           // the index names a shard file that does not exist
  kTensorAbsentFromShard,  // the index places a tensor in a shard whose header lacks it
  kShardOutsideCheckpoint, // a shard path leaves the checkpoint folder
  kBadIndex,               // model.safetensors.index.json is unusable
  kInvalid,                // any other broken rule of the format
};

// Every rule, in declaration order.
absl::Span<const CheckpointRule> AllCheckpointRules();

// The rule's stable name: "file_too_short", ..., "bad_index", and
// "invalid_checkpoint" for kInvalid.
absl::string_view CheckpointRuleName(CheckpointRule rule);

// INVALID_ARGUMENT with `message`, carrying `rule`. Pure.
absl::Status CheckpointError(CheckpointRule rule, absl::string_view message);

// `status` (any code) carrying `rule`, unless it is OK or already carries a
// rule: the first, innermost rule wins.
absl::Status WithCheckpointRule(absl::Status status, CheckpointRule rule);

// The rule `status` carries, if any.
std::optional<CheckpointRule> CheckpointRuleOf(const absl::Status& status);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FORMAT_FORMAT_ERROR_H_
