// The registration plan for pinned host tensors (common/memory/pin_plan.h):
// exact chunk boundaries for each of its rules.
#include "common/memory/pin_plan.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::FieldsAre;

constexpr uint64_t kPage = kPinPageBytes;
constexpr uint64_t kMiB = uint64_t{1} << 20;

// (segment, offset, bytes, tensors) of each chunk.
std::vector<std::tuple<uint32_t, uint64_t, uint64_t, std::vector<size_t>>> Chunks(const PinPlan& plan) {
  std::vector<std::tuple<uint32_t, uint64_t, uint64_t, std::vector<size_t>>> out;
  for (const PinChunk& c : plan.chunks) out.emplace_back(c.segment, c.offset, c.bytes, c.tensors);
  return out;
}

TEST(PinPlan, TensorsSharingAPageAreOneRegistration) {
  // [0, 100) and [128, 5000) share page 0: one range of two pages.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PinPlan plan, PlanPinChunks({{"a", 0, 0, 100}, {"b", 0, 128, 4872}}, {8192}, kMiB));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, 0, 2 * kPage, std::vector<size_t>{0, 1})));
  EXPECT_THAT(plan.chunk_of, ElementsAre(0, 0));
  EXPECT_EQ(plan.bytes, 2 * kPage);
}

TEST(PinPlan, PagesNoPinnedTensorCoversAreNotRegistered) {
  // Page 1 holds only an unpinned tensor: the two pinned ones stay apart.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PinPlan plan, PlanPinChunks({{"a", 0, 0, 10}, {"b", 0, 2 * kPage, 8}}, {3 * kPage}, kMiB));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, 0, kPage, std::vector<size_t>{0}),
                                        FieldsAre(0, 2 * kPage, kPage, std::vector<size_t>{1})));
  EXPECT_EQ(plan.bytes, 2 * kPage);
}

TEST(PinPlan, ContiguousTensorsAreCutAtTheBoundBetweenTensors) {
  // Three 1 MiB tensors back to back, bound 2 MiB: two of them, then one.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      PinPlan plan, PlanPinChunks({{"a", 0, 0, kMiB}, {"b", 0, kMiB, kMiB}, {"c", 0, 2 * kMiB, kMiB}}, {3 * kMiB}, 2 * kMiB));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, 0, 2 * kMiB, std::vector<size_t>{0, 1}),
                                        FieldsAre(0, 2 * kMiB, kMiB, std::vector<size_t>{2})));
  EXPECT_THAT(plan.chunk_of, ElementsAre(0, 0, 1));
}

TEST(PinPlan, ATensorLargerThanTheBoundIsARegistrationOfItsOwn) {
  // A small tensor in page 0, then a 3 MiB one right after it, bound 1 MiB.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      PinPlan plan, PlanPinChunks({{"small", 0, 0, 100}, {"big", 0, kPage, 3 * kMiB}, {"after", 0, kPage + 3 * kMiB, 8}},
                                  {4 * kMiB}, kMiB));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, 0, kPage, std::vector<size_t>{0}),
                                        FieldsAre(0, kPage, 3 * kMiB, std::vector<size_t>{1}),
                                        FieldsAre(0, kPage + 3 * kMiB, kPage, std::vector<size_t>{2})));
}

TEST(PinPlan, TensorsSharingAPageAreNeverSplitEvenPastTheBound) {
  // [0, 6000) and [6000, 9000) share page 1: three pages in one range,
  // although the bound is one page.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PinPlan plan, PlanPinChunks({{"a", 0, 0, 6000}, {"b", 0, 6000, 3000}}, {9000}, kPage));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, 0, 3 * kPage, std::vector<size_t>{0, 1})));
}

TEST(PinPlan, ATensorStraddlingAPageBoundaryCoversBothPages) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PinPlan plan, PlanPinChunks({{"a", 0, 4000, 200}}, {8192}, kMiB));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, 0, 2 * kPage, std::vector<size_t>{0})));
}

TEST(PinPlan, TheLastPageOfASegmentIsRegisteredWhole) {
  // The mapping of a 5000-byte segment covers two whole pages.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PinPlan plan, PlanPinChunks({{"tail", 0, kPage, 904}}, {5000}, kMiB));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, kPage, kPage, std::vector<size_t>{0})));
}

TEST(PinPlan, ChunksNeverSpanTwoSegments) {
  // Same offsets in two segments, listed out of order: one range each, by segment.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PinPlan plan, PlanPinChunks({{"b", 1, 0, kPage}, {"a", 0, 0, kPage}}, {kPage, kPage}, kMiB));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, 0, kPage, std::vector<size_t>{1}),
                                        FieldsAre(1, 0, kPage, std::vector<size_t>{0})));
  EXPECT_THAT(plan.chunk_of, ElementsAre(1, 0));
}

TEST(PinPlan, ZeroByteTensorsNeedNoRegistration) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PinPlan plan, PlanPinChunks({{"empty", 0, 64, 0}, {"a", 0, 0, 64}}, {kPage}, kMiB));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, 0, kPage, std::vector<size_t>{1})));
  EXPECT_THAT(plan.chunk_of, ElementsAre(-1, 0));
}

TEST(PinPlan, TheBoundIsRoundedDownToWholePages) {
  // Bound 10000 bytes = two pages: three one-page tensors give 2 + 1.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      PinPlan plan, PlanPinChunks({{"a", 0, 0, kPage}, {"b", 0, kPage, kPage}, {"c", 0, 2 * kPage, kPage}}, {3 * kPage},
                                  10000));
  EXPECT_THAT(Chunks(plan), ElementsAre(FieldsAre(0, 0, 2 * kPage, std::vector<size_t>{0, 1}),
                                        FieldsAre(0, 2 * kPage, kPage, std::vector<size_t>{2})));
}

TEST(PinPlan, BoundsOutsideOnePageTo64GiBAreRefused) {
  EXPECT_THAT(PlanPinChunks({}, {}, kPage - 1), StatusIs(absl::StatusCode::kInvalidArgument, "pin chunk size 4095 is outside"));
  EXPECT_THAT(PlanPinChunks({}, {}, kMaxPinChunkBytes + 1),
              StatusIs(absl::StatusCode::kInvalidArgument, "pin chunk size 68719476737 is outside [4096, 68719476736]"));
  WEIGHTD_EXPECT_OK(PlanPinChunks({}, {}, kMaxPinChunkBytes));
}

TEST(PinPlan, ATensorOutsideItsSegmentIsNamed) {
  EXPECT_THAT(PlanPinChunks({{"w", 0, 4000, 200}}, {4096}, kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "pinned tensor 'w' (200 bytes at offset 4000) lies outside segment 0"));
  EXPECT_THAT(PlanPinChunks({{"w", 3, 0, 1}}, {4096}, kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument, "lies outside segment 3"));
  // No overflow with offsets near 2^64.
  EXPECT_THAT(PlanPinChunks({{"w", 0, UINT64_MAX, 2}}, {4096}, kMiB),
              StatusIs(absl::StatusCode::kInvalidArgument, "lies outside segment 0"));
}

TEST(PinPlan, ChunksAreDescribedByRangeAndFirstTensor) {
  std::vector<PinTensor> tensors = {{"a", 2, 0, 10}, {"b", 2, 10, 10}, {"c", 2, 20, 10}};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PinPlan plan, PlanPinChunks(tensors, {0, 0, kPage}, kMiB));
  EXPECT_EQ(DescribePinChunk(plan, 0, tensors), "segment 2 bytes [0, 4096) holding 'a' and 2 more");
}

}  // namespace
}  // namespace weightd
