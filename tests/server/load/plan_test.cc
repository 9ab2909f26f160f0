// Placement and TP plans (server/load/plan.h), without reading any tensor bytes.
#include "server/load/plan.h"

#include "common/format/format_error.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

Catalog MakeCatalog(const std::vector<std::tuple<std::string, DType, std::vector<uint64_t>>>& tensors) {
  Catalog c;
  c.files.push_back({"m.safetensors", "/m.safetensors", 0, 0, 0, {}, 0, {}, nullptr});  // planning reads no file
  uint64_t offset = 0;
  for (const auto& [name, dtype, shape] : tensors) {
    uint64_t bits = DTypeBits(dtype);
    for (uint64_t d : shape) bits *= d;
    c.tensors.push_back({name, dtype, shape, 0, offset, bits / 8});
    offset += bits / 8;
  }
  c.Finish();
  return c;
}

// A catalog of several files: each tensor names its file (by index).
Catalog MakeFilesCatalog(size_t files, const std::vector<std::tuple<std::string, uint32_t, uint64_t>>& tensors) {
  Catalog c;
  for (size_t f = 0; f < files; ++f) {
    std::string name = "f" + std::to_string(f) + ".safetensors";
    c.files.push_back({name, "/" + name, 0, 0, 0, {}, 0, {}, nullptr});
  }
  std::vector<uint64_t> offsets(files);
  for (const auto& [name, file, nbytes] : tensors) {
    c.tensors.push_back({name, DType::kU8, {nbytes}, file, offsets[file], nbytes});
    offsets[file] += nbytes;
  }
  c.Finish();
  return c;
}

constexpr uint64_t kMiB = 1ull << 20;

LoadRequest Tp2(std::vector<TpRule> rules, std::vector<std::string> host = {}) {
  LoadRequest r;
  r.name = "m";
  r.tp_size = 2;
  r.tp_rules = std::move(rules);
  r.host_resident_patterns = std::move(host);
  r.devices = {"0", "1"};
  return r;
}

TEST(LoadPlan, HostOnlyPacksAt64ByteAlignment) {
  Catalog c = MakeCatalog({{"a", DType::kU8, {3}}, {"b", DType::kF32, {2}}});
  LoadRequest r;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadPlan plan, MakeLoadPlan(c, r, 0));
  EXPECT_EQ(plan.host_bytes, 64u + 8u);
  EXPECT_EQ(plan.tensors[1].host_offset, 64u);
  ASSERT_EQ(plan.ranks.size(), 1u);
  EXPECT_EQ(plan.ranks[0].tensors[1].offset, 64u);
  EXPECT_EQ(plan.ranks[0].tensors[1].segment, 0u);
  EXPECT_TRUE(plan.ranks[0].arena_bytes.empty());
}

TEST(LoadPlan, SplitsReplicatesAndKeepsHostResidentTables) {
  Catalog c = MakeCatalog({{"embed_tokens", DType::kBF16, {8, 4}},
                           {"q_proj", DType::kBF16, {4, 6}},
                           {"o_proj", DType::kBF16, {6, 4}},
                           {"norm", DType::kBF16, {4}}});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadPlan plan,
                               MakeLoadPlan(c, Tp2({{"q_proj", 0}, {"o_proj", 1}}, {"embed_tokens"}), 2));
  EXPECT_EQ(plan.host_bytes, 64u);
  EXPECT_EQ(plan.tensors[0].placement, Placement::kHost);
  for (uint32_t r = 0; r < 2; ++r) {
    const std::vector<TensorRecord>& t = plan.ranks[r].tensors;
    EXPECT_EQ(t[0].placement, Placement::kHost);
    EXPECT_EQ(t[0].segment, 0u);
    // q_proj [4, 6] split on dim 0: rank r holds rows [2r, 2r + 2).
    EXPECT_EQ(t[1].shape, (std::vector<uint64_t>{2, 6}));
    EXPECT_EQ(t[1].full_shape, (std::vector<uint64_t>{4, 6}));
    EXPECT_EQ(t[1].split_dim, 0);
    EXPECT_EQ(t[1].split_start, 2u * r);
    EXPECT_EQ(t[1].nbytes, 24u);
    EXPECT_EQ(t[1].segment, 1u);
    EXPECT_EQ(t[1].offset, 0u);
    // o_proj [6, 4] split on dim 1: [6, 2] per rank, 256-byte aligned after q_proj.
    EXPECT_EQ(t[2].shape, (std::vector<uint64_t>{6, 2}));
    EXPECT_EQ(t[2].split_dim, 1);
    EXPECT_EQ(t[2].split_start, 2u * r);
    EXPECT_EQ(t[2].offset, 256u);
    // norm is replicated whole.
    EXPECT_EQ(t[3].split_dim, -1);
    EXPECT_EQ(t[3].nbytes, 8u);
    EXPECT_EQ(t[3].offset, 512u);
  }
  EXPECT_EQ(plan.tensors[2].outer, 6u);
  EXPECT_EQ(plan.tensors[2].row_bytes, 2u);
  EXPECT_EQ(plan.ranks[0].arena_bytes, (std::vector<uint64_t>{520}));
}

TEST(LoadPlan, ArenasAreBoundedAndABigTensorGetsItsOwn) {
  Catalog c = MakeCatalog({{"a", DType::kU8, {300}}, {"b", DType::kU8, {300}}, {"c", DType::kU8, {5000}}});
  LoadRequest r = Tp2({});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadPlan plan, MakeLoadPlan(c, r, 2, /*max_arena_bytes=*/1024));
  EXPECT_EQ(plan.ranks[0].arena_bytes, (std::vector<uint64_t>{812, 5000}));
  EXPECT_EQ(plan.ranks[1].tensors[2].segment, 1u);  // no host tensors, so no host segment before the arenas
}

TEST(LoadPlan, HostSegmentsNeverMixFilesAndHoldAtMost64MiBOfASmallFile) {
  // f0 has 90 MiB of host tensors: chunks of at most max(64 MiB, 90/16 MiB) = 64 MiB.
  Catalog c = MakeFilesCatalog(2, {{"a", 0, 30 * kMiB}, {"b", 0, 30 * kMiB}, {"c", 0, 30 * kMiB}, {"d", 1, 3}});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadPlan plan, MakeLoadPlan(c, LoadRequest{}, 0));
  ASSERT_EQ(plan.host_segments.size(), 3u);
  EXPECT_EQ(plan.host_segments[0].file, 0u);
  EXPECT_EQ(plan.host_segments[0].bytes, 60 * kMiB);
  EXPECT_EQ(plan.host_segments[1].file, 0u);
  EXPECT_EQ(plan.host_segments[1].bytes, 30 * kMiB);
  EXPECT_EQ(plan.host_segments[2].file, 1u);
  EXPECT_EQ(plan.host_segments[2].bytes, 3u);
  EXPECT_EQ(plan.host_bytes, 90 * kMiB + 3);
  std::vector<std::pair<uint32_t, uint64_t>> where;
  for (const TensorPlan& t : plan.tensors) where.emplace_back(t.host_segment, t.host_offset);
  EXPECT_EQ(where, (std::vector<std::pair<uint32_t, uint64_t>>{{0, 0}, {0, 30 * kMiB}, {1, 0}, {2, 0}}));
  EXPECT_EQ(plan.ranks[0].tensors[3].segment, 2u);
}

TEST(LoadPlan, ALargeFileIsCutIntoAtMostSixteenHostSegments) {
  std::vector<std::tuple<std::string, uint32_t, uint64_t>> tensors;
  for (int i = 0; i < 64; ++i) tensors.emplace_back("t" + std::to_string(i), 0, 25 * kMiB);  // 1600 MiB
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadPlan plan, MakeLoadPlan(MakeFilesCatalog(1, tensors), LoadRequest{}, 0));
  EXPECT_EQ(HostChunkBytes(1600 * kMiB), 100 * kMiB);
  ASSERT_EQ(plan.host_segments.size(), 16u);  // 4 tensors of 25 MiB per 100 MiB chunk
  for (const HostChunk& chunk : plan.host_segments) EXPECT_EQ(chunk.bytes, 100 * kMiB);
}

TEST(LoadPlan, ArenasNeverMixFilesAndFollowTheHostSegments) {
  Catalog c = MakeFilesCatalog(2, {{"embed", 0, 100}, {"w0", 0, 10}, {"w1", 1, 20}});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadPlan plan, MakeLoadPlan(c, Tp2({}, {"embed"}), 2));
  ASSERT_EQ(plan.host_segments.size(), 1u);
  for (const RankPlan& rank : plan.ranks) {
    EXPECT_EQ(rank.arena_bytes, (std::vector<uint64_t>{10, 20}));
    EXPECT_EQ(rank.arena_file, (std::vector<uint32_t>{0, 1}));
    EXPECT_EQ(rank.tensors[0].segment, 0u);  // the host segment
    EXPECT_EQ(rank.tensors[1].segment, 1u);  // the arena of f0
    EXPECT_EQ(rank.tensors[2].segment, 2u);  // the arena of f1
  }
}

TEST(LoadPlan, RefusesRuleDimOutOfRange) {
  Catalog c = MakeCatalog({{"w", DType::kF32, {4, 4}}});
  EXPECT_THAT(MakeLoadPlan(c, Tp2({{"w", 2}}), 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "tensor 'w' of shape [4, 4], TP rule 'w:2' with tp_size 2: dim 2 is out of range for rank 2"));
}

TEST(LoadPlan, RefusesIndivisibleDim) {
  Catalog c = MakeCatalog({{"w", DType::kF32, {5, 4}}});
  EXPECT_THAT(MakeLoadPlan(c, Tp2({{"w", 0}}), 2),
              StatusIs(absl::StatusCode::kInvalidArgument, "dim 0 of size 5 is not divisible by 2"));
}

TEST(LoadPlan, RefusesSubByteSliceRows) {
  Catalog c = MakeCatalog({{"q", DType::kF4, {2, 2, 3}}});  // a row along dim 1 is 3 F4 = 12 bits
  EXPECT_THAT(MakeLoadPlan(c, Tp2({{"q", 1}}), 2),
              StatusIs(absl::StatusCode::kInvalidArgument, "a slice row of 3 x F4 is not a whole number of bytes"));
}

// The metric's label for this refusal is "sub_byte_size", as for a tensor
// that is not a whole number of bytes.
TEST(LoadPlan, SubByteSliceRowsCarryTheSubByteRule) {
  Catalog c = MakeCatalog({{"q", DType::kF4, {2, 2, 3}}});
  EXPECT_EQ(CheckpointRuleOf(MakeLoadPlan(c, Tp2({{"q", 1}}), 2).status()), CheckpointRule::kSubByteSize);
}

// A TP rule pattern (user input, any length) and a tensor name are quoted elided.
TEST(LoadPlan, QuotesALongPatternAndTensorNameElided) {
  std::string name(300, 'w');
  Catalog c = MakeCatalog({{name, DType::kF32, {4, 4}}});
  EXPECT_THAT(MakeLoadPlan(c, Tp2({{name, 2}}), 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "tensor '" + std::string(96, 'w') + "…(300 bytes)…" + std::string(96, 'w') +
                           "' of shape [4, 4], TP rule '" + std::string(96, 'w') + "…(302 bytes)…" +
                           std::string(94, 'w') + ":2' with tp_size 2: dim 2 is out of range for rank 2"));
}

TEST(LoadPlan, RefusesDeviceCountThatDisagreesWithTpSize) {
  Catalog c = MakeCatalog({{"w", DType::kF32, {4}}});
  EXPECT_THAT(MakeLoadPlan(c, Tp2({}), 3),
              StatusIs(absl::StatusCode::kInvalidArgument, "the plan has tp_size 2 but 3 device(s)"));
  LoadRequest host_only;
  host_only.tp_size = 2;
  EXPECT_THAT(MakeLoadPlan(c, host_only, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "tp_size 2 needs one device per rank"));
  LoadRequest rules_no_devices;
  rules_no_devices.tp_rules = {{"w", 0}};
  EXPECT_THAT(MakeLoadPlan(c, rules_no_devices, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "TP rules need devices"));
}

}  // namespace
}  // namespace weightd
