#include "server/daemon.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <sys/stat.h>
#include <systemd/sd-daemon.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <thread>

#include "absl/strings/str_format.h"
#include "common/log.h"
#include "server/fd_channel.h"
#include "server/registry.h"
#include "server/service.h"

namespace weightd {
namespace {

// Health, logs and systemd status follow the registry.
class DaemonListener final : public RegistryListener {
 public:
  void SetServer(grpc::Server* server) { server_ = server; }

  void OnModelServing(const std::string& name, bool serving) override {
    if (server_ != nullptr) server_->GetHealthCheckService()->SetServingStatus(name, serving);
  }
  void OnLoadFinished(const ModelGeneration& m, uint64_t bytes, double seconds) override {
    std::string line = absl::StrFormat("loaded '%s' generation %d: %d tensors, %d bytes in %.3f s (%.2f GB/s), fingerprint %s",
                                       m.request.name, m.generation, m.tensor_count, bytes, seconds,
                                       seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0, m.fingerprint);
    LogInfo(line);
    sd_notify(0, ("STATUS=" + line).c_str());
  }
  void OnLoadFailed(const absl::Status& status) override { LogWarning(absl::StrCat("load failed: ", status.message())); }
  void OnMemoryChanged(uint64_t host, uint64_t locked) override {
    if (locked < host && !warned_memlock_.exchange(true)) {
      LogWarning(absl::StrFormat("only %d of %d host bytes are mlock()ed: raise RLIMIT_MEMLOCK (LimitMEMLOCK=infinity)",
                                 locked, host));
    }
  }

 private:
  grpc::Server* server_ = nullptr;
  std::atomic<bool> warned_memlock_{false};
};

class DaemonImpl final : public Daemon {
 public:
  explicit DaemonImpl(const DaemonConfig& config) : config_(config) {}
  ~DaemonImpl() override { Shutdown(); }

  absl::Status Init() {
    RegistryOptions options;
    options.model_roots = config_.model_root;
    options.loader.threads = config_.load_threads;
    options.loader.mlock = config_.mlock;
    options.claim_timeout = std::chrono::milliseconds(static_cast<int64_t>(config_.lease_claim_timeout_seconds * 1000));
    registry_ = std::make_unique<ModelRegistry>(options, &listener_);
    absl::StatusOr<std::unique_ptr<FdChannel>> channel = FdChannel::Start({config_.fd_socket, 0660, config_.allowed_gids},
                                                                         registry_.get());
    if (!channel.ok()) return channel.status();
    fd_channel_ = std::move(*channel);
    service_ = std::make_unique<WeightdService>(registry_.get(), config_.fd_socket);
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    unlink(config_.socket.c_str());
    builder.AddListeningPort("unix:" + config_.socket, grpc::InsecureServerCredentials());
    if (!config_.grpc_address.empty()) builder.AddListeningPort(config_.grpc_address, grpc::InsecureServerCredentials());
    builder.RegisterService(service_.get());
    builder.SetMaxSendMessageSize(-1);
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) {
      return absl::UnavailableError(absl::StrCat("cannot listen on unix:", config_.socket,
                                                 config_.grpc_address.empty() ? "" : " or " + config_.grpc_address));
    }
    chmod(config_.socket.c_str(), 0660);
    listener_.SetServer(server_.get());
    LogInfo(absl::StrCat("listening on unix:", config_.socket, " (fd socket ", config_.fd_socket, ")",
                         config_.grpc_address.empty() ? "" : ", " + config_.grpc_address));
    sd_notify(0, "READY=1\nSTATUS=listening");
    StartWatchdog();
    preload_thread_ = std::thread([this] { Preload(); });
    return absl::OkStatus();
  }

  void Shutdown() override {
    if (shut_down_.exchange(true)) return;
    sd_notify(0, "STOPPING=1");
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_all();
    }
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (preload_thread_.joinable()) preload_thread_.join();
    if (watchdog_thread_.joinable()) watchdog_thread_.join();
    fd_channel_.reset();
    unlink(config_.socket.c_str());
    LogInfo("stopped");
  }

 private:
  void Preload() {
    for (const auto& [name, path] : config_.preload) {
      if (Stopping()) return;
      LoadRequest request;
      request.name = name;
      request.checkpoint_path = path;
      absl::StatusOr<ModelRegistry::LoadResult> result = registry_->Load(request, nullptr);
      if (!result.ok()) LogError(absl::StrCat("preload '", name, "' from ", path, " failed: ", result.status().message()));
    }
  }

  void StartWatchdog() {
    uint64_t usec = 0;
    if (sd_watchdog_enabled(0, &usec) <= 0) return;
    watchdog_thread_ = std::thread([this, usec] {
      std::unique_lock<std::mutex> lock(mu_);
      while (!cv_.wait_for(lock, std::chrono::microseconds(usec / 2), [this] { return stopping_; })) {
        sd_notify(0, "WATCHDOG=1");
      }
    });
  }

  bool Stopping() {
    std::lock_guard<std::mutex> lock(mu_);
    return stopping_;
  }

  const DaemonConfig config_;
  DaemonListener listener_;
  std::unique_ptr<ModelRegistry> registry_;
  std::unique_ptr<FdChannel> fd_channel_;
  std::unique_ptr<WeightdService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::thread preload_thread_, watchdog_thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::atomic<bool> shut_down_{false};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonConfig& config) {
  auto daemon = std::make_unique<DaemonImpl>(config);
  if (absl::Status started = daemon->Init(); !started.ok()) return started;
  return daemon;
}

}  // namespace weightd
