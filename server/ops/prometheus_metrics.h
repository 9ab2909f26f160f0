// The Prometheus implementation of `Metrics` (server/metrics/metrics.h),
// served over HTTP at http://<metrics_address>/metrics (prometheus-cpp's
// Exposer). Every labelled series the daemon can report (checkpoint error
// reasons, update abort reasons, restore drop reasons, peer fall-back
// reasons) exists at 0 from the start, so a rate() never misses its first
// event. docs/operations.md lists every metric.
#ifndef WEIGHTD_SERVER_OPS_PROMETHEUS_METRICS_H_
#define WEIGHTD_SERVER_OPS_PROMETHEUS_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/metrics/metrics.h"

namespace weightd {

struct PrometheusOptions {
  std::string address;   // "HOST:PORT" to serve /metrics on (port 0: any); "" serves nothing
  std::string version;   // weightd_build_info{version}
  ModelsSampler sampler;  // called on each scrape from an HTTP thread; may be empty
};

// Thread-safety: every method may be called from any thread.
class PrometheusMetrics : public Metrics {
 public:
  // UNAVAILABLE when the address cannot be bound, INVALID_ARGUMENT when malformed.
  // `options.sampler` must stay callable until the object is destroyed.
  static absl::StatusOr<std::unique_ptr<PrometheusMetrics>> Create(PrometheusOptions options);
  ~PrometheusMetrics() override;  // stops the HTTP server first

  // The port /metrics is served on; 0 when serving nothing.
  int port() const;
  // The exposition a scrape would return (text format 0.0.4).
  std::string Exposition() const;

  void LoadFinished(uint64_t bytes, double seconds) override;
  void LoadFailed(const absl::Status& status) override;
  void HostMemory(uint64_t resident_bytes, uint64_t locked_bytes) override;
  void AttachFinished(double seconds) override;
  void RpcFinished(absl::string_view method, absl::string_view code, double seconds) override;
  void UpdateStarted() override;
  void UpdateCommitted(uint64_t bytes_written, uint64_t bytes_shared, double seconds) override;
  void UpdateAborted(absl::string_view reason) override;
  void ModelsRestored(int models, double seconds) override;
  void RestoreRecordDropped(absl::string_view reason) override;
  void PeerJoiners(int open) override;
  void PeerBytesSent(absl::string_view peer, uint64_t bytes) override;
  void PeerBytesReceived(absl::string_view peer, uint64_t bytes) override;
  void PeerSeeded(absl::string_view peer, uint64_t bytes, double seconds) override;
  void PeerFallback(absl::string_view reason) override;
  void LayoutPublished(double seconds) override;
  void LayoutAborted(absl::string_view reason) override;
  void LayoutAttach(absl::string_view result) override;

  struct State;

 private:
  explicit PrometheusMetrics(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_OPS_PROMETHEUS_METRICS_H_
