#include "server/api/watch_stream.h"

#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/api/convert.h"

namespace weightd {
namespace {

// Who may call into gRPC is decided under mu_: at most one write in flight,
// and Finish exactly once, never while a write is in flight (so the reactor
// lives until every Pump that started a write got its OnWriteDone). The
// reactor is deleted on the hub's thread after OnDone, once no ready call
// of its watcher can run (ModelEventHub::Unsubscribe).
class WatchStream final : public grpc::ServerWriteReactor<v1::ModelEvent> {
 public:
  WatchStream(grpc::CallbackServerContext* context, ModelRegistry* registry) : context_(context), registry_(registry) {}

  void Start(const std::string& name) {
    absl::StatusOr<std::shared_ptr<ModelEventHub::Watcher>> watcher = registry_->Watch(name, [this] { Pump(); });
    if (!watcher.ok()) {
      {
        absl::MutexLock lock(&mu_);
        finished_ = true;
      }
      Finish(ToGrpcStatus(watcher.status()));
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      watcher_ = *watcher;
    }
    // The client learns that the subscription is in place, before any event
    // (gRPC refuses initial metadata after a write has sent it). A refusal
    // above ends the call without initial metadata.
    context_->AddInitialMetadata(kWatchSubscribedKey, kWatchSubscribedValue);
    StartSendInitialMetadata();
    {
      absl::MutexLock lock(&mu_);
      started_ = true;
    }
    Pump();
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) cancelled_ = true;  // the client is gone
    }
    Pump();
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
    }
    Pump();
  }

  void OnDone() override {
    std::shared_ptr<ModelEventHub::Watcher> watcher;
    {
      absl::MutexLock lock(&mu_);
      watcher = watcher_;
    }
    if (watcher == nullptr) {
      delete this;
      return;
    }
    registry_->events().Unsubscribe(watcher, [this] { delete this; });
  }

 private:
  enum class Step { kNone, kWrite, kFinish, kCancel };

  // Writes the next queued event, or finishes the call once the watcher
  // ended or the client went away. Called by the hub (events queued), by
  // gRPC (a write done, a cancel) and by Start.
  void Pump() {
    grpc::Status status;
    Step step = NextStep(&status);
    if (step == Step::kWrite) StartWrite(&out_);
    if (step == Step::kFinish) Finish(status);
    if (step == Step::kCancel) context_->TryCancel();  // OnWriteDone(false) follows, then Finish
  }

  Step NextStep(grpc::Status* status) {
    absl::MutexLock lock(&mu_);
    if (!started_ || finished_) return Step::kNone;
    if (writing_) {
      // Stopping, and the client does not take the write in flight: cancel
      // rather than keep the server's Shutdown waiting for it.
      if (cancel_sent_ || watcher_->ended().code() != absl::StatusCode::kUnavailable) return Step::kNone;
      cancel_sent_ = true;
      return Step::kCancel;
    }
    if (cancelled_) {
      finished_ = true;
      *status = grpc::Status(grpc::StatusCode::CANCELLED, "the watch was cancelled");
      return Step::kFinish;
    }
    absl::StatusOr<std::optional<ModelEvent>> next = watcher_->Next();
    if (!next.ok()) {
      finished_ = true;
      *status = ToGrpcStatus(next.status());
      return Step::kFinish;
    }
    if (!next->has_value()) return Step::kNone;
    out_.Clear();
    ToProto(**next, &out_);
    writing_ = true;
    return Step::kWrite;
  }

  grpc::CallbackServerContext* const context_;
  ModelRegistry* const registry_;
  absl::Mutex mu_;
  std::shared_ptr<ModelEventHub::Watcher> watcher_ ABSL_GUARDED_BY(mu_);
  v1::ModelEvent out_;  // the write in flight; changed only while no write is
  bool started_ ABSL_GUARDED_BY(mu_) = false;    // initial metadata requested: writes may start
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;  // by the client, or a write failed
  bool cancel_sent_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::ServerWriteReactor<v1::ModelEvent>* StartWatchStream(grpc::CallbackServerContext* context,
                                                           const v1::WatchModelRequest& request,
                                                           ModelRegistry* registry) {
  auto* stream = new WatchStream(context, registry);
  stream->Start(request.name());
  return stream;
}

}  // namespace weightd
