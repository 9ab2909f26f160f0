#include "server/ops/prometheus_metrics.h"

#include <prometheus/collectable.h>
#include <prometheus/counter.h>
#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <optional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "server/peer/peer_join.h"
#include "server/registry/registry.h"
#include "server/restart/restore.h"

namespace weightd {
namespace {

const std::vector<double>& LoadBuckets() {
  static const auto* b = new std::vector<double>{0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800};
  return *b;
}
const std::vector<double>& RpcBuckets() {
  static const auto* b = new std::vector<double>{0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300, 1800};
  return *b;
}
const std::vector<double>& AttachBuckets() {
  static const auto* b =
      new std::vector<double>{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10};
  return *b;
}

prometheus::MetricFamily GaugeFamily(std::string name, std::string help, const std::string& label,
                                     const auto& values) {
  prometheus::MetricFamily family{std::move(name), std::move(help), prometheus::MetricType::Gauge, {}};
  for (const auto& [key, value] : values) {
    prometheus::ClientMetric metric;
    metric.label.push_back({label, key});
    metric.gauge.value = static_cast<double>(value);
    family.metric.push_back(std::move(metric));
  }
  return family;
}

// The gauges sampled from the registry at each scrape.
class SampledGauges final : public prometheus::Collectable {
 public:
  explicit SampledGauges(ModelsSampler sampler) : sampler_(std::move(sampler)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    ModelsSample s = sampler_ ? sampler_() : SampleModels({});
    return {GaugeFamily("weightd_models", "Model generations held, by state.", "state", s.by_state),
            GaugeFamily("weightd_device_bytes", "Bytes of device segments held, by GPU.", "gpu_uuid", s.device_bytes),
            GaugeFamily("weightd_leases_active", "Leases held by clients (pending or claimed), by model.", "model",
                        s.leases),
            VersionFamily(s),
            GaugeFamily("weightd_host_huge_page_bytes",
                        "Bytes of a model's host segments on 2 MiB pages (hugetlb pool or shmem THP), READY "
                        "generation.",
                        "model", s.huge_page_bytes),
            GaugeFamily("weightd_host_numa_bytes",
                        "Bytes of host segments bound to a NUMA node (models loaded with numa_copies), each "
                        "segment once, by node.",
                        "node", s.numa_bytes),
            GaugeFamily("weightd_layouts", "Runtime layouts published on the generations held, by model.", "model",
                        s.layouts),
            GaugeFamily("weightd_layout_host_bytes", "Bytes of runtime layouts' host segments, by model.", "model",
                        s.layout_host_bytes),
            GaugeFamily("weightd_layout_device_bytes", "Bytes of runtime layouts' device arenas, by GPU.", "gpu_uuid",
                        s.layout_device_bytes)};
  }

  // Always 1 per READY generation; its labels say which version is served.
  static prometheus::MetricFamily VersionFamily(const ModelsSample& s) {
    prometheus::MetricFamily family{"weightd_model_version_info",
                                    "Always 1 for each model's READY generation: its number and version label "
                                    "(set by a writer's commit; empty for loads from disk).",
                                    prometheus::MetricType::Gauge, {}};
    for (const auto& [name, version] : s.versions) {
      prometheus::ClientMetric metric;
      metric.label = {{"model", name}, {"generation", std::to_string(version.first)}, {"version_label", version.second}};
      metric.gauge.value = 1;
      family.metric.push_back(std::move(metric));
    }
    return family;
  }

 private:
  ModelsSampler sampler_;
};

// Where a connection reaches a listener bound to `host` (from HOST:PORT):
// loopback for a wildcard. Numeric addresses only; nullopt for a name.
std::optional<sockaddr_storage> WakeAddress(std::string host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "0.0.0.0") host = "127.0.0.1";
  if (host == "::") host = "::1";
  sockaddr_storage addr{};
  auto* v4 = reinterpret_cast<sockaddr_in*>(&addr);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&addr);
  if (inet_pton(AF_INET, host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
  } else if (inet_pton(AF_INET6, host.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
  } else {
    return std::nullopt;
  }
  return addr;
}

// Opens and closes one connection to `addr` at `port`, waiting 50 ms at
// most for it to be accepted by the kernel.
void Knock(sockaddr_storage addr, int port) {
  socklen_t len = sizeof(sockaddr_in);
  if (addr.ss_family == AF_INET6) {
    reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port = htons(static_cast<uint16_t>(port));
    len = sizeof(sockaddr_in6);
  } else {
    reinterpret_cast<sockaddr_in*>(&addr)->sin_port = htons(static_cast<uint16_t>(port));
  }
  int fd = socket(addr.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    (void)poll(&p, 1, 50);
  }
  close(fd);
}

// Stops the HTTP server. civetweb's listening thread (under
// prometheus::Exposer) polls its sockets with a 2 s timeout
// (SOCKET_TIMEOUT_QUANTUM, civetweb 1.15 src/civetweb.c master_thread_run)
// and looks at the stop flag mg_stop() sets only when that poll returns, so
// a stop took up to 2 s, all of it added to a restart or an upgrade. While
// the exposer stops on a thread of its own, a connection to each of its
// ports every 5 ms wakes that poll; once the flag is set the thread exits
// without accepting it.
void StopExposer(std::unique_ptr<prometheus::Exposer> exposer, const std::optional<sockaddr_storage>& wake) {
  if (exposer == nullptr) return;
  std::vector<int> ports = exposer->GetListeningPorts();
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    exposer.reset();
    stopped = true;
  });
  while (wake.has_value() && !stopped) {
    for (int port : ports) Knock(*wake, port);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stopper.join();
}

}  // namespace

struct PrometheusMetrics::State {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  std::shared_ptr<SampledGauges> sampled;
  std::unique_ptr<prometheus::Exposer> exposer;
  std::optional<sockaddr_storage> wake;  // where a connection reaches the exposer (StopExposer)

  prometheus::Counter* load_bytes;
  prometheus::Histogram* load_duration;
  prometheus::Gauge* load_throughput;
  prometheus::Gauge* host_resident;
  prometheus::Gauge* host_locked;
  prometheus::Histogram* attach_duration;
  prometheus::Family<prometheus::Counter>* checkpoint_errors;
  prometheus::Family<prometheus::Counter>* rpc_requests;
  prometheus::Family<prometheus::Histogram>* rpc_duration;
  prometheus::Counter* updates_started;
  prometheus::Counter* updates_committed;
  prometheus::Family<prometheus::Counter>* updates_aborted;
  prometheus::Counter* update_bytes_written;
  prometheus::Counter* update_bytes_shared;
  prometheus::Histogram* commit_duration;
  prometheus::Gauge* restored_models;
  prometheus::Gauge* restore_seconds;
  prometheus::Family<prometheus::Counter>* restore_dropped;
  // Peer seeding.
  prometheus::Gauge* peer_joiners;
  prometheus::Family<prometheus::Counter>* peer_bytes_sent;
  prometheus::Family<prometheus::Counter>* peer_bytes_received;
  prometheus::Histogram* peer_seed_duration;
  prometheus::Gauge* peer_seed_throughput;
  prometheus::Family<prometheus::Counter>* peer_fallbacks;
  void RegisterPeerMetrics();
  // Runtime layouts.
  prometheus::Counter* layouts_published;
  prometheus::Family<prometheus::Counter>* layouts_aborted;
  prometheus::Histogram* layout_publish_duration;
  prometheus::Family<prometheus::Counter>* layout_attaches;
  void RegisterLayoutMetrics();

  explicit State(const PrometheusOptions& o) : sampled(std::make_shared<SampledGauges>(o.sampler)) {
    using prometheus::BuildCounter, prometheus::BuildGauge, prometheus::BuildHistogram;
    auto& r = *registry;
    load_bytes = &BuildCounter().Name("weightd_load_bytes_total")
                      .Help("Checkpoint bytes read by finished loads.").Register(r).Add({});
    load_duration = &BuildHistogram().Name("weightd_load_duration_seconds")
                         .Help("Duration of finished loads, from request to READY.").Register(r)
                         .Add({}, LoadBuckets());
    load_throughput = &BuildGauge().Name("weightd_load_throughput_bytes_per_second")
                           .Help("Read throughput of the last finished load.").Register(r).Add({});
    host_resident = &BuildGauge().Name("weightd_host_resident_bytes")
                         .Help("Bytes of host segments (sealed memfds) held, current and draining.").Register(r).Add({});
    host_locked = &BuildGauge().Name("weightd_host_locked_bytes")
                       .Help("Bytes of host segments locked in memory with mlock.").Register(r).Add({});
    attach_duration = &BuildHistogram().Name("weightd_attach_duration_seconds")
                           .Help("Server-side duration of successful Attach calls.").Register(r)
                           .Add({}, AttachBuckets());
    checkpoint_errors = &BuildCounter().Name("weightd_checkpoint_errors_total")
                             .Help("Failed loads, by reason.").Register(r);
    for (const std::string& reason : CheckpointErrorReasons()) checkpoint_errors->Add({{"reason", reason}});
    rpc_requests = &BuildCounter().Name("weightd_rpc_requests_total")
                        .Help("Finished gRPC calls, by method and status code.").Register(r);
    rpc_duration = &BuildHistogram().Name("weightd_rpc_duration_seconds")
                        .Help("Duration of finished gRPC calls, by method.").Register(r);
    updates_started = &BuildCounter().Name("weightd_updates_started_total")
                           .Help("Writer updates staged (BeginUpdate).").Register(r).Add({});
    updates_committed = &BuildCounter().Name("weightd_updates_committed_total")
                             .Help("Writer updates committed and published.").Register(r).Add({});
    updates_aborted = &BuildCounter().Name("weightd_updates_aborted_total")
                           .Help("Writer updates ended without a commit, by reason.").Register(r);
    for (const char* reason : kUpdateAbortReasons) updates_aborted->Add({{"reason", reason}});
    update_bytes_written = &BuildCounter().Name("weightd_update_bytes_written_total")
                                .Help("Bytes of staged segments published by committed updates.").Register(r).Add({});
    update_bytes_shared = &BuildCounter().Name("weightd_update_bytes_shared_total")
                               .Help("Bytes of segments committed updates shared with the generation before, "
                                     "summed over commits.").Register(r).Add({});
    commit_duration = &BuildHistogram().Name("weightd_update_commit_duration_seconds")
                           .Help("Duration of successful commits: seal, hash, verify, publish.").Register(r)
                           .Add({}, AttachBuckets());
    restored_models = &BuildGauge().Name("weightd_fd_store_restored_models")
                           .Help("Models this daemon restored from the fd store at start, without reading a checkpoint.")
                           .Register(r).Add({});
    restore_seconds = &BuildGauge().Name("weightd_fd_store_restore_seconds")
                           .Help("Seconds the start-up restore from the fd store took, all records together.")
                           .Register(r).Add({});
    restore_dropped = &BuildCounter().Name("weightd_fd_store_records_dropped_total")
                           .Help("State records in the fd store dropped at start instead of restored, by reason.").Register(r);
    for (const char* reason : kRestoreDropReasons) restore_dropped->Add({{"reason", reason}});
    RegisterPeerMetrics();
    RegisterLayoutMetrics();
    BuildGauge().Name("weightd_build_info").Help("Always 1; the version of this weightd binary.").Register(r)
        .Add({{"version", o.version}}).Set(1);
  }
};

PrometheusMetrics::PrometheusMetrics(std::unique_ptr<State> state) : state_(std::move(state)) {}

PrometheusMetrics::~PrometheusMetrics() { StopExposer(std::move(state_->exposer), state_->wake); }

absl::StatusOr<std::unique_ptr<PrometheusMetrics>> PrometheusMetrics::Create(PrometheusOptions options) {
  auto state = std::make_unique<State>(options);
  if (!options.address.empty()) {
    if (options.address.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat("--metrics-address must be HOST:PORT, got '", options.address, "'"));
    }
    try {
      state->exposer = std::make_unique<prometheus::Exposer>(options.address, 2);
    } catch (const std::exception& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot serve metrics on --metrics-address ", options.address, ": ", e.what()));
    }
    state->wake = WakeAddress(options.address.substr(0, options.address.rfind(':')));
    state->exposer->RegisterCollectable(state->registry);
    state->exposer->RegisterCollectable(state->sampled);
  }
  return std::unique_ptr<PrometheusMetrics>(new PrometheusMetrics(std::move(state)));
}

int PrometheusMetrics::port() const {
  if (!state_->exposer) return 0;
  std::vector<int> ports = state_->exposer->GetListeningPorts();
  return ports.empty() ? 0 : ports[0];
}

std::string PrometheusMetrics::Exposition() const {
  std::vector<prometheus::MetricFamily> families = state_->registry->Collect();
  for (auto& f : state_->sampled->Collect()) families.push_back(std::move(f));
  return prometheus::TextSerializer().Serialize(families);
}

void PrometheusMetrics::LoadFinished(uint64_t bytes, double seconds) {
  state_->load_bytes->Increment(static_cast<double>(bytes));
  state_->load_duration->Observe(seconds);
  if (seconds > 0) state_->load_throughput->Set(static_cast<double>(bytes) / seconds);
}

void PrometheusMetrics::UpdateStarted() { state_->updates_started->Increment(); }

void PrometheusMetrics::UpdateCommitted(uint64_t bytes_written, uint64_t bytes_shared, double seconds) {
  state_->updates_committed->Increment();
  state_->update_bytes_written->Increment(static_cast<double>(bytes_written));
  state_->update_bytes_shared->Increment(static_cast<double>(bytes_shared));
  state_->commit_duration->Observe(seconds);
}

void PrometheusMetrics::UpdateAborted(absl::string_view reason) {
  state_->updates_aborted->Add({{"reason", std::string(reason)}}).Increment();
}

void PrometheusMetrics::ModelsRestored(int models, double seconds) {
  state_->restored_models->Set(models);
  state_->restore_seconds->Set(seconds);
}

void PrometheusMetrics::RestoreRecordDropped(absl::string_view reason) {
  state_->restore_dropped->Add({{"reason", std::string(reason)}}).Increment();
}

void PrometheusMetrics::LoadFailed(const absl::Status& status) {
  state_->checkpoint_errors->Add({{"reason", CheckpointErrorReason(status)}}).Increment();
}

void PrometheusMetrics::HostMemory(uint64_t resident_bytes, uint64_t locked_bytes) {
  state_->host_resident->Set(static_cast<double>(resident_bytes));
  state_->host_locked->Set(static_cast<double>(locked_bytes));
}

void PrometheusMetrics::AttachFinished(double seconds) { state_->attach_duration->Observe(seconds); }

void PrometheusMetrics::RpcFinished(absl::string_view method, absl::string_view code, double seconds) {
  std::string m(method);
  state_->rpc_requests->Add({{"method", m}, {"code", std::string(code)}}).Increment();
  state_->rpc_duration->Add({{"method", m}}, RpcBuckets()).Observe(seconds);
}

// ---------------------------------------------------------------- peer seeding

void PrometheusMetrics::State::RegisterPeerMetrics() {
  using prometheus::BuildCounter, prometheus::BuildGauge, prometheus::BuildHistogram;
  auto& r = *registry;
  peer_joiners = &BuildGauge().Name("weightd_peer_joiners")
                      .Help("Peer transfer sessions this seed serves now.").Register(r).Add({});
  peer_bytes_sent = &BuildCounter().Name("weightd_peer_bytes_sent_total")
                         .Help("Bytes joiners reported reading from this seed, by joiner address.").Register(r);
  peer_bytes_received = &BuildCounter().Name("weightd_peer_bytes_received_total")
                             .Help("Bytes received from seeds, by peer address (failed transfers included).")
                             .Register(r);
  peer_seed_duration = &BuildHistogram().Name("weightd_peer_seed_duration_seconds")
                            .Help("Duration of verified seedings from a peer, from the request to READY.")
                            .Register(r).Add({}, LoadBuckets());
  peer_seed_throughput = &BuildGauge().Name("weightd_peer_seed_throughput_bytes_per_second")
                              .Help("Host bytes per second of the last verified seeding from a peer.").Register(r)
                              .Add({});
  peer_fallbacks = &BuildCounter().Name("weightd_peer_fallbacks_total")
                        .Help("Peers given up during a load, by reason (then the next peer, then storage).")
                        .Register(r);
  for (const char* reason : kPeerFallbackReasons) peer_fallbacks->Add({{"reason", reason}});
}

void PrometheusMetrics::PeerJoiners(int open) { state_->peer_joiners->Set(open); }

void PrometheusMetrics::PeerBytesSent(absl::string_view peer, uint64_t bytes) {
  state_->peer_bytes_sent->Add({{"peer", std::string(peer)}}).Increment(static_cast<double>(bytes));
}

void PrometheusMetrics::PeerBytesReceived(absl::string_view peer, uint64_t bytes) {
  state_->peer_bytes_received->Add({{"peer", std::string(peer)}}).Increment(static_cast<double>(bytes));
}

void PrometheusMetrics::PeerSeeded(absl::string_view, uint64_t bytes, double seconds) {
  state_->peer_seed_duration->Observe(seconds);
  if (seconds > 0) state_->peer_seed_throughput->Set(static_cast<double>(bytes) / seconds);
}

void PrometheusMetrics::PeerFallback(absl::string_view reason) {
  state_->peer_fallbacks->Add({{"reason", std::string(reason)}}).Increment();
}

// ------------------------------------------------------------- runtime layouts

void PrometheusMetrics::State::RegisterLayoutMetrics() {
  using prometheus::BuildCounter, prometheus::BuildHistogram;
  auto& r = *registry;
  layouts_published = &BuildCounter().Name("weightd_layout_publishes_total")
                           .Help("Runtime layouts committed and published.").Register(r).Add({});
  layouts_aborted = &BuildCounter().Name("weightd_layout_aborts_total")
                         .Help("Runtime layout publishes ended without a layout, by reason.").Register(r);
  for (const char* reason : kLayoutAbortReasons) layouts_aborted->Add({{"reason", reason}});
  layout_publish_duration = &BuildHistogram().Name("weightd_layout_publish_duration_seconds")
                                 .Help("Duration of layout commits: seal, hash, device copy, publish.").Register(r)
                                 .Add({}, AttachBuckets());
  layout_attaches = &BuildCounter().Name("weightd_layout_attaches_total")
                         .Help("Attaches that named a runtime layout, by result (hit, not_found, identity_mismatch).")
                         .Register(r);
  for (const char* result : kLayoutAttachResults) layout_attaches->Add({{"result", result}});
}

void PrometheusMetrics::LayoutPublished(double seconds) {
  state_->layouts_published->Increment();
  state_->layout_publish_duration->Observe(seconds);
}

void PrometheusMetrics::LayoutAborted(absl::string_view reason) {
  state_->layouts_aborted->Add({{"reason", std::string(reason)}}).Increment();
}

void PrometheusMetrics::LayoutAttach(absl::string_view result) {
  state_->layout_attaches->Add({{"result", std::string(result)}}).Increment();
}

}  // namespace weightd
