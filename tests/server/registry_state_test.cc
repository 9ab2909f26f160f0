// The states ListAll() shows besides READY and DRAINING: a load in flight is
// LOADING with its bytes, a load refused before its plan leaves nothing, and
// a cancelled load is FAILED (tests/server/registry_fault_test.cc covers
// failures of the disk).
#include <tuple>

#include "gtest/gtest.h"
#include "tests/server/registry_fixture.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::weightd::registry_test::RegistryTest;
using Code = absl::StatusCode;

// What ListAll() showed of a load at one progress report.
struct Seen {
  size_t listed;
  ModelState state;
  uint64_t generation, bytes_done, bytes_total;
  bool in_list;
  absl::Status get;
};

TEST_F(RegistryTest, LoadInFlightIsListedAsLoadingWithItsBytes) {
  Checkpoint("ck", 1);
  std::vector<Seen> seen;
  LoadRequest request;
  request.name = "m";
  request.checkpoint_path = "ck";
  auto progress = [&](const LoadProgress& p) {
    if (p.phase != LoadProgress::Phase::kRead) return;
    std::vector<std::shared_ptr<ModelGeneration>> all = registry_.ListAll();
    if (all.empty()) return seen.push_back(Seen{0, ModelState::kReady, 0, 0, 0, false, absl::OkStatus()});
    const ModelGeneration& m = *all[0];
    seen.push_back(Seen{all.size(), m.state.load(), m.generation, m.bytes_done.load(), m.bytes_total.load(),
                        !registry_.List().empty(), registry_.Get("m").status()});
  };
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, registry_.Load(request, progress));
  ASSERT_GE(seen.size(), 2u);
  for (const Seen& s : {seen.front(), seen.back()}) {
    EXPECT_EQ(s.listed, 1u);
    EXPECT_EQ(s.state, ModelState::kLoading);
    EXPECT_EQ(s.generation, 0u);
    EXPECT_EQ(s.bytes_total, 27u);  // 16 + 3 + 8 tensor bytes
    EXPECT_FALSE(s.in_list);        // List() shows only generations that hold memory
    EXPECT_THAT(s.get, StatusIs(Code::kFailedPrecondition, "model 'm' is still loading"));
  }
  EXPECT_EQ(seen.front().bytes_done, 0u);
  EXPECT_EQ(seen.back().bytes_done, 27u);
  std::vector<std::shared_ptr<ModelGeneration>> after = registry_.ListAll();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0], loaded.model);
  EXPECT_EQ(after[0]->state.load(), ModelState::kReady);
}

TEST_F(RegistryTest, RequestRefusedBeforeItsPlanLeavesNoRecord) {
  ::weightd::testing::WriteFile(root_.Join("broken.safetensors"), ::weightd::testing::FileImage("not json", ""));
  EXPECT_THAT(Load("m", "no-such-model"), StatusIs(Code::kNotFound, "no-such-model"));
  EXPECT_THAT(Load("m", "broken.safetensors"), StatusIs(Code::kInvalidArgument, "broken.safetensors"));
  LoadRequest request;
  request.name = "m";
  request.checkpoint_path = Checkpoint("ck", 1);
  request.devices = {"GPU-00000000-0000-0000-0000-000000000000"};
  EXPECT_THAT(registry_.Load(request, nullptr), StatusIs(Code::kInvalidArgument, "no device backend"));
  EXPECT_TRUE(registry_.ListAll().empty());
  EXPECT_EQ(listener_.failures().size(), 2u);  // the path was refused before any load began
}

TEST_F(RegistryTest, CancelledLoadIsListedAsFailed) {
  registry_.CancelLoads();
  EXPECT_THAT(Load("m", Checkpoint("ck", 1)), StatusIs(Code::kUnavailable, "load cancelled"));
  std::vector<std::shared_ptr<ModelGeneration>> all = registry_.ListAll();
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0]->state.load(), ModelState::kFailed);
  EXPECT_EQ(all[0]->error, "UNAVAILABLE: load cancelled: weightd is shutting down");
  EXPECT_EQ(all[0]->bytes_total.load(), 27u);
  EXPECT_EQ(all[0]->bytes_done.load(), 0u);
}

}  // namespace
}  // namespace weightd
