#include "common/format/format_error.h"

#include <array>
#include <iterator>

#include "absl/strings/cord.h"

namespace weightd {
namespace {

// The payload's type URL: absl keys payloads by a URL that names their type.
constexpr absl::string_view kRulePayload = "type.weightd.dev/weightd.CheckpointRule";

struct RuleName {
  CheckpointRule rule;
  absl::string_view name;
};
constexpr RuleName kRules[] = {
    {CheckpointRule::kFileTooShort, "file_too_short"},
    {CheckpointRule::kHeaderTooLarge, "header_too_large"},
    {CheckpointRule::kHeaderPastEof, "header_past_eof"},
    {CheckpointRule::kGitLfsPointer, "git_lfs_pointer"},
    {CheckpointRule::kForeignFormat, "foreign_format"},
    {CheckpointRule::kHeaderNotUtf8, "header_not_utf8"},
    {CheckpointRule::kHeaderNotJson, "header_not_json"},
    {CheckpointRule::kTruncated, "truncated"},
    {CheckpointRule::kTrailingBytes, "trailing_bytes"},
    {CheckpointRule::kOverlappingTensors, "overlapping_tensors"},
    {CheckpointRule::kHoleBetweenTensors, "hole_between_tensors"},
    {CheckpointRule::kOffsetsNotFromZero, "offsets_not_from_zero"},
    {CheckpointRule::kBadDataOffsets, "bad_data_offsets"},
    {CheckpointRule::kUnknownDtype, "unknown_dtype"},
    {CheckpointRule::kShapeOverflow, "shape_overflow"},
    {CheckpointRule::kSubByteSize, "sub_byte_size"},
    {CheckpointRule::kSizeMismatch, "size_mismatch"},
    {CheckpointRule::kNegativeValue, "negative_value"},
    {CheckpointRule::kDuplicateKey, "duplicate_key"},
    {CheckpointRule::kDuplicateTensor, "duplicate_tensor"},
    {CheckpointRule::kBadMetadata, "bad_metadata"},
    {CheckpointRule::kMissingShard, "missing_shard"},
    {CheckpointRule::kTensorAbsentFromShard, "tensor_absent_from_shard"},
    {CheckpointRule::kShardOutsideCheckpoint, "shard_outside_checkpoint"},
    {CheckpointRule::kBadIndex, "bad_index"},
    {CheckpointRule::kInvalid, "invalid_checkpoint"},
};
constexpr size_t kRuleCount = std::size(kRules);
constexpr bool InDeclarationOrder() {
  for (size_t i = 0; i < kRuleCount; ++i) {
    if (kRules[i].rule != static_cast<CheckpointRule>(i)) return false;
  }
  return static_cast<size_t>(CheckpointRule::kInvalid) + 1 == kRuleCount;
}
static_assert(InDeclarationOrder(), "kRules names every CheckpointRule once, in declaration order");

constexpr auto MakeAllRules() {
  std::array<CheckpointRule, kRuleCount> all{};
  for (size_t i = 0; i < kRuleCount; ++i) all[i] = kRules[i].rule;
  return all;
}
constexpr std::array<CheckpointRule, kRuleCount> kAllRules = MakeAllRules();

}  // namespace

absl::Span<const CheckpointRule> AllCheckpointRules() { return kAllRules; }

absl::string_view CheckpointRuleName(CheckpointRule rule) {
  return kRules[static_cast<size_t>(rule)].name;
}

absl::Status CheckpointError(CheckpointRule rule, absl::string_view message) {
  return WithCheckpointRule(absl::InvalidArgumentError(message), rule);
}

absl::Status WithCheckpointRule(absl::Status status, CheckpointRule rule) {
  if (status.ok() || status.GetPayload(kRulePayload).has_value()) return status;
  status.SetPayload(kRulePayload, absl::Cord(CheckpointRuleName(rule)));
  return status;
}

std::optional<CheckpointRule> CheckpointRuleOf(const absl::Status& status) {
  auto payload = status.GetPayload(kRulePayload);  // absl::optional, not std:: in Debian's Abseil
  if (!payload) return std::nullopt;
  for (const RuleName& r : kRules) {
    if (*payload == r.name) return r.rule;
  }
  return std::nullopt;
}

}  // namespace weightd
