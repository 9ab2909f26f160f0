#include "server/daemon.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <systemd/sd-daemon.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <map>
#include <thread>

#include "absl/strings/str_format.h"
#include "common/io/env.h"
#include "common/memory/device.h"
#include "common/base/log.h"
#include "common/io/host_memory.h"
#include "common/io/model_roots.h"
#include "common/base/status.h"
#include "common/transport/unix_socket.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/listen/fd_channel.h"
#include "server/restart/fd_store.h"
#include "server/restart/record_key.h"
#include "server/restart/restore.h"
#include "server/restart/upgrade.h"
#include "server/listen/grpc_acceptor.h"
#include "server/listen/grpc_limits.h"
#include "server/listen/health_port.h"
#include "server/ops/metrics_listener.h"
#include "server/ops/prometheus_metrics.h"
#include "server/path_lock.h"
#include "server/peer/peer_join.h"
#include "server/peer/peer_seed.h"
#include "server/listen/peer_service.h"
#include "server/registry/registry.h"
#include "server/listen/rpc_metrics.h"
#include "server/ops/self_check.h"
#include "server/api/service.h"
#include "server/listen/tcp_listener.h"

namespace weightd {
namespace {

// The largest request the Unix socket's gRPC server reads, in bytes.
constexpr int kMaxUnixSocketRequestBytes = 256 << 20;

// Health, logs and systemd status follow the registry. Every server's
// health service mirrors the per-model statuses, also those set before the
// server was added.
class DaemonListener final : public RegistryListener {
 public:
  void AddServer(grpc::Server* server) {
    absl::MutexLock lock(&mu_);
    servers_.push_back(server);
    for (const auto& [name, serving] : serving_) server->GetHealthCheckService()->SetServingStatus(name, serving);
  }

  void OnModelServing(const std::string& name, bool serving) override {
    absl::MutexLock lock(&mu_);
    serving_[name] = serving;
    for (grpc::Server* server : servers_) server->GetHealthCheckService()->SetServingStatus(name, serving);
  }
  void OnLoadFinished(const ModelGeneration& m, uint64_t bytes, double seconds) override {
    std::string line = absl::StrFormat("loaded '%s' generation %d: %d tensors, %d bytes in %.3f s (%.2f GB/s), fingerprint %s",
                                       m.request.name, m.generation, m.tensor_count, bytes, seconds,
                                       seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0, m.fingerprint);
    LogInfo(line);
    for (const std::string& w : m.warnings) LogWarning(absl::StrCat("'", m.request.name, "': ", w));
    sd_notify(0, ("STATUS=" + line).c_str());
  }
  void OnUpdateStarted(const std::string& name, uint64_t bytes_staged) override {
    LogInfo(absl::StrFormat("update of '%s' staged: %d bytes copied into writable segments", name, bytes_staged));
  }
  void OnUpdateCommitted(const ModelGeneration& m, uint64_t bytes_written, uint64_t bytes_shared, uint32_t changed,
                         double seconds) override {
    std::string line = absl::StrFormat(
        "committed update of '%s' as generation %d (version label '%s'): %d tensors changed, %d bytes written, %d "
        "bytes shared, commit %.3f s, fingerprint %s",
        m.request.name, m.generation, m.version_label, changed, bytes_written, bytes_shared, seconds, m.fingerprint);
    LogInfo(line);
    sd_notify(0, ("STATUS=" + line).c_str());
  }
  void OnUpdateAborted(const std::string& name, const std::string& reason) override {
    LogWarning(absl::StrCat("update of '", name, "' aborted: ", reason));
  }
  void OnLoadFailed(const LoadRequest& request, const absl::Status& status) override {
    // The name and path may be a refused request's, as the client sent them.
    // A reload of no model has no path: "(none)" keeps the line's shape.
    std::string path = request.checkpoint_path.empty() ? "(none)" : ElideName(request.checkpoint_path);
    LogWarning(absl::StrCat("load of ", QuoteName(request.name), " from ", path, " failed: ",
                            CapMessage(status.message())));
  }

 private:
  absl::Mutex mu_;
  std::vector<grpc::Server*> servers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, bool> serving_ ABSL_GUARDED_BY(mu_);
};

// Hands every registry event to each listener in turn. Add() them all before
// the registry is used.
class ListenerFanOut final : public RegistryListener {
 public:
  void Add(RegistryListener* listener) { listeners_.push_back(listener); }
  void OnModelServing(const std::string& name, bool serving) override {
    for (auto* l : listeners_) l->OnModelServing(name, serving);
  }
  void OnLoadFinished(const ModelGeneration& m, uint64_t bytes, double seconds) override {
    for (auto* l : listeners_) l->OnLoadFinished(m, bytes, seconds);
  }
  void OnGenerationPublished(const std::shared_ptr<ModelGeneration>& model) override {
    for (auto* l : listeners_) l->OnGenerationPublished(model);
  }
  void OnModelUnloaded(const std::string& name) override {
    for (auto* l : listeners_) l->OnModelUnloaded(name);
  }
  void OnLoadFailed(const LoadRequest& request, const absl::Status& status) override {
    for (auto* l : listeners_) l->OnLoadFailed(request, status);
  }
  void OnLeaseClaimed(const std::string& name, double seconds) override {
    for (auto* l : listeners_) l->OnLeaseClaimed(name, seconds);
  }
  void OnLeasesChanged(const std::string& name, int active) override {
    for (auto* l : listeners_) l->OnLeasesChanged(name, active);
  }
  void OnMemoryChanged(uint64_t host, uint64_t locked) override {
    for (auto* l : listeners_) l->OnMemoryChanged(host, locked);
  }
  void OnUpdateStarted(const std::string& name, uint64_t bytes) override {
    for (auto* l : listeners_) l->OnUpdateStarted(name, bytes);
  }
  void OnUpdateCommitted(const ModelGeneration& m, uint64_t written, uint64_t shared, uint32_t changed,
                         double seconds) override {
    for (auto* l : listeners_) l->OnUpdateCommitted(m, written, shared, changed, seconds);
  }
  void OnUpdateAborted(const std::string& name, const std::string& reason) override {
    for (auto* l : listeners_) l->OnUpdateAborted(name, reason);
  }
  void OnLayoutPublished(const Layout& layout) override {
    for (auto* l : listeners_) l->OnLayoutPublished(layout);
  }
  void OnLayoutAborted(const std::string& name, const std::string& reason) override {
    for (auto* l : listeners_) l->OnLayoutAborted(name, reason);
  }
  void OnLayoutAttach(const std::string& name, const std::string& result) override {
    for (auto* l : listeners_) l->OnLayoutAttach(name, result);
  }
  void OnLayoutsChanged(const std::shared_ptr<ModelGeneration>& model) override {
    for (auto* l : listeners_) l->OnLayoutsChanged(model);
  }

 private:
  std::vector<RegistryListener*> listeners_;
};

// How long each self-check probe may take.
constexpr std::chrono::milliseconds kProbeDeadline{2000};

// "0.0.0.0:0" with the port bound -> "0.0.0.0:41234", for the log.
std::string BoundAddress(const std::string& address, int port) {
  return absl::StrCat(address.substr(0, address.rfind(':')), ":", port);
}

// The record key beside `socket` (server/restart/record_key.h); without one (a
// warning says why) records carry no HMAC and restores hash every host byte.
std::optional<RecordKey> LoadRecordKey(const std::string& socket) {
  absl::StatusOr<RecordKey> key = RecordKey::Load(RecordKeyPath(socket));
  if (key.ok()) return std::move(*key);
  LogWarning(absl::StrCat(key.status().message(), "; state records are not authenticated, so a restart or upgrade "
                          "hashes every host tensor again before serving it"));
  return std::nullopt;
}

class DaemonImpl final : public Daemon {
 public:
  DaemonImpl(const DaemonConfig& config, std::vector<NamedFd> inherited)
      : config_(config),
        binary_(SelfBinaryPath()),
        record_key_(LoadRecordKey(config.socket)),
        inherited_(std::move(inherited)) {
    listeners_.Add(&listener_);
    fd_store_ = std::make_unique<FdStoreKeeper>(MakeSystemdFdStore(), record_key_ ? &*record_key_ : nullptr);
    listeners_.Add(fd_store_.get());
  }
  ~DaemonImpl() override { Shutdown(); }

  absl::Status Init() {
    // One daemon per socket path: every path this daemon binds is locked
    // before it is unlinked or bound, so a second daemon sharing any of them
    // neither takes over nor removes the first one's sockets.
    WEIGHTD_RETURN_IF_ERROR(LockPath(config_.socket, "--socket"));
    WEIGHTD_RETURN_IF_ERROR(LockPath(config_.fd_socket, "--fd-socket"));
    owns_socket_ = true;
    std::string chosen;
    absl::StatusOr<std::unique_ptr<DeviceBackend>> backend = MakeDeviceBackend(config_.device_backend, &chosen);
    if (!backend.ok()) return Annotate(backend.status(), absl::StrCat("--device-backend ", config_.device_backend));
    device_backend_ = std::move(*backend);
    LogInfo(chosen);
    RegistryOptions options;
    options.loader.device_backend = device_backend_.get();
    std::vector<std::string> root_warnings;
    WEIGHTD_RETURN_IF_ERROR(ModelRoots::Validate(*Env::Default(), config_.model_root, &root_warnings));
    for (const std::string& w : root_warnings) LogWarning(w);
    options.model_roots = config_.model_root;
    options.loader.threads = config_.load_threads;
    options.loader.mlock = config_.mlock;
    options.loader.huge_pages = config_.huge_pages;
    options.loader.direct_io = ParseDirectIo(config_.direct_io).value_or(DirectIo::kAuto);  // validated by config
    options.claim_timeout = std::chrono::milliseconds(static_cast<int64_t>(config_.lease_claim_timeout_seconds * 1000));
    options.watch.max_watchers = static_cast<size_t>(config_.max_watchers);
    options.watch.queue_events = static_cast<size_t>(config_.watch_queue_events);
    WEIGHTD_RETURN_IF_ERROR(StartPeerTransport());
    options.seed_source = peer_joiner_.get();
    options.hold_pinning = true;  // released once every listener is up: see below
    registry_ = std::make_unique<ModelRegistry>(options, &listeners_);
    if (absl::StatusOr<HostMemoryBudget> budget = ReadHostMemoryBudget(); budget.ok()) {
      LogInfo(absl::StrCat("host memory for loads: ", budget->available, " bytes, bounded by ", budget->source));
    }
    WEIGHTD_RETURN_IF_ERROR(StartMetrics());
    Restore();
    absl::StatusOr<std::unique_ptr<FdChannel>> channel = FdChannel::Start({config_.fd_socket, 0660, config_.allowed_gids,
                                                                          static_cast<size_t>(config_.fd_socket_max_connections)},
                                                                         registry_.get());
    if (!channel.ok()) return channel.status();
    fd_channel_ = std::move(*channel);
    service_ = std::make_unique<WeightdService>(registry_.get(), config_.fd_socket, config_.mlock, encodings_);
    service_->EnableUpgrade([this]() -> absl::StatusOr<std::string> {
      WEIGHTD_ASSIGN_OR_RETURN(std::string binary, binary_);
      WEIGHTD_RETURN_IF_ERROR(CheckUpgradable(binary));
      kill(getpid(), SIGHUP);  // main() takes it: the same path as `kill -HUP`
      return binary;
    });
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();  // every builder from here on; the health port opts out
    WEIGHTD_RETURN_IF_ERROR(StartGrpc());
    LogInfo(absl::StrCat("listening on unix:", config_.socket, " (fd socket ", config_.fd_socket, ")"));
    WEIGHTD_RETURN_IF_ERROR(StartTcpListener());
    WEIGHTD_RETURN_IF_ERROR(StartHealthPort());
    WEIGHTD_RETURN_IF_ERROR(StartPeerListener());
    sd_notify(0, "READY=1\nSTATUS=listening");
    registry_->ReleasePinning();  // restored models are pinned from here on, off a restart's critical path
    StartSelfCheck();
    preload_thread_ = std::thread([this] { Preload(); });
    return absl::OkStatus();
  }

  void Shutdown() override { Stop("STOPPING=1"); }
  void ShutdownForUpgrade() override { Stop("RELOADING=1\nSTATUS=upgrading in place"); }
  std::vector<NamedFd> Handoff() override { return fd_store_->Handoff(); }

  void Stop(const char* notify) {
    if (shut_down_.exchange(true)) return;
    sd_notify(0, notify);
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    if (registry_) registry_->CancelLoads();  // a load in flight ends now with UNAVAILABLE
    if (registry_) registry_->StopPinning();  // its completions call the metrics listener, destroyed before the registry
    if (registry_) {  // still answering meanwhile: the page tables' teardown is not down time
      auto start = std::chrono::steady_clock::now();
      uint64_t bytes = registry_->DropHostPageTables();
      LogInfo(absl::StrFormat("dropped the page tables of %d host bytes in %.1f ms, still serving", bytes,
                              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count()));
    }
    if (registry_) registry_->StopWatches();  // watch streams end now with UNAVAILABLE, not at the grace deadline
    if (self_check_thread_.joinable()) self_check_thread_.join();
    acceptor_.reset();  // no new connections
    if (tcp_listener_) tcp_listener_->Shutdown(std::chrono::seconds(10));
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (health_port_) health_port_->Shutdown();
    if (peer_listener_) peer_listener_->Shutdown();  // sessions end, leases go back
    if (preload_thread_.joinable()) preload_thread_.join();
    fd_channel_.reset();
    if (owns_socket_) unlink(config_.socket.c_str());
    LogInfo("stopped");
  }

 private:
  absl::Status LockPath(const std::string& path, const std::string& flag) {
    WEIGHTD_ASSIGN_OR_RETURN(PathLock lock, PathLock::Acquire(path, flag));
    locks_.push_back(std::move(lock));
    return absl::OkStatus();
  }

  // The grpc_* bounds of the config, for every gRPC server.
  GrpcServerLimits GrpcLimits() const {
    return {.max_threads = config_.grpc_max_threads,
            .max_streams_per_connection = config_.grpc_max_streams_per_connection,
            .max_connections = static_cast<size_t>(config_.grpc_max_connections),
            .first_bytes_timeout = std::chrono::milliseconds(
                static_cast<int64_t>(config_.grpc_first_bytes_timeout_seconds * 1000))};
  }

  // The gRPC server of the Unix socket, whose connections our own
  // GrpcAcceptor accepts (gRPC's listener never re-arms after EMFILE);
  // threads and streams bounded.
  absl::Status StartGrpc() {
    grpc::ServerBuilder builder;
    builder.RegisterService(service_.get());
    builder.SetMaxSendMessageSize(-1);
    // A BeginLayout of many tensors (docs/api.md "Runtime layouts": about
    // 100 bytes a tensor spec) outgrows gRPC's 4 MiB default; 256 MiB holds
    // well over a million, the request's own bound.
    builder.SetMaxReceiveMessageSize(kMaxUnixSocketRequestBytes);
    ApplyGrpcLimits(GrpcLimits(), builder);
    CountRpcs(builder, metrics_.get());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) return absl::UnavailableError("cannot start the gRPC server");
    listener_.AddServer(server_.get());
    GrpcAcceptorOptions accept;
    accept.path = config_.socket;
    accept.max_connections = GrpcLimits().max_connections;
    accept.first_bytes_timeout = GrpcLimits().first_bytes_timeout;
    WEIGHTD_ASSIGN_OR_RETURN(acceptor_, GrpcAcceptor::Start(std::move(accept), server_.get()));
    return absl::OkStatus();
  }

  absl::Status StartMetrics() {
    WEIGHTD_ASSIGN_OR_RETURN(metrics_, PrometheusMetrics::Create({config_.metrics_address, WEIGHTD_VERSION,
                                                                  [this] { return SampleModels(registry_->ListAll()); }}));
    metrics_listener_ = std::make_unique<MetricsListener>(metrics_.get());
    listeners_.Add(metrics_listener_.get());
    if (metrics_->port() != 0) {
      LogInfo(absl::StrCat("metrics on http://", BoundAddress(config_.metrics_address, metrics_->port()), "/metrics"));
    }
    return absl::OkStatus();
  }

  // Serves again the models a restarted daemon left in the fd store (or an
  // in-place upgrade handed over), before any socket answers: a client never
  // sees a restored model missing. See server/restart/restore.h.
  void Restore() {
    std::vector<NamedFd> fds = std::move(inherited_);
    if (fds.empty()) return;
    auto start = std::chrono::steady_clock::now();
    size_t passed = fds.size();
    ModelRoots roots = ModelRoots::Resolve(*Env::Default(), config_.model_root);
    RestoreResult result =
        RestoreFromFdStore(std::move(fds), {&roots, device_backend_.get(), record_key_ ? &*record_key_ : nullptr});
    int restored = 0;
    for (RestoredModel& r : result.models) {
      std::shared_ptr<ModelGeneration> model = std::move(r.model);
      std::vector<std::pair<std::shared_ptr<const Layout>, std::vector<std::string>>> layouts;
      for (RestoredModel::RestoredLayout& l : r.layouts) layouts.emplace_back(l.layout, std::move(l.segment_names));
      fd_store_->Adopted(model, r.record_name, std::move(r.record_fd), r.host_segment_names, r.arena_names, layouts);
      if (absl::Status adopted = registry_->Adopt(model); !adopted.ok()) {
        LogWarning(absl::StrCat("fd store: cannot restore '", model->request.name, "': ", adopted.message()));
        continue;
      }
      ++restored;
      LogInfo(absl::StrFormat("restored '%s' generation %d from the fd store in %.1f ms without reading the checkpoint "
                              "(%s): %d tensors, %d host bytes, %d segments, fingerprint %s%s",
                              model->request.name, model->generation, r.seconds * 1e3,
                              r.authenticated ? "record authenticated by its HMAC"
                                              : "record not authenticated: every host tensor hashed again",
                              model->tensor_count, model->host_bytes, model->segments.size(), model->fingerprint,
                              model->version_label.empty() ? "" : absl::StrCat(", version label ", model->version_label)));
      if (!r.layouts.empty()) {
        LogInfo(absl::StrCat("restored ", r.layouts.size(), " runtime layout(s) of '", model->request.name,
                             "' generation ", model->generation, " from the fd store"));
      }
    }
    for (const DroppedRecord& d : result.dropped) {
      LogWarning(absl::StrCat("fd store: dropped record ", d.fd_name, d.model.empty() ? "" : absl::StrCat(" of '", d.model, "'"),
                              " (", d.reason, "): ", d.message));
      metrics_->RestoreRecordDropped(d.reason);
    }
    for (const std::string& name : result.unused) fd_store_->Drop(name);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    metrics_->ModelsRestored(restored, seconds);
    LogInfo(absl::StrFormat("fd store: %d fds passed, %d models restored, %d records dropped, in %.1f ms", passed,
                            restored, result.dropped.size(), seconds * 1e3));
  }

  absl::Status StartTcpListener() {
    if (config_.grpc_address.empty()) return absl::OkStatus();
    TcpListenerOptions tcp{.address = config_.grpc_address,
                           .tls_cert = config_.grpc_tls_cert,
                           .tls_key = config_.grpc_tls_key,
                           .tls_client_ca = config_.grpc_tls_client_ca,
                           .admin = config_.grpc_tcp_admin,
                           .fd_socket = config_.fd_socket,
                           .mlock = config_.mlock,
                           .encodings = encodings_,
                           .limits = GrpcLimits()};
    WEIGHTD_ASSIGN_OR_RETURN(tcp_listener_, TcpListener::Start(tcp, registry_.get(), metrics_.get()));
    listener_.AddServer(tcp_listener_->server());
    LogInfo(absl::StrCat("gRPC TCP listener on ", BoundAddress(config_.grpc_address, tcp_listener_->port()), " (",
                         tcp_listener_->mode(), ")"));
    return absl::OkStatus();
  }

  absl::Status StartHealthPort() {
    if (config_.health_address.empty()) return absl::OkStatus();
    WEIGHTD_ASSIGN_OR_RETURN(health_port_, HealthPort::Start(config_.health_address, metrics_.get()));
    listener_.AddServer(health_port_->server());
    LogInfo(absl::StrCat("health service on ", BoundAddress(config_.health_address, health_port_->port())));
    return absl::OkStatus();
  }

  // The joiner always (its transport is made on the first load that names
  // peers); the transport at once when this daemon seeds (--peer-address).
  absl::Status StartPeerTransport() {
    PeerJoinOptions join;
    join.peers = config_.peers;
    join.deadline = std::chrono::milliseconds(static_cast<int64_t>(config_.peer_deadline_seconds * 1000));
    join.lanes = static_cast<uint32_t>(config_.peer_lanes);
    join.hashing = config_.peer_verify == "per-transfer" ? SourceHashing::kPerTransfer : SourceHashing::kPerSegment;
    join.transport = [this]() -> absl::StatusOr<PeerTransport*> { return PeerTransportOnce(); };
    if (!config_.peer_tls_cert.empty()) {
      grpc::SslCredentialsOptions tls;
      WEIGHTD_ASSIGN_OR_RETURN(tls.pem_root_certs, ReadPemFile("--peer-tls-ca", config_.peer_tls_ca));
      WEIGHTD_ASSIGN_OR_RETURN(tls.pem_private_key, ReadPemFile("--peer-tls-key", config_.peer_tls_key));
      WEIGHTD_ASSIGN_OR_RETURN(tls.pem_cert_chain, ReadPemFile("--peer-tls-cert", config_.peer_tls_cert));
      join.credentials = grpc::SslCredentials(tls);
      join.tls_server_name = config_.peer_tls_server_name;
    }
    peer_joiner_ = std::make_unique<PeerJoiner>(std::move(join));
    // A seed, or a node configured with peers, checks its helper and helper
    // user now, so that a mistake stops the start instead of every load.
    if (config_.peer_address.empty() && config_.peers.empty()) return absl::OkStatus();
    return PeerTransportOnce().status();
  }

  absl::StatusOr<PeerTransport*> PeerTransportOnce() {
    absl::MutexLock lock(&peer_mu_);
    if (peer_transport_ == nullptr) {
      UcxHelperOptions helper;
      helper.helper_path = config_.peer_helper.empty() ? DefaultPeerHelperPath() : config_.peer_helper;
      helper.user = config_.peer_helper_user;
      helper.sandbox = config_.peer_helper_sandbox;
      if (config_.peer_test_fault == "helper-keeps-mapping") helper.test_fault = "keep-mapping";
      if (config_.peer_test_fault == "helper-writes-late") helper.test_fault = "late-write";
      if (!helper.test_fault.empty()) LogWarning(absl::StrCat("TEST FAULT '", config_.peer_test_fault, "' in joiner helpers"));
      if (!helper.sandbox) LogWarning("--peer-helper-sandbox false: transfer helpers run without Landlock and seccomp");
      WEIGHTD_ASSIGN_OR_RETURN(peer_transport_, MakeUcxHelperTransport(helper));
      LogInfo(absl::StrCat("peer transport: UCX, one ", helper.helper_path, " process per transfer",
                           geteuid() == 0 && !helper.user.empty() ? absl::StrCat(", run as user '", helper.user, "'")
                                                                 : std::string()));
    }
    return peer_transport_.get();
  }

  absl::Status StartPeerListener() {
    peer_joiner_->set_metrics(metrics_.get());
    if (config_.peer_address.empty()) return absl::OkStatus();
    PeerSeedOptions seed;
    seed.max_joiners = config_.peer_max_joiners;
    seed.session_limit = std::chrono::milliseconds(static_cast<int64_t>(config_.peer_deadline_seconds * 1000));
    seed.test_fault = config_.peer_test_fault;
    WEIGHTD_ASSIGN_OR_RETURN(PeerTransport * transport, PeerTransportOnce());
    peer_seed_ = std::make_unique<PeerSeed>(registry_.get(), transport, seed, metrics_.get());
    PeerListenerOptions listen{.address = config_.peer_address,
                               .tls_cert = config_.peer_tls_cert,
                               .tls_key = config_.peer_tls_key,
                               .tls_ca = config_.peer_tls_ca,
                               .limits = GrpcLimits()};
    WEIGHTD_ASSIGN_OR_RETURN(peer_listener_, PeerListener::Start(listen, peer_seed_.get(), metrics_.get()));
    listener_.AddServer(peer_listener_->server());
    LogInfo(absl::StrCat("peer listener on ", BoundAddress(config_.peer_address, peer_listener_->port()),
                         " (weightd.v1.Peer, read-only, ", config_.peer_tls_cert.empty() ? "plain TCP" : "mutual TLS",
                         "; at most ", config_.peer_max_joiners, " joiners)",
                         config_.peer_test_fault.empty() ? "" : absl::StrCat("; TEST FAULT '", config_.peer_test_fault, "'")));
    return absl::OkStatus();
  }

  void Preload() {
    for (const auto& [name, path] : config_.preload) {
      if (Stopping()) return;
      LoadRequest request;
      request.name = name;
      request.checkpoint_path = path;
      if (auto plan = config_.preload_plans.find(name); plan != config_.preload_plans.end()) {
        const PreloadPlan& p = plan->second;
        request.host_resident_patterns = p.host_resident;
        request.include_patterns = p.include;
        request.exclude_patterns = p.exclude;
        request.tp_size = p.tp_size;
        request.devices = p.devices;
        request.numa_copies = p.numa_copies;
        for (const std::string& rule : p.tp_rules) {  // each one parses: the config's validation checked
          if (std::optional<TpRule> parsed = ParseTpRule(rule)) request.tp_rules.push_back(std::move(*parsed));
        }
      }
      absl::StatusOr<ModelRegistry::LoadResult> result = registry_->Load(request, nullptr);
      if (!result.ok()) LogError(absl::StrCat("preload '", name, "' from ", path, " failed: ", result.status().message()));
    }
  }

  // Probes every listener each interval (at most half the watchdog timeout
  // when systemd asked for one) and sends WATCHDOG=1 only while all answer:
  // a daemon that stays wedged is restarted by systemd, not left serving
  // nothing. Logs one line when the check starts failing and one when it
  // passes again.
  void StartSelfCheck() {
    auto interval = std::chrono::duration<double>(config_.self_check_interval_seconds);
    uint64_t usec = 0;
    bool watchdog = sd_watchdog_enabled(0, &usec) > 0;
    if (watchdog) interval = std::min(interval, std::chrono::duration<double>(usec / 2e6));
    SelfCheckTargets targets{config_.socket, config_.fd_socket, {}, {}};
    if (tcp_listener_) targets.accepting.push_back(LocalTarget(config_.grpc_address, tcp_listener_->port()));
    if (peer_listener_) targets.accepting.push_back(LocalTarget(config_.peer_address, peer_listener_->port()));
    if (health_port_) {
      targets.grpc_targets.push_back(LocalTarget(config_.health_address, health_port_->port()));
      targets.accepting.push_back(LocalTarget(config_.health_address, health_port_->port()));
    }
    self_check_thread_ = std::thread([this, interval, watchdog, targets] {
      absl::Status last;  // logged once per change: failing, failing for another reason, passing again
      while (!WaitOrStop(interval)) {
        encodings_->DropFreed();  // Attach's reply bodies of generations freed since
        absl::Status status = ProbeListeners(targets, kProbeDeadline);
        if (status != last) {
          if (status.ok()) LogInfo("self-check passes again");
          if (!status.ok()) LogError(absl::StrCat("self-check failed: ", status.message(), watchdog ? "; WATCHDOG=1 withheld" : ""));
          last = status;
        }
        if (status.ok() && watchdog) sd_notify(0, "WATCHDOG=1");
      }
    });
  }

  // Waits `d`; true when the daemon is stopping.
  bool WaitOrStop(std::chrono::duration<double> d) {
    absl::MutexLock lock(&mu_);
    return mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::Seconds(d.count()));
  }

  bool Stopping() {
    absl::MutexLock lock(&mu_);
    return stopping_;
  }

  const DaemonConfig config_;
  const absl::StatusOr<std::string> binary_;  // what an upgrade executes: this binary's path at start
  const std::optional<RecordKey> record_key_;  // authenticates state records; outlives fd_store_
  std::vector<PathLock> locks_;  // one per bound Unix path, held until exit
  bool owns_socket_ = false;     // every lock is ours: the socket paths may be unlinked
  DaemonListener listener_;
  ListenerFanOut listeners_;
  std::unique_ptr<DeviceBackend> device_backend_;  // outlives the registry's generations
  std::unique_ptr<FdStoreKeeper> fd_store_;         // outlives the registry, which calls it
  absl::Mutex peer_mu_;
  std::unique_ptr<PeerTransport> peer_transport_ ABSL_GUARDED_BY(peer_mu_);  // outlives peer sessions and loads
  std::unique_ptr<PeerJoiner> peer_joiner_;
  std::unique_ptr<ModelRegistry> registry_;
  std::unique_ptr<PrometheusMetrics> metrics_;  // destroyed before registry_, which it samples on each scrape
  std::unique_ptr<MetricsListener> metrics_listener_;
  std::unique_ptr<FdChannel> fd_channel_;
  // Attach's reply bodies, encoded once per generation for every service.
  std::shared_ptr<AttachEncodingCache> encodings_ = std::make_shared<AttachEncodingCache>();
  std::unique_ptr<WeightdService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<GrpcAcceptor> acceptor_;  // destroyed before server_
  std::unique_ptr<TcpListener> tcp_listener_;
  std::unique_ptr<HealthPort> health_port_;
  std::unique_ptr<PeerSeed> peer_seed_;
  std::unique_ptr<PeerListener> peer_listener_;  // destroyed first: its sessions use the seed, registry, transport
  std::thread preload_thread_, self_check_thread_;
  std::vector<NamedFd> inherited_;  // the fds passed at start, until Restore() takes them
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> shut_down_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonConfig& config, std::vector<NamedFd> inherited) {
  auto daemon = std::make_unique<DaemonImpl>(config, std::move(inherited));
  if (absl::Status started = daemon->Init(); !started.ok()) return started;
  return daemon;
}

}  // namespace weightd
