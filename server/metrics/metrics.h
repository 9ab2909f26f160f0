// The daemon's metrics (DESIGN.md "Metrics"): the `Metrics` interface every
// layer reports to. Its Prometheus implementation, served over HTTP at
// http://<metrics_address>/metrics, is server/ops/prometheus_metrics.h;
// docs/operations.md lists every metric.
//
// Counters and histograms are fed by events (MetricsListener for the
// registry, the RPC interceptor for calls); gauges that describe the models
// held (by state, device bytes, leases) are sampled from the registry at
// each scrape, so a scrape never shows a model that is gone.
#ifndef WEIGHTD_SERVER_METRICS_METRICS_H_
#define WEIGHTD_SERVER_METRICS_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/model/model.h"

namespace weightd {

// What the daemon reports. Implementations must be thread-safe and quick:
// they are called with the registry lock held and on RPC threads.
class Metrics {
 public:
  virtual ~Metrics() = default;
  // A load finished: `bytes` read from the checkpoint in `seconds`.
  virtual void LoadFinished(uint64_t bytes, double seconds) = 0;
  // A load failed; counted by CheckpointErrorReason(status).
  virtual void LoadFailed(const absl::Status& status) = 0;
  // Bytes of host segments held (current and draining), and how many are mlock()ed.
  virtual void HostMemory(uint64_t resident_bytes, uint64_t locked_bytes) = 0;
  // An attach took `seconds` on the server.
  virtual void AttachFinished(double seconds) = 0;
  // One finished RPC: `method` is "package.Service/Method" or "unknown",
  // `code` a gRPC code name ("OK", "NOT_FOUND").
  virtual void RpcFinished(absl::string_view method, absl::string_view code, double seconds) = 0;
  // The writer path: an update was staged; committed, having written
  // `bytes_written` bytes of staged segments and shared `bytes_shared`, in
  // `seconds` (seal, hash, publish); or aborted for `reason` (one of
  // kUpdateAbortReasons in server/update/update.h).
  virtual void UpdateStarted() {}
  virtual void UpdateCommitted(uint64_t bytes_written, uint64_t bytes_shared, double seconds) {}
  virtual void UpdateAborted(absl::string_view reason) {}
  // Restart without reload (server/restart/restore.h): `models` generations restored
  // from the fd store at start in `seconds` in all; a record dropped for
  // `reason` (one of kRestoreDropReasons).
  virtual void ModelsRestored(int models, double seconds) {}
  virtual void RestoreRecordDropped(absl::string_view reason) {}
  // Peer seeding (server/peer/peer_seed.h, server/peer/peer_join.h). Seed side: the
  // transfer sessions open now; a joiner's report of `bytes` it read.
  // Joiner side: `bytes` received from `peer` (as they arrive); a verified
  // seeding of `bytes` from `peer` in `seconds`; a fall-back away from a
  // peer for `reason` (one of kPeerFallbackReasons, server/peer/peer_join.h).
  virtual void PeerJoiners(int open) {}
  virtual void PeerBytesSent(absl::string_view peer, uint64_t bytes) {}
  virtual void PeerBytesReceived(absl::string_view peer, uint64_t bytes) {}
  virtual void PeerSeeded(absl::string_view peer, uint64_t bytes, double seconds) {}
  virtual void PeerFallback(absl::string_view reason) {}
  // Runtime layouts (server/layout/layout_publish.h): one was published, its
  // commit (seal, hash, device copy) taking `seconds`; a publish ended
  // without one for `reason` (one of kLayoutAbortReasons); an attach asked
  // for a layout, with `result` one of kLayoutAttachResults.
  virtual void LayoutPublished(double seconds) {}
  virtual void LayoutAborted(absl::string_view reason) {}
  virtual void LayoutAttach(absl::string_view result) {}
};

// What an attach that names a runtime layout found (weightd_layout_attaches_total{result}).
inline constexpr const char* kLayoutAttachResults[] = {"hit", "not_found", "identity_mismatch"};

// The models held, as the registry lists them at one moment.
struct ModelsSample {
  std::map<std::string, int> by_state;             // "READY" -> 2; every state is present
  std::map<std::string, uint64_t> device_bytes;    // GPU UUID -> bytes
  std::map<std::string, int> leases;               // model name -> leases over all its generations
  // READY generations: model name -> (generation, version label), for
  // weightd_model_version_info{model, generation, version_label}.
  std::map<std::string, std::pair<uint64_t, std::string>> versions;
  // READY generations: model name -> host bytes on 2 MiB pages, for
  // weightd_host_huge_page_bytes{model}.
  std::map<std::string, uint64_t> huge_page_bytes;
  // NUMA node id -> bytes of host segments bound to it (numa_copies loads),
  // each segment once, for weightd_host_numa_bytes{node}.
  std::map<std::string, uint64_t> numa_bytes;
  // Runtime layouts of every generation held: model name -> layouts, and
  // -> bytes of their host segments; GPU UUID -> bytes of their arenas.
  std::map<std::string, int> layouts;
  std::map<std::string, uint64_t> layout_host_bytes;
  std::map<std::string, uint64_t> layout_device_bytes;
};
// Builds the sample from ModelRegistry::ListAll(). A segment several
// generations share (server/load/shared_segments.h) counts once.
ModelsSample SampleModels(const std::vector<std::shared_ptr<ModelGeneration>>& models);
using ModelsSampler = std::function<ModelsSample()>;

// A short, stable slug for a failed load, for weightd_checkpoint_errors_total
// {reason}: the name of the CheckpointRule the status carries
// (common/format/format_error.h: "header_too_large", "truncated", ...), whatever
// its message says; "invalid_request" for a request refused before any
// checkpoint was read (kInvalidLoadRequestPayload, server/model/model.h); else by
// status code ("invalid_checkpoint", "already_loading" while a load of the
// name runs, "not_found", "permission_denied", "resource_exhausted", "io"),
// else "other".
std::string CheckpointErrorReason(const absl::Status& status);
// Every value CheckpointErrorReason can return: the rules, then the
// status-code reasons. Each has its series, at 0 until it happens.
std::vector<std::string> CheckpointErrorReasons();

}  // namespace weightd

#endif  // WEIGHTD_SERVER_METRICS_METRICS_H_
