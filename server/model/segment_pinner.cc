#include "server/model/segment_pinner.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>

namespace weightd {

SegmentPinner::SegmentPinner(DoneFn done, bool held)
    : done_(std::move(done)), held_(held), thread_([this] { Loop(); }) {}

void SegmentPinner::Release() {
  absl::MutexLock lock(&mu_);
  held_ = false;
}

SegmentPinner::~SegmentPinner() { Stop(); }

void SegmentPinner::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  std::call_once(joined_, [this] { thread_.join(); });
}

void SegmentPinner::Pin(const std::shared_ptr<ModelGeneration>& model) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(model);
}

bool SegmentPinner::stopping() const {
  absl::MutexLock lock(&mu_);
  return stop_;
}

void SegmentPinner::Loop() {
  // Linux keeps a nice value per thread: this one alone (setpriority(2), NOTES). Best effort.
  setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
  for (;;) {
    std::shared_ptr<ModelGeneration> model;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || (!held_ && !queue_.empty()); };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return;
      model = queue_.front().lock();
      queue_.pop_front();
    }
    if (model == nullptr) continue;  // freed before its turn
    PinResult result = PinAll(*model);
    if (stopping()) return;
    model->locked_bytes = result.locked_bytes;
    if (done_) done_(*model, result);
  }
}

PinResult SegmentPinner::PinAll(const ModelGeneration& model) {
  auto start = std::chrono::steady_clock::now();
  PinResult result;
  for (const std::shared_ptr<const HostSegment>& segment : model.host_segments) {
    if (stopping()) break;
    result.host_bytes += segment->size();
    if (segment->Pin()) {
      result.locked_bytes += segment->size();
    } else if (result.lock_errno == 0) {
      result.lock_errno = segment->lock_errno();
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

}  // namespace weightd
