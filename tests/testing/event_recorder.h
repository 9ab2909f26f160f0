// Records the events of one watch (server/model/model_events.h), for tests.
#ifndef WEIGHTD_TESTS_TESTING_EVENT_RECORDER_H_
#define WEIGHTD_TESTS_TESTING_EVENT_RECORDER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "server/model/model_events.h"
#include "server/registry/registry.h"

namespace weightd::testing {

// "PUBLISHED 2": an event's kind and generation, for exact sequences.
inline std::string Brief(const ModelEvent& e) { return absl::StrCat(ModelEventKindName(e.kind), " ", e.generation); }

// Thread-safe. Unsubscribes in the destructor and waits until the hub has
// let go of it.
class EventRecorder {
 public:
  static absl::StatusOr<std::unique_ptr<EventRecorder>> Watch(ModelRegistry& registry, const std::string& name) {
    std::unique_ptr<EventRecorder> r(new EventRecorder(&registry.events()));
    auto watcher = registry.Watch(name, [raw = r.get()] { raw->Drain(); });
    if (!watcher.ok()) return watcher.status();
    r->Attach(*watcher);
    return r;
  }
  static absl::StatusOr<std::unique_ptr<EventRecorder>> Subscribe(ModelEventHub& hub, const std::string& name,
                                                                  std::optional<ModelEvent> first = std::nullopt) {
    std::unique_ptr<EventRecorder> r(new EventRecorder(&hub));
    auto watcher = hub.Subscribe(name, [raw = r.get()] { raw->Drain(); }, std::move(first));
    if (!watcher.ok()) return watcher.status();
    r->Attach(*watcher);
    return r;
  }
  ~EventRecorder() {
    std::shared_ptr<ModelEventHub::Watcher> w = watcher();
    if (w == nullptr) return;  // the subscription was refused
    absl::Notification done;
    hub_->Unsubscribe(w, [&done] { done.Notify(); });
    done.WaitForNotification();
  }

  // Waits up to 10 s until `n` events arrived or the watch ended; every
  // event so far as Brief() strings.
  std::vector<std::string> WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return events_.size() >= n || !ended_.ok(); };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
    std::vector<std::string> out;
    for (const ModelEvent& e : events_) out.push_back(Brief(e));
    return out;
  }
  // Waits up to 10 s for the watch to end; its reason.
  absl::Status WaitForEnd() {
    absl::MutexLock lock(&mu_);
    auto ended = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !ended_.ok(); };
    mu_.AwaitWithTimeout(absl::Condition(&ended), absl::Seconds(10));
    return ended_;
  }
  std::vector<ModelEvent> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  // How many times the hub called ready.
  int ready_calls() {
    absl::MutexLock lock(&mu_);
    return ready_calls_;
  }
  std::shared_ptr<ModelEventHub::Watcher> watcher() {
    absl::MutexLock lock(&mu_);
    return watcher_;
  }

 private:
  explicit EventRecorder(ModelEventHub* hub) : hub_(hub) {}
  void Attach(std::shared_ptr<ModelEventHub::Watcher> watcher) {
    {
      absl::MutexLock lock(&mu_);
      watcher_ = std::move(watcher);
    }
    Drain();  // what a ready call before this found no watcher for
  }
  void Drain() {
    absl::MutexLock lock(&mu_);
    ++ready_calls_;
    if (watcher_ == nullptr) return;
    while (true) {
      absl::StatusOr<std::optional<ModelEvent>> next = watcher_->Next();
      if (!next.ok()) {
        ended_ = next.status();
        return;
      }
      if (!next->has_value()) return;
      events_.push_back(**next);
    }
  }

  ModelEventHub* const hub_;
  absl::Mutex mu_;
  std::shared_ptr<ModelEventHub::Watcher> watcher_ ABSL_GUARDED_BY(mu_);
  std::vector<ModelEvent> events_ ABSL_GUARDED_BY(mu_);
  absl::Status ended_ ABSL_GUARDED_BY(mu_);
  int ready_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_EVENT_RECORDER_H_
