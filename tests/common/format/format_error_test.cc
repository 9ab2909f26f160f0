// Checkpoint errors carry their rule as data: the rule survives annotation
// and does not depend on the message's wording.
#include "common/format/format_error.h"

#include <set>
#include <string>

#include "common/base/status.h"
#include "gtest/gtest.h"

namespace weightd {
namespace {

TEST(CheckpointError, IsInvalidArgumentCarryingItsRule) {
  absl::Status status = CheckpointError(CheckpointRule::kTruncated, "any words at all");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "any words at all");
  EXPECT_EQ(CheckpointRuleOf(status), CheckpointRule::kTruncated);
}

// Regression: metrics once chose the reason by phrases of the message, so
// rewording a message (or a tensor named "truncated: x") relabelled it.
TEST(CheckpointError, TheRuleDoesNotDependOnTheMessage) {
  EXPECT_EQ(CheckpointRuleOf(CheckpointError(CheckpointRule::kUnknownDtype, "tensor 'truncated: ' appears twice")),
            CheckpointRule::kUnknownDtype);
  EXPECT_EQ(CheckpointRuleOf(absl::InvalidArgumentError("truncated: tensor 'a' ends at data byte 4")), std::nullopt);
}

TEST(CheckpointError, TheRuleSurvivesAnnotation) {
  absl::Status status = Annotate(Annotate(CheckpointError(CheckpointRule::kBadMetadata, "m"), "a.safetensors"), "load");
  EXPECT_EQ(status.message(), "load: a.safetensors: m");
  EXPECT_EQ(CheckpointRuleOf(status), CheckpointRule::kBadMetadata);
}

TEST(WithCheckpointRule, KeepsTheCodeAndTheFirstRule) {
  absl::Status denied = WithCheckpointRule(absl::PermissionDeniedError("index outside the roots"), CheckpointRule::kBadIndex);
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(CheckpointRuleOf(denied), CheckpointRule::kBadIndex);
  absl::Status inner = CheckpointError(CheckpointRule::kMissingShard, "gone");
  EXPECT_EQ(CheckpointRuleOf(WithCheckpointRule(inner, CheckpointRule::kBadIndex)), CheckpointRule::kMissingShard);
  EXPECT_TRUE(WithCheckpointRule(absl::OkStatus(), CheckpointRule::kBadIndex).ok());
  EXPECT_EQ(CheckpointRuleOf(absl::OkStatus()), std::nullopt);
}

// The names are metric label values that dashboards select on.
TEST(CheckpointRuleName, NamesEveryRuleOnceWithTheLabelsDashboardsUse) {
  std::vector<std::string> names;
  for (CheckpointRule rule : AllCheckpointRules()) names.emplace_back(CheckpointRuleName(rule));
  EXPECT_EQ(names, (std::vector<std::string>{
                       "file_too_short", "header_too_large", "header_past_eof", "git_lfs_pointer", "foreign_format",
                       "header_not_utf8", "header_not_json", "truncated", "trailing_bytes", "overlapping_tensors",
                       "hole_between_tensors", "offsets_not_from_zero", "bad_data_offsets", "unknown_dtype",
                       "shape_overflow", "sub_byte_size", "size_mismatch", "negative_value", "duplicate_key",
                       "duplicate_tensor", "bad_metadata", "missing_shard", "tensor_absent_from_shard",
                       "shard_outside_checkpoint", "bad_index", "invalid_checkpoint"}));
  for (CheckpointRule rule : AllCheckpointRules()) {
    EXPECT_EQ(CheckpointRuleOf(CheckpointError(rule, "m")), rule) << CheckpointRuleName(rule);
  }
}

}  // namespace
}  // namespace weightd
