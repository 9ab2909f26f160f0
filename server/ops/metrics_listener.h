// Turns registry events into metrics: finished and failed loads, attach
// durations (Attach RPC to the lease's claim on the fd socket), and host
// memory. (Models by state, device bytes and leases are sampled at each
// scrape instead; see metrics.h.)
//
// Thread-safety: as RegistryListener; `metrics` must outlive the listener.
#ifndef WEIGHTD_SERVER_OPS_METRICS_LISTENER_H_
#define WEIGHTD_SERVER_OPS_METRICS_LISTENER_H_

#include "server/metrics/metrics.h"
#include "server/registry/registry.h"

namespace weightd {

class MetricsListener final : public RegistryListener {
 public:
  explicit MetricsListener(Metrics* metrics) : metrics_(metrics) {}

  void OnLoadFinished(const ModelGeneration& model, uint64_t bytes, double seconds) override {
    metrics_->LoadFinished(bytes, seconds);
  }
  void OnLoadFailed(const LoadRequest&, const absl::Status& status) override { metrics_->LoadFailed(status); }
  void OnLeaseClaimed(const std::string& name, double seconds) override { metrics_->AttachFinished(seconds); }
  void OnMemoryChanged(uint64_t host_bytes, uint64_t locked_bytes) override {
    metrics_->HostMemory(host_bytes, locked_bytes);
  }
  void OnUpdateStarted(const std::string&, uint64_t) override { metrics_->UpdateStarted(); }
  void OnUpdateCommitted(const ModelGeneration&, uint64_t bytes_written, uint64_t bytes_shared, uint32_t,
                         double seconds) override {
    metrics_->UpdateCommitted(bytes_written, bytes_shared, seconds);
  }
  void OnUpdateAborted(const std::string&, const std::string& reason) override { metrics_->UpdateAborted(reason); }
  void OnLayoutPublished(const Layout& layout) override { metrics_->LayoutPublished(layout.publish_seconds); }
  void OnLayoutAborted(const std::string&, const std::string& reason) override { metrics_->LayoutAborted(reason); }
  void OnLayoutAttach(const std::string&, const std::string& result) override { metrics_->LayoutAttach(result); }

 private:
  Metrics* metrics_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_OPS_METRICS_LISTENER_H_
