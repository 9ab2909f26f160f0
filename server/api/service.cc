#include "server/api/service.h"

#include <random>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/api/attach_encoding.h"
#include "server/api/convert.h"
#include "server/api/manifest_pages.h"
#include "server/peer/peer_join.h"
#include "server/restart/upgrade.h"
#include "server/api/watch_stream.h"

namespace weightd {
namespace {

constexpr size_t kMaxPathBytes = 4096;

absl::Status CheckLoadRequest(const v1::LoadModelRequest& r) {
  if (r.checkpoint_path().size() > kMaxPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint path is longer than ", kMaxPathBytes, " bytes"));
  }
  for (const auto& rule : r.tp_rules()) {
    if (rule.pattern().empty()) return absl::InvalidArgumentError("a TP rule has an empty pattern");
  }
  std::vector<std::string> peers(r.peers().begin(), r.peers().end());
  return ValidatePeerList(peers, "peers");
}

grpc::Status AdminOnly(const char* method) {
  return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                      absl::StrCat("weightd.v1.Weightd/", method,
                                   " needs the Unix socket or a TCP listener with mutual TLS and --grpc-tcp-admin; "
                                   "this TCP listener is read-only (ListModels, GetManifest, WatchModel, health)"));
}

}  // namespace

WeightdService::WeightdService(ModelRegistry* registry, std::string fd_socket_path, bool mlock,
                               std::shared_ptr<AttachEncodingCache> encodings)
    : registry_(registry),
      fd_socket_path_(std::move(fd_socket_path)),
      mlock_(mlock),
      encodings_(encodings != nullptr ? std::move(encodings) : std::make_shared<AttachEncodingCache>()) {}

grpc::Status WeightdService::LoadModel(grpc::ServerContext* context, const v1::LoadModelRequest* request,
                                       grpc::ServerWriter<v1::LoadModelProgress>* writer) {
  if (absl::Status bad = CheckLoadRequest(*request); !bad.ok()) {
    registry_->RefuseLoad(FromProto(*request), bad);
    return ToGrpcStatus(bad);
  }
  return FinishLoad(registry_->Load(FromProto(*request), MakeProgress(writer)), writer);
}

grpc::Status WeightdService::ReloadModel(grpc::ServerContext*, const v1::ReloadModelRequest* request,
                                         grpc::ServerWriter<v1::LoadModelProgress>* writer) {
  if (request->checkpoint_path().size() > kMaxPathBytes) {
    absl::Status bad = absl::InvalidArgumentError(absl::StrCat("checkpoint path is longer than ", kMaxPathBytes, " bytes"));
    registry_->RefuseLoad(LoadRequest{.name = request->name(), .checkpoint_path = request->checkpoint_path()}, bad);
    return ToGrpcStatus(bad);
  }
  return FinishLoad(registry_->Reload(request->name(), request->checkpoint_path(), MakeProgress(writer)), writer);
}

ProgressFn WeightdService::MakeProgress(grpc::ServerWriter<v1::LoadModelProgress>* writer) {
  return [writer](const LoadProgress& p) {
    v1::LoadModelProgress message;
    ToProto(p, &message);
    writer->Write(message);  // a gone client does not stop the load: others may attach
  };
}

grpc::Status WeightdService::FinishLoad(const absl::StatusOr<ModelRegistry::LoadResult>& result,
                                        grpc::ServerWriter<v1::LoadModelProgress>* writer) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  const ModelGeneration& model = *result->model;
  v1::LoadModelProgress done;
  done.set_phase(v1::LoadModelProgress::DONE);
  done.set_reused(result->reused);
  // Reused whole: nothing was read. Otherwise what this load read and shared.
  uint64_t read = result->reused ? 0 : model.bytes_read;
  done.set_bytes_done(read);
  done.set_bytes_total(read);
  bool seeded = model.source.rfind("peer ", 0) == 0;  // from a peer's memory: nothing shared with a generation before
  done.set_bytes_reused(seeded ? 0 : model.checkpoint_bytes - read);
  done.set_seconds(result->reused ? 0 : model.load_seconds);
  ToProto(model, done.mutable_model());
  writer->Write(done);
  return grpc::Status::OK;
}

grpc::Status WeightdService::UnloadModel(grpc::ServerContext*, const v1::UnloadModelRequest* request,
                                         v1::UnloadModelResponse* response) {
  absl::StatusOr<ModelRegistry::UnloadResult> result = registry_->Unload(request->name(), request->force());
  if (!result.ok()) return ToGrpcStatus(result.status());
  ToProto(*result->model, response->mutable_model());
  response->set_freed(result->freed);
  return grpc::Status::OK;
}

grpc::Status WeightdService::ListModels(grpc::ServerContext*, const v1::ListModelsRequest*,
                                        v1::ListModelsResponse* response) {
  for (const auto& model : registry_->ListAll()) ToProto(*model, response->add_models());
  response->set_daemon_instance(DaemonInstanceId());
  response->set_last_upgrade_error(UpgradeFallbackError());
  return grpc::Status::OK;
}

grpc::Status WeightdService::GetManifest(grpc::ServerContext*, const v1::GetManifestRequest* request,
                                         grpc::ServerWriter<v1::ManifestPage>* writer) {
  absl::StatusOr<std::shared_ptr<ModelGeneration>> model = registry_->GetRank(request->name(), request->rank());
  if (!model.ok()) return ToGrpcStatus(model.status());
  // One page at a time: Write returns once gRPC has taken the page, so a
  // call holds at most one page (kMaxManifestPageBytes) however many it asks for.
  uint32_t page_tensors = ManifestPageTensors(request->page_size());
  size_t total = (*model)->ranks[request->rank()].tensors.size(), next = 0;
  do {
    v1::ManifestPage page;
    next = FillManifestPage(**model, request->rank(), next, page_tensors, &page);
    if (!writer->Write(page)) break;
  } while (next < total);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* WeightdService::Attach(grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                                                 grpc::ByteBuffer* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  reactor->Finish(AttachEncoded(*request, response));
  return reactor;
}

grpc::Status WeightdService::AttachEncoded(const grpc::ByteBuffer& raw, grpc::ByteBuffer* out) {
  v1::AttachRequest request;
  grpc::ByteBuffer copy(raw);  // Deserialize consumes its buffer; copies share the slices
  grpc::Status parsed = grpc::SerializationTraits<v1::AttachRequest>::Deserialize(&copy, &request);
  if (!parsed.ok()) return parsed;
  ModelRegistry::AttachPlacement placement;
  if (request.has_numa_node()) {
    if (request.numa_node() < 0 || request.numa_node() >= kMaxNumaNodes) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("numa_node must be in [0, ", kMaxNumaNodes, "), got ", request.numa_node()));
    }
    placement.numa_node = request.numa_node();
  }
  if (request.cpus_size() > kMaxCpus) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("cpus lists ", request.cpus_size(), " CPUs; at most ", kMaxCpus));
  }
  for (uint32_t cpu : request.cpus()) {
    if (cpu >= static_cast<uint32_t>(kMaxCpus)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, absl::StrCat("cpu ", cpu, " is not below ", kMaxCpus));
    }
    placement.cpus.push_back(static_cast<int>(cpu));
  }
  ModelRegistry::AttachLayout layout;
  if (!request.layout().empty() || request.identity_size() > 0) {
    if (request.identity_size() > static_cast<int>(kMaxIdentityEntries)) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("identity has ", request.identity_size(), " fields; at most ", kMaxIdentityEntries));
    }
    if (request.layout().empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "an identity is checked against a layout: name the layout");
    }
    layout.key = request.layout();
    layout.identity.insert(request.identity().begin(), request.identity().end());
  }
  absl::StatusOr<ModelRegistry::Grant> grant = registry_->Attach(request.name(), request.rank(), placement, layout);
  if (!grant.ok()) return ToGrpcStatus(grant.status());
  if (grant->layout != nullptr) return AttachLayoutReply(*grant, out);
  const ModelGeneration& m = *grant->model;
  std::shared_ptr<const std::string> packed;
  if (request.manifest_encoding() == v1::AttachRequest::PACKED_TABLE_V1) {
    packed = encodings_->Packed(grant->model, grant->rank);
  }
  v1::AttachResponse head;
  head.set_lease_id(grant->lease_id);
  head.set_fd_socket(fd_socket_path_);
  head.set_claim_timeout_seconds(std::chrono::duration<double>(registry_->claim_timeout()).count());
  head.set_model(m.request.name);
  head.set_generation(m.generation);
  head.set_rank(grant->rank);
  head.set_fingerprint(m.fingerprint);
  head.set_version_label(m.version_label);
  head.set_numa_node(grant->numa_node());
  // Protobuf messages concatenate: header fields, then the cached segments
  // and tensors, parse as one AttachResponse.
  std::string bytes = head.SerializeAsString();
  if (packed == nullptr) {
    bytes += *encodings_->Entries(grant->model, grant->rank);
    grpc::Slice slice(bytes);
    *out = grpc::ByteBuffer(&slice, 1);
    return grpc::Status::OK;
  }
  // The cached body goes out without a copy: its slice holds a reference
  // until gRPC has sent it.
  auto* hold = new std::shared_ptr<const std::string>(std::move(packed));
  grpc::Slice slices[2] = {grpc::Slice(bytes),
                           grpc::Slice(const_cast<char*>((*hold)->data()), (*hold)->size(),
                                       [](void* p) { delete static_cast<std::shared_ptr<const std::string>*>(p); },
                                       hold)};
  *out = grpc::ByteBuffer(slices, 2);
  return grpc::Status::OK;
}

grpc::Status WeightdService::AttachLayoutReply(const ModelRegistry::Grant& grant, grpc::ByteBuffer* out) {
  const Layout& layout = *grant.layout;
  v1::AttachResponse response;
  response.set_lease_id(grant.lease_id);
  response.set_fd_socket(fd_socket_path_);
  response.set_claim_timeout_seconds(std::chrono::duration<double>(registry_->claim_timeout()).count());
  response.set_model(grant.model->request.name);
  response.set_generation(grant.model->generation);
  response.set_rank(grant.rank);
  response.set_fingerprint(layout.fingerprint);
  response.set_version_label(grant.model->version_label);
  response.set_numa_node(-1);
  response.set_layout(layout.key);
  response.mutable_identity()->insert(layout.identity.begin(), layout.identity.end());
  for (uint32_t i = 0; i < layout.segments.size(); ++i) ToProto(layout.segments[i], i, response.add_segments());
  for (const LayoutTensor& t : layout.tensors) ToProto(t, response.add_tensors());
  grpc::Slice slice(response.SerializeAsString());
  *out = grpc::ByteBuffer(&slice, 1);
  return grpc::Status::OK;
}

grpc::Status WeightdService::BeginLayout(grpc::ServerContext*, const v1::BeginLayoutRequest* request,
                                         v1::BeginLayoutResponse* response) {
  absl::StatusOr<LayoutRequest> parsed = FromProto(*request);
  if (!parsed.ok()) return ToGrpcStatus(parsed.status());
  absl::StatusOr<ModelRegistry::LayoutGrant> grant = registry_->BeginLayout(std::move(*parsed));
  if (!grant.ok()) return ToGrpcStatus(grant.status());
  response->set_model(request->name());
  response->set_generation(grant->generation);
  response->set_rank(request->rank());
  if (grant->published != nullptr) {
    response->set_published(true);
    return grpc::Status::OK;
  }
  const StagedLayout& staged = *grant->staged;
  response->set_writer_id(grant->writer_id);
  response->set_fd_socket(fd_socket_path_);
  response->set_claim_timeout_seconds(std::chrono::duration<double>(registry_->claim_timeout()).count());
  for (uint32_t i = 0; i < staged.segments.size(); ++i) {
    const HostSegment& memory = *staged.segments[i].memory;
    SegmentRecord record{Placement::kHost, memory.size(), SegmentBackend::kMemfd, "", memory.fd(), ""};
    ToProto(record, i, response->add_segments());
  }
  for (const LayoutTensor& t : staged.tensors) ToProto(t, response->add_tensors());
  response->set_bytes_staged(staged.bytes_staged);
  return grpc::Status::OK;
}

grpc::Status WeightdService::CommitLayout(grpc::ServerContext*, const v1::CommitLayoutRequest* request,
                                          v1::CommitLayoutResponse* response) {
  if (static_cast<size_t>(request->expected_hashes_size()) > kMaxLayoutTensors) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("at most ", kMaxLayoutTensors, " expected hashes"));
  }
  std::map<std::string, std::string> expected(request->expected_hashes().begin(), request->expected_hashes().end());
  absl::StatusOr<std::shared_ptr<const Layout>> layout = registry_->CommitLayout(request->writer_id(), expected);
  if (!layout.ok()) return ToGrpcStatus(layout.status());
  ToProto(**layout, response->mutable_layout());
  response->set_seconds((*layout)->publish_seconds);
  return grpc::Status::OK;
}

grpc::Status WeightdService::AbortLayout(grpc::ServerContext*, const v1::AbortLayoutRequest* request,
                                         v1::AbortLayoutResponse*) {
  return ToGrpcStatus(registry_->AbortLayout(request->writer_id(), "aborted_by_writer"));
}

grpc::Status WeightdService::DropLayout(grpc::ServerContext*, const v1::DropLayoutRequest* request,
                                        v1::DropLayoutResponse* response) {
  if (absl::Status key = ValidateLayoutKey(request->key()); !key.ok()) return ToGrpcStatus(key);
  std::optional<uint32_t> rank;
  if (request->has_rank()) rank = request->rank();
  absl::StatusOr<int> dropped = registry_->DropLayout(request->name(), request->key(), rank);
  if (!dropped.ok()) return ToGrpcStatus(dropped.status());
  response->set_dropped(static_cast<uint32_t>(*dropped));
  return grpc::Status::OK;
}

grpc::Status WeightdService::BeginUpdate(grpc::ServerContext*, const v1::BeginUpdateRequest* request,
                                         v1::BeginUpdateResponse* response) {
  std::vector<std::string> tensors(request->tensors().begin(), request->tensors().end());
  absl::StatusOr<ModelRegistry::UpdateGrant> grant = registry_->BeginUpdate(request->name(), tensors);
  if (!grant.ok()) return ToGrpcStatus(grant.status());
  const StagedUpdate& update = *grant->update;
  response->set_update_id(grant->update_id);
  response->set_fd_socket(fd_socket_path_);
  response->set_claim_timeout_seconds(std::chrono::duration<double>(registry_->claim_timeout()).count());
  response->set_model(update.base->request.name);
  response->set_base_generation(update.base->generation);
  for (uint32_t i = 0; i < update.segments.size(); ++i) {
    const HostSegment& memory = *update.segments[i].memory;
    SegmentRecord record{Placement::kHost, memory.size(), SegmentBackend::kMemfd, "", memory.fd(), ""};
    ToProto(record, i, response->add_segments());
  }
  for (const StagedTensor& t : update.writable) {
    v1::UpdateTensor* out = response->add_tensors();
    ToProto(t.record, out->mutable_entry());
    out->set_rank(t.rank);
  }
  response->set_bytes_staged(update.bytes_staged);
  response->set_bytes_shared(update.bytes_shared);
  return grpc::Status::OK;
}

grpc::Status WeightdService::CommitUpdate(grpc::ServerContext*, const v1::CommitUpdateRequest* request,
                                          v1::CommitUpdateResponse* response) {
  CommitOptions options;
  options.expected_hashes.insert(request->expected_hashes().begin(), request->expected_hashes().end());
  options.version_label = request->version_label();
  options.mlock = mlock_;
  absl::StatusOr<ModelRegistry::CommitResult> result = registry_->CommitUpdate(request->update_id(), options);
  if (!result.ok()) return ToGrpcStatus(result.status());
  ToProto(*result->model, response->mutable_model());
  response->set_tensors_changed(result->tensors_changed);
  response->set_bytes_written(result->bytes_written);
  response->set_bytes_shared(result->bytes_shared);
  response->set_seconds(result->seconds);
  return grpc::Status::OK;
}

grpc::Status WeightdService::AbortUpdate(grpc::ServerContext*, const v1::AbortUpdateRequest* request,
                                         v1::AbortUpdateResponse*) {
  return ToGrpcStatus(registry_->AbortUpdate(request->update_id(), "aborted_by_writer"));
}

grpc::Status WeightdService::UpgradeDaemon(grpc::ServerContext*, const v1::UpgradeDaemonRequest*,
                                           v1::UpgradeDaemonResponse* response) {
  if (!upgrade_) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                        "weightd.v1.Weightd/UpgradeDaemon is served on the daemon's Unix socket only");
  }
  uint32_t ready = 0;
  for (const auto& model : registry_->List()) ready += model->state.load() == ModelState::kReady ? 1 : 0;
  absl::StatusOr<std::string> binary = upgrade_();
  if (!binary.ok()) return ToGrpcStatus(binary.status());
  response->set_binary(*binary);
  response->set_daemon_instance(DaemonInstanceId());
  response->set_models(ready);
  return grpc::Status::OK;
}

const std::string& DaemonInstanceId() {
  static const std::string* id = [] {
    std::random_device device;
    return new std::string(absl::StrFormat("%08x%08x", device(), device()));
  }();
  return *id;
}

grpc::Status WeightdService::Detach(grpc::ServerContext*, const v1::DetachRequest* request, v1::DetachResponse*) {
  return ToGrpcStatus(registry_->Detach(request->lease_id()));
}

grpc::ServerWriteReactor<v1::ModelEvent>* WeightdService::WatchModel(grpc::CallbackServerContext* context,
                                                                     const v1::WatchModelRequest* request) {
  return StartWatchStream(context, *request, registry_);
}

grpc::Status ReadOnlyWeightdService::ListModels(grpc::ServerContext* context, const v1::ListModelsRequest* request,
                                                v1::ListModelsResponse* response) {
  return full_->ListModels(context, request, response);
}

grpc::Status ReadOnlyWeightdService::GetManifest(grpc::ServerContext* context, const v1::GetManifestRequest* request,
                                                 grpc::ServerWriter<v1::ManifestPage>* writer) {
  return full_->GetManifest(context, request, writer);
}

grpc::ServerWriteReactor<v1::ModelEvent>* ReadOnlyWeightdService::WatchModel(grpc::CallbackServerContext* context,
                                                                             const v1::WatchModelRequest* request) {
  return full_->WatchModel(context, request);
}

grpc::Status ReadOnlyWeightdService::LoadModel(grpc::ServerContext*, const v1::LoadModelRequest*,
                                               grpc::ServerWriter<v1::LoadModelProgress>*) {
  return AdminOnly("LoadModel");
}

grpc::Status ReadOnlyWeightdService::ReloadModel(grpc::ServerContext*, const v1::ReloadModelRequest*,
                                                 grpc::ServerWriter<v1::LoadModelProgress>*) {
  return AdminOnly("ReloadModel");
}

grpc::Status ReadOnlyWeightdService::UnloadModel(grpc::ServerContext*, const v1::UnloadModelRequest*,
                                                 v1::UnloadModelResponse*) {
  return AdminOnly("UnloadModel");
}

grpc::Status ReadOnlyWeightdService::Attach(grpc::ServerContext*, const v1::AttachRequest*, v1::AttachResponse*) {
  return AdminOnly("Attach");
}

grpc::Status ReadOnlyWeightdService::BeginLayout(grpc::ServerContext*, const v1::BeginLayoutRequest*,
                                                 v1::BeginLayoutResponse*) {
  return AdminOnly("BeginLayout");
}

grpc::Status ReadOnlyWeightdService::CommitLayout(grpc::ServerContext*, const v1::CommitLayoutRequest*,
                                                  v1::CommitLayoutResponse*) {
  return AdminOnly("CommitLayout");
}

grpc::Status ReadOnlyWeightdService::AbortLayout(grpc::ServerContext*, const v1::AbortLayoutRequest*,
                                                 v1::AbortLayoutResponse*) {
  return AdminOnly("AbortLayout");
}

grpc::Status ReadOnlyWeightdService::DropLayout(grpc::ServerContext*, const v1::DropLayoutRequest*,
                                                v1::DropLayoutResponse*) {
  return AdminOnly("DropLayout");
}

grpc::Status ReadOnlyWeightdService::BeginUpdate(grpc::ServerContext*, const v1::BeginUpdateRequest*,
                                                 v1::BeginUpdateResponse*) {
  return AdminOnly("BeginUpdate");
}

grpc::Status ReadOnlyWeightdService::CommitUpdate(grpc::ServerContext*, const v1::CommitUpdateRequest*,
                                                  v1::CommitUpdateResponse*) {
  return AdminOnly("CommitUpdate");
}

grpc::Status ReadOnlyWeightdService::AbortUpdate(grpc::ServerContext*, const v1::AbortUpdateRequest*,
                                                 v1::AbortUpdateResponse*) {
  return AdminOnly("AbortUpdate");
}

grpc::Status ReadOnlyWeightdService::UpgradeDaemon(grpc::ServerContext*, const v1::UpgradeDaemonRequest*,
                                                   v1::UpgradeDaemonResponse*) {
  return AdminOnly("UpgradeDaemon");
}

grpc::Status ReadOnlyWeightdService::Detach(grpc::ServerContext*, const v1::DetachRequest*, v1::DetachResponse*) {
  return AdminOnly("Detach");
}

}  // namespace weightd
