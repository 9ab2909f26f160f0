// ModelEventHub: fan-out by name, delivery on the hub's thread, the watcher
// limit, the per-watcher queue bound, Stop and Unsubscribe.
#include "server/model/model_events.h"

#include <thread>

#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/event_recorder.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::weightd::testing::EventRecorder;
using Code = absl::StatusCode;
using Kind = ModelEvent::Kind;

ModelEvent Event(Kind kind, const std::string& name, uint64_t generation) {
  return {kind, name, generation, "step-" + std::to_string(generation), "fp" + std::to_string(generation), 1.5};
}

TEST(ModelEventHub, DeliversTheFirstEventThenPublishedOnesInOrder) {
  ModelEventHub hub({});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto r, EventRecorder::Subscribe(hub, "m", Event(Kind::kCurrent, "m", 1)));
  hub.Publish(Event(Kind::kPublished, "m", 2));
  hub.Publish(Event(Kind::kDraining, "m", 1));
  hub.Publish(Event(Kind::kFreed, "m", 1));
  EXPECT_THAT(r->WaitFor(4), ElementsAre("CURRENT 1", "PUBLISHED 2", "DRAINING 1", "FREED 1"));
  EXPECT_EQ(r->events()[1], Event(Kind::kPublished, "m", 2));  // every field as published
}

TEST(ModelEventHub, WatchersSeeOnlyTheirName) {
  ModelEventHub hub({});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto a, EventRecorder::Subscribe(hub, "a"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto a2, EventRecorder::Subscribe(hub, "a"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto b, EventRecorder::Subscribe(hub, "b"));
  hub.Publish(Event(Kind::kPublished, "a", 7));
  hub.Publish(Event(Kind::kUnloaded, "b", 3));
  EXPECT_THAT(a->WaitFor(1), ElementsAre("PUBLISHED 7"));
  EXPECT_THAT(a2->WaitFor(1), ElementsAre("PUBLISHED 7"));
  EXPECT_THAT(b->WaitFor(1), ElementsAre("UNLOADED 3"));
  hub.Publish(Event(Kind::kFreed, "c", 1));  // nobody watches "c"
  EXPECT_EQ(hub.watchers(), 3u);
}

TEST(ModelEventHub, RefusesWatchersBeyondTheLimitUntilOneLeaves) {
  ModelEventHub hub({.max_watchers = 2});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto first, EventRecorder::Subscribe(hub, "m"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto second, EventRecorder::Subscribe(hub, "other"));
  EXPECT_THAT(EventRecorder::Subscribe(hub, "m"),
              StatusIs(Code::kResourceExhausted, "2 watch streams are open, as many as --max-watchers (2) allows"));
  first.reset();  // unsubscribes
  EXPECT_EQ(hub.watchers(), 1u);
  WEIGHTD_EXPECT_OK(EventRecorder::Subscribe(hub, "m"));
}

// A watcher whose reader never drains its queue: the queue stops at
// queue_events, then the watcher ends and its queue and slot are freed.
TEST(ModelEventHub, AWatcherThatDoesNotReadIsDroppedAtTheQueueBound) {
  ModelEventHub hub({.max_watchers = 4, .queue_events = 3});
  absl::Notification woken;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto stuck, hub.Subscribe("m", [&woken] {
    if (!woken.HasBeenNotified()) woken.Notify();  // reads nothing
  }));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto reader, EventRecorder::Subscribe(hub, "m"));
  // One event at a time, each read by `reader` before the next: it never has
  // more than one queued, while `stuck` keeps all of them.
  auto publish = [&](uint64_t g) {
    hub.Publish(Event(Kind::kPublished, "m", g));
    reader->WaitFor(g);
  };
  for (uint64_t g = 1; g <= 4; ++g) publish(g);
  EXPECT_THAT(stuck->Next(), StatusIs(Code::kResourceExhausted,
                                      "this watch of 'm' fell 3 events behind and was dropped; watch again"));
  EXPECT_EQ(hub.watchers(), 1u);  // the reader's
  for (uint64_t g = 5; g <= 100; ++g) publish(g);
  EXPECT_THAT(stuck->Next(), StatusIs(Code::kResourceExhausted, "fell 3 events behind"));  // still nothing queued
  EXPECT_EQ(reader->WaitFor(100).size(), 100u);  // a reader that keeps up is not dropped
  EXPECT_TRUE(woken.WaitForNotificationWithTimeout(absl::Seconds(10)));
  hub.Unsubscribe(stuck, nullptr);
}

TEST(ModelEventHub, StopEndsEveryWatcherAndDropsItsQueue) {
  ModelEventHub hub({});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto r, EventRecorder::Subscribe(hub, "m"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unread, hub.Subscribe("m", [] {}));
  hub.Publish(Event(Kind::kPublished, "m", 1));
  hub.Stop();
  EXPECT_THAT(r->WaitForEnd(), StatusIs(Code::kUnavailable, "weightd is stopping"));
  EXPECT_THAT(unread->Next(), StatusIs(Code::kUnavailable, "weightd is stopping"));  // PUBLISHED 1 dropped
  EXPECT_EQ(hub.watchers(), 0u);
  hub.Unsubscribe(unread, nullptr);
  EXPECT_THAT(EventRecorder::Subscribe(hub, "m"), StatusIs(Code::kUnavailable, "weightd is stopping"));
}

// Unsubscribe's `done` runs after the ready call in progress returned, and
// no ready call follows it: the owner may free what `ready` uses there.
TEST(ModelEventHub, DoneRunsAfterTheLastReadyCall) {
  ModelEventHub hub({});
  absl::Notification in_ready, release, done;
  std::atomic<int> calls{0};
  std::atomic<bool> ready_after_done{false};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto w, hub.Subscribe("m", [&] {
    if (done.HasBeenNotified()) ready_after_done = true;
    if (calls++ == 0) {
      in_ready.Notify();
      release.WaitForNotification();
    }
  }));
  hub.Publish(Event(Kind::kPublished, "m", 1));
  ASSERT_TRUE(in_ready.WaitForNotificationWithTimeout(absl::Seconds(10)));
  hub.Publish(Event(Kind::kPublished, "m", 2));  // queues another ready call
  hub.Unsubscribe(w, [&] { done.Notify(); });
  EXPECT_FALSE(done.HasBeenNotified());  // the ready call is still running
  release.Notify();
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  hub.Publish(Event(Kind::kPublished, "m", 3));
  EXPECT_EQ(calls.load(), 1);
  EXPECT_FALSE(ready_after_done.load());
  EXPECT_EQ(hub.watchers(), 0u);
}

TEST(ModelEventHub, ReadyMayUnsubscribeItself) {
  ModelEventHub hub({});
  absl::Notification done;
  std::shared_ptr<ModelEventHub::Watcher> self;
  absl::Notification subscribed;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(self, hub.Subscribe("m", [&] {
    subscribed.WaitForNotification();
    hub.Unsubscribe(self, [&] { done.Notify(); });
  }));
  subscribed.Notify();
  hub.Publish(Event(Kind::kUnloaded, "m", 1));
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
}

TEST(ModelEventKindName, SpellsTheProtoNames) {
  EXPECT_EQ(ModelEventKindName(Kind::kCurrent), "CURRENT");
  EXPECT_EQ(ModelEventKindName(Kind::kPublished), "PUBLISHED");
  EXPECT_EQ(ModelEventKindName(Kind::kDraining), "DRAINING");
  EXPECT_EQ(ModelEventKindName(Kind::kFreed), "FREED");
  EXPECT_EQ(ModelEventKindName(Kind::kUnloaded), "UNLOADED");
}

}  // namespace
}  // namespace weightd
