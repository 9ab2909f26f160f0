// ModelRegistry leases: attach, claim, release, expiry, and how unloads and
// reloads drain leased generations.
#include "gtest/gtest.h"
#include "tests/server/registry/registry_fixture.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;
using ::weightd::registry_test::RegistryTest;
using Code = absl::StatusCode;

TEST_F(RegistryTest, LeaseLifecycleAttachClaimRelease) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::Grant grant, registry_.Attach("m", 0));
  EXPECT_EQ(grant.lease_id.size(), 32u);
  EXPECT_EQ(grant.lease_id.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(grant.model, loaded.model);
  EXPECT_EQ(grant.rank, 0u);
  EXPECT_EQ(loaded.model->leases.load(), 1);
  EXPECT_TRUE(registry_.IsLeaseLive(grant.lease_id));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::Grant claimed, registry_.Claim(grant.lease_id));
  EXPECT_EQ(claimed.model, loaded.model);
  EXPECT_THAT(registry_.Claim(grant.lease_id), StatusIs(Code::kFailedPrecondition, "already claimed"));
  registry_.Release(grant.lease_id);
  EXPECT_FALSE(registry_.IsLeaseLive(grant.lease_id));
  EXPECT_EQ(loaded.model->leases.load(), 0);
  EXPECT_THAT(registry_.Claim(grant.lease_id), StatusIs(Code::kNotFound, "unknown or expired"));
  EXPECT_THAT(registry_.Detach(grant.lease_id), StatusIs(Code::kNotFound, "unknown or expired"));
  EXPECT_THAT(registry_.Claim("0123456789abcdef0123456789abcdef"), StatusIs(Code::kNotFound, "lease"));
  EXPECT_THAT(listener_.leases(), ElementsAre(Pair("m", 1), Pair("m", 0)));
}

TEST_F(RegistryTest, UnloadWithLeasesDrainsUntilLastRelease) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto pending, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto active, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry_.Claim(active.lease_id));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_.Unload("m", /*force=*/false));
  EXPECT_FALSE(unloaded.freed);
  EXPECT_EQ(loaded.model->state.load(), ModelState::kDraining);
  ASSERT_EQ(registry_.List().size(), 1u);
  EXPECT_EQ(registry_.List()[0]->state.load(), ModelState::kDraining);
  EXPECT_THAT(registry_.Attach("m", 0), StatusIs(Code::kNotFound, "'m'"));
  registry_.Release(pending.lease_id);
  EXPECT_EQ(registry_.List().size(), 1u);
  WEIGHTD_EXPECT_OK(registry_.Detach(active.lease_id));
  EXPECT_TRUE(registry_.List().empty());
  EXPECT_THAT(listener_.serving(), ElementsAre(Pair("m", true), Pair("m", false)));
  EXPECT_THAT(registry_.Unload("m", false), StatusIs(Code::kNotFound, "no model named 'm'"));
}

TEST_F(RegistryTest, UnloadWithoutLeasesFreesAtOnce) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_.Unload("m", false));
  EXPECT_TRUE(unloaded.freed);
  EXPECT_TRUE(registry_.List().empty());
}

// Regression: a DRAINING generation could not be force-unloaded (NOT_FOUND).
TEST_F(RegistryTest, ForceUnloadEndsLeasesOfADrainingGeneration) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto first, registry_.Unload("m", false));
  EXPECT_FALSE(first.freed);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto again, registry_.Unload("m", false));  // unchanged, still draining
  EXPECT_FALSE(again.freed);
  EXPECT_EQ(again.model->state.load(), ModelState::kDraining);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto forced, registry_.Unload("m", true));
  EXPECT_TRUE(forced.freed);
  EXPECT_FALSE(registry_.IsLeaseLive(lease.lease_id));
  EXPECT_TRUE(registry_.List().empty());
}

TEST_F(RegistryTest, CancelledLoadsFailUnavailableAndLeaveNothing) {
  registry_.CancelLoads();
  EXPECT_THAT(Load("m", Checkpoint("ck", 1)), StatusIs(Code::kUnavailable, "load cancelled: weightd is shutting down"));
  EXPECT_TRUE(registry_.List().empty());
}

TEST_F(RegistryTest, ForceUnloadRevokesLeases) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto pending, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto active, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry_.Claim(active.lease_id));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_.Unload("m", /*force=*/true));
  EXPECT_TRUE(unloaded.freed);
  EXPECT_FALSE(registry_.IsLeaseLive(pending.lease_id));
  EXPECT_FALSE(registry_.IsLeaseLive(active.lease_id));
  EXPECT_EQ(unloaded.model->leases.load(), 0);
  EXPECT_TRUE(registry_.List().empty());
}

TEST_F(RegistryTest, ExpirePendingDropsOnlyUnclaimedLeases) {
  ModelRegistry registry(Options(std::chrono::milliseconds(50)), nullptr);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, Load("m", Checkpoint("ck", 1), &registry));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto pending, registry.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto active, registry.Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry.Claim(active.lease_id));
  clock_.Advance(std::chrono::milliseconds(100));
  EXPECT_EQ(registry.ExpirePending(), 1);
  EXPECT_FALSE(registry.IsLeaseLive(pending.lease_id));
  EXPECT_TRUE(registry.IsLeaseLive(active.lease_id));
  EXPECT_EQ(loaded.model->leases.load(), 1);
  EXPECT_EQ(registry.ExpirePending(), 0);
  EXPECT_THAT(registry.Claim(pending.lease_id), StatusIs(Code::kNotFound, "expired"));
}

TEST_F(RegistryTest, NewCheckpointUnderLeasedNameDrainsOldGeneration) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto first, Load("m", Checkpoint("ck1", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto second, Load("m", Checkpoint("ck2", 2)));
  EXPECT_FALSE(second.reused);
  std::vector<std::shared_ptr<ModelGeneration>> listed = registry_.List();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0]->generation, 2u);
  EXPECT_EQ(listed[0]->state.load(), ModelState::kReady);
  EXPECT_EQ(listed[0]->fingerprint, second.model->fingerprint);
  EXPECT_EQ(listed[1]->generation, 1u);
  EXPECT_EQ(listed[1]->state.load(), ModelState::kDraining);
  EXPECT_EQ(listed[1]->fingerprint, first.model->fingerprint);
  EXPECT_NE(listed[0]->fingerprint, listed[1]->fingerprint);
  registry_.Release(lease.lease_id);
  ASSERT_EQ(registry_.List().size(), 1u);
  EXPECT_EQ(registry_.List()[0]->generation, 2u);
  EXPECT_THAT(listener_.serving(), ElementsAre(Pair("m", true), Pair("m", true)));
}

TEST_F(RegistryTest, RankOutOfRangeIsInvalidArgument) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("ck", 1)));
  EXPECT_THAT(registry_.Attach("m", 1), StatusIs(Code::kInvalidArgument, "rank 1 is out of range"));
}

TEST_F(RegistryTest, TensorParallelOrDevicePlacementWithoutBackendIsRefused) {
  LoadRequest request;
  request.name = "m";
  request.checkpoint_path = Checkpoint("ck", 1);
  request.tp_size = 2;
  EXPECT_THAT(registry_.Load(request, nullptr), StatusIs(Code::kInvalidArgument, "tp_size 2 needs one device per rank"));
  request.tp_size = 1;
  request.devices = {"GPU-00000000-0000-0000-0000-000000000000"};
  EXPECT_THAT(registry_.Load(request, nullptr), StatusIs(Code::kInvalidArgument, "this daemon has no device backend"));
  EXPECT_TRUE(registry_.List().empty());
  EXPECT_EQ(listener_.failures().size(), 2u);
}

}  // namespace
}  // namespace weightd
