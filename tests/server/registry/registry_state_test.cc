// The states ListAll() shows besides READY and DRAINING: a load in flight is
// LOADING with its bytes, a load refused before its plan leaves nothing, and
// a cancelled load is FAILED (tests/server/registry/registry_fault_test.cc covers
// failures of the disk).
#include <tuple>

#include "gtest/gtest.h"
#include "tests/server/registry/registry_fixture.h"
#include "server/metrics/metrics.h"
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
  EXPECT_EQ(listener_.failures().size(), 3u);  // the missing path too: every refusal is reported
}

// Every refused load is reported to the listener once (a log line and a
// counted reason in the daemon), however early it was refused: before, the
// refusals before the catalog (path, root, name, a load of the name running,
// a reload of no model) left no trace in the log or the metrics.
TEST_F(RegistryTest, EveryRefusalBeforeTheCatalogIsReportedWithItsReason) {
  ::weightd::testing::TempDir elsewhere;
  std::string outside = ::weightd::registry_test::MakeDir(elsewhere.Join("ck"));
  Checkpoint("ck", 1);
  EXPECT_THAT(Load("m", "no-such-model"), StatusIs(Code::kNotFound, "no-such-model"));
  EXPECT_THAT(Load("m", outside), StatusIs(Code::kPermissionDenied, "outside every --model-root"));
  EXPECT_THAT(Load("bad name\n", "ck"), StatusIs(Code::kInvalidArgument, "may hold only letters"));
  EXPECT_THAT(Load("m", ""), StatusIs(Code::kInvalidArgument, "checkpoint path is empty"));
  EXPECT_THAT(registry_.Reload("nothing", "", nullptr), StatusIs(Code::kNotFound, "nothing"));
  absl::Status nested;
  LoadRequest request;
  request.name = "m";
  request.checkpoint_path = "ck";
  WEIGHTD_ASSERT_OK(registry_.Load(request, [&](const LoadProgress&) {
    if (nested.ok()) nested = Load("m", "ck").status();  // the same name while its load runs
  }));
  EXPECT_THAT(nested, StatusIs(Code::kAlreadyExists, "model 'm' is already being loaded"));
  registry_.RefuseLoad(request, absl::InvalidArgumentError("checkpoint path is longer than 4096 bytes"));

  std::vector<std::string> reasons;
  for (const absl::Status& s : listener_.failures()) reasons.push_back(CheckpointErrorReason(s));
  EXPECT_THAT(reasons, ElementsAre("not_found", "permission_denied", "invalid_request", "invalid_request", "not_found",
                                   "already_loading", "invalid_request"));
  ModelRegistry no_roots(RegistryOptions{}, &listener_);
  EXPECT_THAT(Load("m", "ck", &no_roots), StatusIs(Code::kPermissionDenied, "no --model-root"));
  ASSERT_EQ(listener_.failures().size(), 8u);
  EXPECT_EQ(CheckpointErrorReason(listener_.failures().back()), "permission_denied");
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
