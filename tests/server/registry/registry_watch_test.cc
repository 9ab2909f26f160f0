// ModelRegistry's watch events: the exact sequence each change of a name
// produces (PUBLISHED, DRAINING, FREED, UNLOADED), CURRENT on subscribe, and
// the limits.
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/registry/registry_fixture.h"
#include "tests/testing/event_recorder.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::weightd::registry_test::RegistryTest;
using ::weightd::testing::EventRecorder;
using Code = absl::StatusCode;

TEST_F(RegistryTest, WatchBeforeLoadGetsPublishedWithTheGenerationsIdentity) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto watch, EventRecorder::Watch(registry_, "m"));
  double before = UnixSecondsNow();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, Load("m", Checkpoint("ck", 1)));
  double after = UnixSecondsNow();
  ASSERT_THAT(watch->WaitFor(1), ElementsAre("PUBLISHED 1"));
  ModelEvent e = watch->events()[0];
  EXPECT_EQ(e.name, "m");
  EXPECT_EQ(e.fingerprint, loaded.model->fingerprint);
  EXPECT_EQ(e.fingerprint.size(), 32u);
  EXPECT_EQ(e.version_label, "");  // a load from disk has none
  EXPECT_GE(e.unix_seconds, before);
  EXPECT_LE(e.unix_seconds, after);
}

TEST_F(RegistryTest, WatchOfALoadedNameStartsWithCurrent) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto watch, EventRecorder::Watch(registry_, "m"));
  ASSERT_THAT(watch->WaitFor(1), ElementsAre("CURRENT 1"));
  EXPECT_EQ(watch->events()[0].fingerprint, loaded.model->fingerprint);
}

TEST_F(RegistryTest, ReloadOfAnotherCheckpointPublishesThenDrainsAndFreesTheOldGenerationAsLeasesEnd) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("one", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto watch, EventRecorder::Watch(registry_, "m"));
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("two", 2)));
  EXPECT_THAT(watch->WaitFor(3), ElementsAre("CURRENT 1", "PUBLISHED 2", "DRAINING 1"));
  lease.model.reset();  // the grant's reference: the lease alone holds generation 1 now
  registry_.Release(lease.lease_id);
  EXPECT_THAT(watch->WaitFor(4), ElementsAre("CURRENT 1", "PUBLISHED 2", "DRAINING 1", "FREED 1"));
}

TEST_F(RegistryTest, ReloadWithoutLeasesFreesTheOldGenerationAtOnce) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto watch, EventRecorder::Watch(registry_, "m"));
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("one", 1)));
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("two", 2)));
  EXPECT_THAT(watch->WaitFor(3), ElementsAre("PUBLISHED 1", "PUBLISHED 2", "FREED 1"));
}

TEST_F(RegistryTest, ReusedLoadAnnouncesNothing) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto watch, EventRecorder::Watch(registry_, "m"));
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("one", 1)));
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(auto again, Load("m", "one"));
    EXPECT_TRUE(again.reused);
  }
  WEIGHTD_ASSERT_OK(registry_.Unload("m", false));
  EXPECT_THAT(watch->WaitFor(3), ElementsAre("PUBLISHED 1", "UNLOADED 1", "FREED 1"));
}

TEST_F(RegistryTest, UnloadWithALeaseIsUnloadedThenDrainingThenFreed) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("one", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0));
  lease.model.reset();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto watch, EventRecorder::Watch(registry_, "m"));
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_.Unload("m", false));
    EXPECT_FALSE(unloaded.freed);
  }
  EXPECT_THAT(watch->WaitFor(3), ElementsAre("CURRENT 1", "UNLOADED 1", "DRAINING 1"));
  registry_.Release(lease.lease_id);
  EXPECT_THAT(watch->WaitFor(4), ElementsAre("CURRENT 1", "UNLOADED 1", "DRAINING 1", "FREED 1"));
}

TEST_F(RegistryTest, ForcedUnloadIsUnloadedThenFreed) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("one", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0));
  lease.model.reset();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto watch, EventRecorder::Watch(registry_, "m"));
  WEIGHTD_ASSERT_OK(registry_.Unload("m", /*force=*/true));
  EXPECT_THAT(watch->WaitFor(3), ElementsAre("CURRENT 1", "UNLOADED 1", "FREED 1"));
}

// FREED means the memory is gone: a reference held past the registry's
// (here a listing in flight) delays it.
TEST_F(RegistryTest, FreedWaitsForTheLastReference) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto watch, EventRecorder::Watch(registry_, "m"));
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("one", 1)));
  std::vector<std::shared_ptr<ModelGeneration>> listing = registry_.List();
  WEIGHTD_ASSERT_OK(registry_.Unload("m", false));
  EXPECT_THAT(watch->WaitFor(2), ElementsAre("PUBLISHED 1", "UNLOADED 1"));
  listing.clear();
  EXPECT_THAT(watch->WaitFor(3), ElementsAre("PUBLISHED 1", "UNLOADED 1", "FREED 1"));
}

TEST_F(RegistryTest, FailedLoadsAndOtherNamesAnnounceNothing) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto watch, EventRecorder::Watch(registry_, "m"));
  EXPECT_FALSE(Load("m", "missing").ok());
  WEIGHTD_ASSERT_OK(Load("other", Checkpoint("one", 1)));
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("two", 2)));
  EXPECT_THAT(watch->WaitFor(1), ElementsAre("PUBLISHED 2"));
}

TEST_F(RegistryTest, WatchValidatesTheName) {
  EXPECT_THAT(EventRecorder::Watch(registry_, ""), StatusIs(Code::kInvalidArgument, "1 to 128 characters, got 0"));
  EXPECT_THAT(EventRecorder::Watch(registry_, "a/b"), StatusIs(Code::kInvalidArgument, "'a/b' may hold only"));
  EXPECT_THAT(EventRecorder::Watch(registry_, std::string(129, 'x')),
              StatusIs(Code::kInvalidArgument, "1 to 128 characters, got 129"));
}

TEST_F(RegistryTest, WatchersAreLimitedAndStopEndsThem) {
  RegistryOptions options = Options();
  options.watch.max_watchers = 1;
  ModelRegistry registry(options, nullptr);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto first, EventRecorder::Watch(registry, "m"));
  EXPECT_THAT(EventRecorder::Watch(registry, "n"), StatusIs(Code::kResourceExhausted, "--max-watchers (1)"));
  registry.StopWatches();
  EXPECT_THAT(first->WaitForEnd(), StatusIs(Code::kUnavailable, "weightd is stopping"));
  EXPECT_THAT(EventRecorder::Watch(registry, "m"), StatusIs(Code::kUnavailable, "stopping"));
}

TEST_F(RegistryTest, AWatcherThatDoesNotReadIsDroppedNotGrown) {
  RegistryOptions options = Options();
  options.watch.queue_events = 2;
  ModelRegistry registry(options, nullptr);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto stuck, registry.Watch("m", [] {}));  // never reads
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("one", 1), &registry));
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("two", 2), &registry));  // PUBLISHED 2, FREED 1: the third event
  // FREED comes from the registry's release thread, just after the load returns.
  for (int i = 0; i < 500 && registry.events().watchers() != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_THAT(stuck->Next(), StatusIs(Code::kResourceExhausted, "fell 2 events behind"));
  EXPECT_EQ(registry.events().watchers(), 0u);
  registry.events().Unsubscribe(stuck, nullptr);
}

}  // namespace
}  // namespace weightd
