// Model events for watchers (WatchModel): what happened to a model name,
// fanned out to per-watcher bounded queues and delivered on one thread.
//
// The registry publishes events with its lock held, so Publish() only
// appends to the queues of the name's watchers and wakes the hub's thread;
// that thread calls each woken watcher's `ready` function with no lock of
// the hub or the registry held, so `ready` may start gRPC operations (whose
// completions gRPC may run inline). One thread serves every watcher: a
// watcher holds no thread while it waits.
//
// Bounds: at most max_watchers subscriptions; a watcher that falls
// queue_events events behind is ended with RESOURCE_EXHAUSTED and its queue
// freed, so a client that stops reading cannot grow the daemon's memory.
//
// Thread-safety: every method may be called from any thread, except that
// the destructor must not run on the hub's thread.
#ifndef WEIGHTD_SERVER_MODEL_MODEL_EVENTS_H_
#define WEIGHTD_SERVER_MODEL_MODEL_EVENTS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace weightd {

struct ModelEvent {
  // The meaning of each kind: proto/weightd/v1/weightd.proto, ModelEvent.
  enum class Kind { kCurrent, kPublished, kDraining, kFreed, kUnloaded, kLayoutPublished, kLayoutDropped, kLayoutDraining };
  Kind kind = Kind::kCurrent;
  std::string name;
  uint64_t generation = 0;
  std::string version_label;
  std::string fingerprint;
  double unix_seconds = 0;  // when it happened
  std::string layout = {};  // kLayout*: the layout key
  uint32_t rank = 0;        // kLayout*: its rank
  bool operator==(const ModelEvent&) const = default;
};

// "CURRENT", "PUBLISHED", "DRAINING", "FREED", "UNLOADED", "LAYOUT_PUBLISHED",
// "LAYOUT_DROPPED", "LAYOUT_DRAINING" (the proto's names).
absl::string_view ModelEventKindName(ModelEvent::Kind kind);

// The wall clock as seconds since the Unix epoch.
double UnixSecondsNow();

struct ModelEventHubOptions {
  size_t max_watchers = 256;   // --max-watchers
  size_t queue_events = 1024;  // events a watcher may have queued, unread
};

class ModelEventHub {
 public:
  class Watcher;

  explicit ModelEventHub(ModelEventHubOptions options);
  // Runs every task still queued (ready calls, Unsubscribe's `done`), then
  // stops the thread. Unsubscribe every watcher first.
  ~ModelEventHub();
  ModelEventHub(const ModelEventHub&) = delete;
  ModelEventHub& operator=(const ModelEventHub&) = delete;

  // Subscribes to the events of `name`, with `first` (if any) queued before
  // every later event. `ready` runs on the hub's thread after events were
  // queued for the watcher or it was ended; it should read Next() until it
  // returns nullopt or an error. RESOURCE_EXHAUSTED when max_watchers are
  // subscribed; UNAVAILABLE after Stop().
  absl::StatusOr<std::shared_ptr<Watcher>> Subscribe(const std::string& name, std::function<void()> ready,
                                                     std::optional<ModelEvent> first = std::nullopt);
  // Ends `watcher`'s subscription and frees its slot: its `ready` is not
  // called again once `done` runs. `done` (may be null) runs on the hub's
  // thread after every ready call of the watcher has returned, so it may
  // free what `ready` uses. May be called from within `ready`.
  void Unsubscribe(const std::shared_ptr<Watcher>& watcher, std::function<void()> done);
  // Queues `event` for every watcher of event.name. Never blocks on a
  // watcher; may be called with the registry's lock held.
  void Publish(const ModelEvent& event);
  // Ends every watcher with UNAVAILABLE, dropping what it had queued, and
  // refuses new ones (shutdown).
  void Stop();
  // Subscriptions that count against max_watchers.
  size_t watchers() const;

 private:
  using Task = std::function<void()>;
  void Loop();
  // Queues a ready call of `w` unless one is queued already.
  void WakeLocked(const std::shared_ptr<Watcher>& w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends `w` with `status` and wakes it; its queue is dropped when
  // `drop_queue`. The caller erases it from by_name_.
  void EndLocked(const std::shared_ptr<Watcher>& w, absl::Status status, bool drop_queue)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(const Watcher* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ModelEventHubOptions options_;
  mutable absl::Mutex mu_;
  std::multimap<std::string, std::shared_ptr<Watcher>> by_name_ ABSL_GUARDED_BY(mu_);
  std::deque<Task> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;  // Stop(): no new watchers
  bool exiting_ ABSL_GUARDED_BY(mu_) = false;  // the destructor: the thread ends once tasks_ is empty
  std::thread thread_;
};

// One subscription: a bounded queue of events, read with Next().
class ModelEventHub::Watcher {
 public:
  // The next queued event, or nullopt when none is queued now; once the
  // watcher was ended, its reason: RESOURCE_EXHAUSTED (it fell
  // queue_events behind) or UNAVAILABLE (the hub stopped); either drops
  // the events still queued.
  absl::StatusOr<std::optional<ModelEvent>> Next();
  // OK while subscribed; once ended, the reason Next() returns after the
  // events still queued.
  absl::Status ended();
  const std::string& name() const { return name_; }

 private:
  friend class ModelEventHub;
  Watcher(std::string name, std::function<void()> ready) : name_(std::move(name)), ready_(std::move(ready)) {}

  const std::string name_;
  const std::function<void()> ready_;
  absl::Mutex mu_;  // taken after the hub's mu_
  std::deque<ModelEvent> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status ended_ ABSL_GUARDED_BY(mu_);
  bool wake_queued_ ABSL_GUARDED_BY(mu_) = false;  // a ready call is among the hub's tasks
  bool subscribed_ ABSL_GUARDED_BY(mu_) = true;    // in by_name_, counting against max_watchers
  bool unsubscribed_ ABSL_GUARDED_BY(mu_) = false;  // Unsubscribe() was called: no more ready calls
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_MODEL_MODEL_EVENTS_H_
