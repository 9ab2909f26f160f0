// The gRPC service: each handler converts the request, calls the registry,
// converts back. No logic lives here (see registry.h), and no metrics: RPCs
// are counted and timed by an interceptor (see daemon.cc).
//
// It uses gRPC's synchronous API: LoadModel blocks for the whole load and
// streams progress from the handler thread, which the sync thread pool suits.
// Attach, the hot path, is a raw callback method: its reply is a small
// per-lease header followed by the rank's manifest encoded once per
// generation, so an attach of 100,000 tensors builds no 100,000 messages.
// WatchModel, which may wait for hours, is a callback method too
// (server/api/watch_stream.h): a waiting watcher holds no sync-server thread.
#ifndef WEIGHTD_SERVER_API_SERVICE_H_
#define WEIGHTD_SERVER_API_SERVICE_H_

#include <functional>
#include <string>

#include "server/api/attach_encoding.h"
#include "server/registry/registry.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {

class WeightdService final
    : public v1::Weightd::WithRawCallbackMethod_Attach<v1::Weightd::WithCallbackMethod_WatchModel<v1::Weightd::Service>> {
 public:
  // `registry` must outlive the service.
  // `mlock`: lock the sealed segments of a writer's commit (--mlock).
  // `encodings`: Attach's reply bodies, shared by every service of the
  // daemon so each generation is encoded once; null: one of its own.
  WeightdService(ModelRegistry* registry, std::string fd_socket_path, bool mlock = true,
                 std::shared_ptr<AttachEncodingCache> encodings = nullptr);
  // Enables UpgradeDaemon on this service (the Unix socket's): `upgrade`
  // checks that the daemon can upgrade and starts it, returning the binary
  // it will execute. Unset, UpgradeDaemon answers PERMISSION_DENIED.
  void EnableUpgrade(std::function<absl::StatusOr<std::string>()> upgrade) { upgrade_ = std::move(upgrade); }

  grpc::Status LoadModel(grpc::ServerContext* context, const v1::LoadModelRequest* request,
                         grpc::ServerWriter<v1::LoadModelProgress>* writer) override;
  grpc::Status ReloadModel(grpc::ServerContext* context, const v1::ReloadModelRequest* request,
                           grpc::ServerWriter<v1::LoadModelProgress>* writer) override;
  grpc::Status UnloadModel(grpc::ServerContext* context, const v1::UnloadModelRequest* request,
                           v1::UnloadModelResponse* response) override;
  grpc::Status ListModels(grpc::ServerContext* context, const v1::ListModelsRequest* request,
                          v1::ListModelsResponse* response) override;
  grpc::Status GetManifest(grpc::ServerContext* context, const v1::GetManifestRequest* request,
                           grpc::ServerWriter<v1::ManifestPage>* writer) override;
  grpc::ServerUnaryReactor* Attach(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                   grpc::ByteBuffer* response) override;
  grpc::Status Detach(grpc::ServerContext* context, const v1::DetachRequest* request,
                      v1::DetachResponse* response) override;
  grpc::Status BeginUpdate(grpc::ServerContext* context, const v1::BeginUpdateRequest* request,
                           v1::BeginUpdateResponse* response) override;
  grpc::Status CommitUpdate(grpc::ServerContext* context, const v1::CommitUpdateRequest* request,
                            v1::CommitUpdateResponse* response) override;
  grpc::Status AbortUpdate(grpc::ServerContext* context, const v1::AbortUpdateRequest* request,
                           v1::AbortUpdateResponse* response) override;
  grpc::ServerWriteReactor<v1::ModelEvent>* WatchModel(grpc::CallbackServerContext* context,
                                                       const v1::WatchModelRequest* request) override;
  grpc::Status BeginLayout(grpc::ServerContext* context, const v1::BeginLayoutRequest* request,
                           v1::BeginLayoutResponse* response) override;
  grpc::Status CommitLayout(grpc::ServerContext* context, const v1::CommitLayoutRequest* request,
                            v1::CommitLayoutResponse* response) override;
  grpc::Status AbortLayout(grpc::ServerContext* context, const v1::AbortLayoutRequest* request,
                           v1::AbortLayoutResponse* response) override;
  grpc::Status DropLayout(grpc::ServerContext* context, const v1::DropLayoutRequest* request,
                          v1::DropLayoutResponse* response) override;
  grpc::Status UpgradeDaemon(grpc::ServerContext* context, const v1::UpgradeDaemonRequest* request,
                             v1::UpgradeDaemonResponse* response) override;

 private:
  grpc::Status AttachEncoded(const grpc::ByteBuffer& request, grpc::ByteBuffer* response);
  // The reply of an attach of a runtime layout (`grant.layout`).
  grpc::Status AttachLayoutReply(const ModelRegistry::Grant& grant, grpc::ByteBuffer* response);
  static ProgressFn MakeProgress(grpc::ServerWriter<v1::LoadModelProgress>* writer);
  // Writes the DONE message of a load or reload.
  static grpc::Status FinishLoad(const absl::StatusOr<ModelRegistry::LoadResult>& result,
                                 grpc::ServerWriter<v1::LoadModelProgress>* writer);

  ModelRegistry* registry_;
  std::string fd_socket_path_;
  bool mlock_;
  std::function<absl::StatusOr<std::string>()> upgrade_;
  std::shared_ptr<AttachEncodingCache> encodings_;
};

// Random hex, drawn once per process image (ListModelsResponse.daemon_instance).
const std::string& DaemonInstanceId();

// The Weightd service as a read-only TCP listener serves it (see
// tcp_listener.h): ListModels, GetManifest and WatchModel of `full`; every method that
// changes state or takes a lease answers PERMISSION_DENIED, naming the
// method and the listeners that serve it. A method added to the proto later
// is UNIMPLEMENTED here until it is added on purpose: this fails closed.
class ReadOnlyWeightdService final : public v1::Weightd::WithCallbackMethod_WatchModel<v1::Weightd::Service> {
 public:
  // `full` must outlive this service.
  explicit ReadOnlyWeightdService(WeightdService* full) : full_(full) {}

  grpc::Status ListModels(grpc::ServerContext* context, const v1::ListModelsRequest* request,
                          v1::ListModelsResponse* response) override;
  grpc::Status GetManifest(grpc::ServerContext* context, const v1::GetManifestRequest* request,
                           grpc::ServerWriter<v1::ManifestPage>* writer) override;
  grpc::ServerWriteReactor<v1::ModelEvent>* WatchModel(grpc::CallbackServerContext* context,
                                                       const v1::WatchModelRequest* request) override;
  grpc::Status LoadModel(grpc::ServerContext*, const v1::LoadModelRequest*,
                         grpc::ServerWriter<v1::LoadModelProgress>*) override;
  grpc::Status ReloadModel(grpc::ServerContext*, const v1::ReloadModelRequest*,
                           grpc::ServerWriter<v1::LoadModelProgress>*) override;
  grpc::Status UnloadModel(grpc::ServerContext*, const v1::UnloadModelRequest*, v1::UnloadModelResponse*) override;
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest*, v1::AttachResponse*) override;
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest*, v1::DetachResponse*) override;
  grpc::Status BeginUpdate(grpc::ServerContext*, const v1::BeginUpdateRequest*, v1::BeginUpdateResponse*) override;
  grpc::Status CommitUpdate(grpc::ServerContext*, const v1::CommitUpdateRequest*, v1::CommitUpdateResponse*) override;
  grpc::Status AbortUpdate(grpc::ServerContext*, const v1::AbortUpdateRequest*, v1::AbortUpdateResponse*) override;
  grpc::Status UpgradeDaemon(grpc::ServerContext*, const v1::UpgradeDaemonRequest*, v1::UpgradeDaemonResponse*) override;
  grpc::Status BeginLayout(grpc::ServerContext*, const v1::BeginLayoutRequest*, v1::BeginLayoutResponse*) override;
  grpc::Status CommitLayout(grpc::ServerContext*, const v1::CommitLayoutRequest*, v1::CommitLayoutResponse*) override;
  grpc::Status AbortLayout(grpc::ServerContext*, const v1::AbortLayoutRequest*, v1::AbortLayoutResponse*) override;
  grpc::Status DropLayout(grpc::ServerContext*, const v1::DropLayoutRequest*, v1::DropLayoutResponse*) override;

 private:
  WeightdService* full_;
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_API_SERVICE_H_
