#include "server/model/model_events.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace weightd {

absl::string_view ModelEventKindName(ModelEvent::Kind kind) {
  switch (kind) {
    case ModelEvent::Kind::kCurrent: return "CURRENT";
    case ModelEvent::Kind::kPublished: return "PUBLISHED";
    case ModelEvent::Kind::kDraining: return "DRAINING";
    case ModelEvent::Kind::kFreed: return "FREED";
    case ModelEvent::Kind::kUnloaded: return "UNLOADED";
    case ModelEvent::Kind::kLayoutPublished: return "LAYOUT_PUBLISHED";
    case ModelEvent::Kind::kLayoutDropped: return "LAYOUT_DROPPED";
    case ModelEvent::Kind::kLayoutDraining: return "LAYOUT_DRAINING";
  }
  return "KIND_UNSPECIFIED";
}

double UnixSecondsNow() { return absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()); }

absl::StatusOr<std::optional<ModelEvent>> ModelEventHub::Watcher::Next() {
  absl::MutexLock lock(&mu_);
  if (!queue_.empty()) {
    ModelEvent event = std::move(queue_.front());
    queue_.pop_front();
    return event;
  }
  if (!ended_.ok()) return ended_;
  return std::nullopt;
}

absl::Status ModelEventHub::Watcher::ended() {
  absl::MutexLock lock(&mu_);
  return ended_;
}

ModelEventHub::ModelEventHub(ModelEventHubOptions options) : options_(options) {
  thread_ = std::thread([this] { Loop(); });
}

ModelEventHub::~ModelEventHub() {
  {
    absl::MutexLock lock(&mu_);
    exiting_ = true;
  }
  thread_.join();
}

void ModelEventHub::Loop() {
  while (true) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !tasks_.empty() || exiting_; };
      mu_.Await(absl::Condition(&work));
      if (tasks_.empty()) return;  // exiting, every task run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

absl::StatusOr<std::shared_ptr<ModelEventHub::Watcher>> ModelEventHub::Subscribe(const std::string& name,
                                                                                 std::function<void()> ready,
                                                                                 std::optional<ModelEvent> first) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return absl::UnavailableError("weightd is stopping");
  if (by_name_.size() >= options_.max_watchers) {
    return absl::ResourceExhaustedError(absl::StrCat(by_name_.size(), " watch streams are open, as many as --max-watchers (",
                                                     options_.max_watchers, ") allows"));
  }
  std::shared_ptr<Watcher> watcher(new Watcher(name, std::move(ready)));
  if (first.has_value()) {
    {
      absl::MutexLock w(&watcher->mu_);
      watcher->queue_.push_back(std::move(*first));
    }
    WakeLocked(watcher);
  }
  by_name_.emplace(name, watcher);
  return watcher;
}

void ModelEventHub::Unsubscribe(const std::shared_ptr<Watcher>& watcher, std::function<void()> done) {
  absl::MutexLock lock(&mu_);
  bool subscribed;
  {
    absl::MutexLock w(&watcher->mu_);
    watcher->unsubscribed_ = true;
    subscribed = watcher->subscribed_;
    watcher->subscribed_ = false;
    std::deque<ModelEvent>().swap(watcher->queue_);
  }
  if (subscribed) EraseLocked(watcher.get());
  if (done) tasks_.push_back(std::move(done));
}

void ModelEventHub::Publish(const ModelEvent& event) {
  absl::MutexLock lock(&mu_);
  auto [begin, end] = by_name_.equal_range(event.name);
  for (auto it = begin; it != end;) {
    std::shared_ptr<Watcher> w = it->second;
    bool full;
    {
      absl::MutexLock wl(&w->mu_);
      full = w->queue_.size() >= options_.queue_events;
      if (!full) w->queue_.push_back(event);
    }
    if (full) {
      EndLocked(w, absl::ResourceExhaustedError(absl::StrCat(
                       "this watch of '", event.name, "' fell ", options_.queue_events,
                       " events behind and was dropped; watch again to get the CURRENT generation")),
                true);
      it = by_name_.erase(it);
    } else {
      WakeLocked(w);
      ++it;
    }
  }
}

void ModelEventHub::Stop() {
  absl::MutexLock lock(&mu_);
  stopped_ = true;
  // Queues are dropped too: a stream must not start another write to a
  // client that may not read, or the servers' Shutdown would wait for it.
  for (auto& [name, w] : by_name_) EndLocked(w, absl::UnavailableError("weightd is stopping"), true);
  by_name_.clear();
}

size_t ModelEventHub::watchers() const {
  absl::MutexLock lock(&mu_);
  return by_name_.size();
}

void ModelEventHub::WakeLocked(const std::shared_ptr<Watcher>& w) {
  {
    absl::MutexLock wl(&w->mu_);
    if (w->wake_queued_ || w->unsubscribed_) return;
    w->wake_queued_ = true;
  }
  tasks_.push_back([w] {
    {
      absl::MutexLock wl(&w->mu_);
      w->wake_queued_ = false;
      if (w->unsubscribed_) return;
    }
    w->ready_();
  });
}

void ModelEventHub::EndLocked(const std::shared_ptr<Watcher>& w, absl::Status status, bool drop_queue) {
  {
    absl::MutexLock wl(&w->mu_);
    w->ended_ = std::move(status);
    w->subscribed_ = false;
    if (drop_queue) std::deque<ModelEvent>().swap(w->queue_);  // clear() may keep a block
  }
  WakeLocked(w);
}

void ModelEventHub::EraseLocked(const Watcher* w) {
  auto [begin, end] = by_name_.equal_range(w->name());
  for (auto it = begin; it != end; ++it) {
    if (it->second.get() == w) {
      by_name_.erase(it);
      return;
    }
  }
}

}  // namespace weightd
