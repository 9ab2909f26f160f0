#include "weightd/client.h"

#include <grpcpp/grpcpp.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <chrono>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/device.h"
#include "common/env.h"
#include "common/status.h"
#include "common/unix_socket.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

ModelSummary FromProto(const v1::ModelInfo& m) {
  ModelSummary s;
  s.name = m.name();
  s.generation = m.generation();
  s.state = v1::ModelState_Name(m.state());  // the proto's spelling, as the Python client's
  s.checkpoint_path = m.checkpoint_path();
  s.checkpoint_bytes = m.checkpoint_bytes();
  s.host_bytes = m.host_bytes();
  s.locked_bytes = m.locked_bytes();
  for (const auto& d : m.device_bytes()) s.device_bytes[d.gpu_uuid()] = d.bytes();
  s.leases = m.leases();
  s.fingerprint = m.fingerprint();
  s.tensor_count = m.tensor_count();
  s.tp_size = m.tp_size();
  s.load_seconds = m.load_seconds();
  s.warnings.assign(m.warnings().begin(), m.warnings().end());
  return s;
}

TensorInfo FromProto(const v1::TensorEntry& t) {
  TensorInfo info;
  info.name = t.name();
  info.dtype = t.dtype();
  info.shape.assign(t.shape().begin(), t.shape().end());
  info.location = t.placement() == v1::DEVICE ? Location::kDevice : Location::kHost;
  info.segment = t.segment();
  info.offset = t.offset();
  info.nbytes = t.nbytes();
  info.full_shape.assign(t.full_shape().begin(), t.full_shape().end());
  info.split_dim = t.split_dim();
  info.split_start = t.split_start();
  info.content_hash = t.content_hash();
  return info;
}

SegmentInfo FromProto(const v1::SegmentDescriptor& s) {
  return {s.placement() == v1::DEVICE ? Location::kDevice : Location::kHost, s.size(), s.backend(), s.gpu_uuid(),
          s.ipc_handle()};
}

std::string NormalizeTarget(const std::string& target) {
  return !target.empty() && target[0] == '/' ? "unix://" + target : target;
}

absl::StatusOr<std::string> ReadPem(const char* what, const std::string& path) {
  absl::StatusOr<std::string> pem = ReadSmallFile(*Env::Default(), path, 1 << 20);
  if (!pem.ok()) return Annotate(pem.status(), what);
  return pem;
}

// Insecure without a CA; TLS with one; mutual TLS with a certificate and key.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(const ConnectOptions& o) {
  if (o.tls_ca_file.empty()) {
    if (!o.tls_cert_file.empty() || !o.tls_key_file.empty()) {
      return absl::InvalidArgumentError("a TLS client certificate needs the CA of the daemon's certificate (--tls-ca)");
    }
    return grpc::InsecureChannelCredentials();
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("a TLS client certificate needs both --tls-cert and --tls-key");
  }
  grpc::SslCredentialsOptions ssl;
  WEIGHTD_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem("--tls-ca", o.tls_ca_file));
  if (!o.tls_cert_file.empty()) {
    WEIGHTD_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPem("--tls-cert", o.tls_cert_file));
    WEIGHTD_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem("--tls-key", o.tls_key_file));
  }
  return grpc::SslCredentials(ssl);
}

// The daemon's first reply. A daemon that refused the connection may have
// closed it before reading CLAIM: the kernel then fails the send (EPIPE) or
// the first receive (ECONNRESET) although the "ERR" line is still queued, so
// one more look finds the daemon's reason.
absl::StatusOr<std::string> ReceiveReply(int sock, std::vector<ScopedFd>* fds, int timeout_ms) {
  absl::StatusOr<std::string> reply = ReceiveMessage(sock, fds, timeout_ms);
  if (reply.ok()) return reply;
  absl::StatusOr<std::string> queued = ReceiveMessage(sock, fds, 0);
  return queued.ok() && absl::StartsWith(*queued, "ERR ") ? queued : reply;
}

absl::Status ParseClaimReply(const std::string& reply, int sock, int timeout_ms, std::vector<ScopedFd>* fds) {
  if (absl::StartsWith(reply, "ERR ")) {
    std::string rest = reply.substr(4);
    size_t space = rest.find(' ');
    int code = 13;
    (void)absl::SimpleAtoi(rest.substr(0, space), &code);
    return absl::Status(static_cast<absl::StatusCode>(code),
                        absl::StrCat("fd socket: ", space == std::string::npos ? "" : rest.substr(space + 1)));
  }
  size_t expected = 0;
  if (!absl::StartsWith(reply, "OK ") || !absl::SimpleAtoi(reply.substr(3), &expected)) {
    return absl::InternalError(absl::StrCat("fd socket: unexpected reply '", reply, "'"));
  }
  while (fds->size() < expected) {
    WEIGHTD_ASSIGN_OR_RETURN(std::string more, ReceiveMessage(sock, fds, timeout_ms));
    if (more != "MORE") return absl::InternalError("fd socket: expected MORE");
  }
  if (fds->size() != expected) return absl::InternalError("fd socket: received more fds than announced");
  return absl::OkStatus();
}

// Receives the segment fds for `lease_id` on the fd socket ("OK n" + "MORE"s).
absl::Status ClaimLease(const std::string& fd_socket, const std::string& lease_id, int timeout_ms, ScopedFd* conn,
                        std::vector<ScopedFd>* fds) {
  WEIGHTD_ASSIGN_OR_RETURN(*conn, ConnectSeqpacket(fd_socket));
  absl::Status sent = SendMessage(conn->get(), "CLAIM " + lease_id, {});
  absl::StatusOr<std::string> reply = ReceiveReply(conn->get(), fds, sent.ok() ? timeout_ms : 0);
  if (!reply.ok()) return sent.ok() ? reply.status() : sent;
  return ParseClaimReply(*reply, conn->get(), timeout_ms, fds);
}

}  // namespace

// ---------------------------------------------------------------- MappedModel

struct MappedModel::State {
  Manifest manifest;
  std::vector<TensorView> views;                         // manifest order
  absl::flat_hash_map<absl::string_view, size_t> by_name;  // keys point into manifest.tensors
  std::vector<std::pair<void*, size_t>> mappings;
  std::vector<std::unique_ptr<ImportedArena>> imports;  // by segment; null for host segments
  std::vector<ScopedFd> segment_fds;
  ScopedFd lease;  // the fd-socket connection: closing it ends the lease
  double attach_seconds = 0;

  // Unmaps everything before `lease` closes: the daemon may free a
  // generation's memory as soon as its last lease ends, and for
  // cuda-legacy-ipc arenas a cuMemFree before the importer's
  // cuIpcCloseMemHandle is undefined behaviour (CUDA Driver API,
  // cuIpcOpenMemHandle). Device imports wait for this process's queued GPU
  // work first (see ImportedArena).
  ~State() {
    imports.clear();
    for (auto& [addr, size] : mappings) munmap(addr, size);
  }
};

MappedModel::MappedModel(std::shared_ptr<State> state) : state_(std::move(state)) {}
MappedModel::MappedModel(MappedModel&&) noexcept = default;
MappedModel& MappedModel::operator=(MappedModel&&) noexcept = default;
MappedModel::~MappedModel() = default;

const Manifest& MappedModel::manifest() const { return state_->manifest; }
const std::vector<TensorView>& MappedModel::tensors() const { return state_->views; }
double MappedModel::attach_seconds() const { return state_->attach_seconds; }

const TensorView* MappedModel::Find(absl::string_view name) const {
  auto it = state_->by_name.find(name);
  return it == state_->by_name.end() ? nullptr : &state_->views[it->second];
}

absl::Status MappedModel::CopyToHost(const TensorView& view, uint64_t offset, void* dst, uint64_t n) const {
  if (offset + n > view.nbytes) return absl::OutOfRangeError(absl::StrCat("read past tensor '", view.info->name, "'"));
  const ImportedArena* imported = state_->imports[view.info->segment].get();
  if (imported == nullptr) {
    std::memcpy(dst, static_cast<const char*>(view.data) + offset, n);
    return absl::OkStatus();
  }
  return imported->CopyToHost(view.info->offset + offset, dst, n);
}

bool MappedModel::device_read_only() const {
  for (const auto& imported : state_->imports) {
    if (imported && !imported->read_only()) return false;
  }
  return true;
}

// ---------------------------------------------------------------- Client

struct Client::Impl {
  std::unique_ptr<v1::Weightd::Stub> stub;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;
};

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target, const ConnectOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("empty daemon target");
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, ChannelCredentials(options));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // an Attach of 100,000+ tensors exceeds the 4 MiB default
  auto channel = grpc::CreateCustomChannel(NormalizeTarget(target), credentials, args);
  auto impl = std::make_unique<Impl>();
  impl->stub = v1::Weightd::NewStub(channel);
  impl->health = grpc::health::v1::Health::NewStub(channel);
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<LoadResult> Client::Load(const std::string& name, const std::string& checkpoint_path,
                                        const LoadOptions& options,
                                        const std::function<void(const LoadProgressInfo&)>& progress) {
  v1::LoadModelRequest request;
  request.set_name(name);
  request.set_checkpoint_path(checkpoint_path);
  for (const std::string& p : options.host_resident_patterns) request.add_host_resident_patterns(p);
  request.set_tp_size(options.tp_size);
  for (const auto& [pattern, dim] : options.tp_rules) {
    v1::TpRule* rule = request.add_tp_rules();
    rule->set_pattern(pattern);
    rule->set_dim(dim);
  }
  for (const std::string& d : options.devices) request.add_devices(d);
  grpc::ClientContext context;
  auto reader = impl_->stub->LoadModel(&context, request);
  v1::LoadModelProgress message;
  LoadResult result;
  bool done = false;
  while (reader->Read(&message)) {
    if (progress) {
      progress({v1::LoadModelProgress::Phase_Name(message.phase()), message.bytes_done(), message.bytes_total(),
                message.files_done(), message.files_total(), message.seconds()});
    }
    if (message.phase() == v1::LoadModelProgress::DONE) {
      result.model = FromProto(message.model());
      result.reused = message.reused();
      done = true;
    }
  }
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(reader->Finish()));
  if (!done) return absl::InternalError("load stream ended without a DONE message");
  return result;
}

absl::StatusOr<std::vector<ModelSummary>> Client::List() {
  grpc::ClientContext context;
  v1::ListModelsResponse response;
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(impl_->stub->ListModels(&context, v1::ListModelsRequest(), &response)));
  std::vector<ModelSummary> out;
  for (const auto& m : response.models()) out.push_back(FromProto(m));
  return out;
}

absl::StatusOr<Manifest> Client::GetManifest(const std::string& name, uint32_t rank) {
  v1::GetManifestRequest request;
  request.set_name(name);
  request.set_rank(rank);
  grpc::ClientContext context;
  auto reader = impl_->stub->GetManifest(&context, request);
  Manifest manifest;
  v1::ManifestPage page;
  while (reader->Read(&page)) {
    manifest.model = page.model();
    manifest.generation = page.generation();
    manifest.rank = page.rank();
    manifest.fingerprint = page.fingerprint();
    for (const auto& s : page.segments()) manifest.segments.push_back(FromProto(s));
    for (const auto& t : page.tensors()) manifest.tensors.push_back(FromProto(t));
  }
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(reader->Finish()));
  return manifest;
}

absl::StatusOr<MappedModel> Client::Attach(const std::string& name, uint32_t rank) {
  auto start = std::chrono::steady_clock::now();
  v1::AttachRequest request;
  request.set_name(name);
  request.set_rank(rank);
  v1::AttachResponse response;
  grpc::ClientContext context;
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(impl_->stub->Attach(&context, request, &response)));

  auto state = std::make_unique<MappedModel::State>();
  Manifest& m = state->manifest;
  m.model = response.model();
  m.generation = response.generation();
  m.rank = response.rank();
  m.fingerprint = response.fingerprint();
  for (const auto& s : response.segments()) m.segments.push_back(FromProto(s));
  m.tensors.reserve(response.tensors_size());
  for (const auto& t : response.tensors()) m.tensors.push_back(FromProto(t));

  const char* fd_socket_override = std::getenv("WEIGHTD_FD_SOCKET");
  std::string fd_socket = fd_socket_override != nullptr ? fd_socket_override : response.fd_socket();
  double claim_seconds = response.claim_timeout_seconds();
  int timeout_ms = claim_seconds > 0 && claim_seconds <= 86400 ? static_cast<int>(claim_seconds * 1000) : 10000;
  WEIGHTD_RETURN_IF_ERROR(ClaimLease(fd_socket, response.lease_id(), timeout_ms, &state->lease, &state->segment_fds));
  // One fd per segment in order, except segments exported by handle bytes.
  std::vector<ScopedFd> by_segment(m.segments.size());
  size_t next_fd = 0;
  for (size_t i = 0; i < m.segments.size(); ++i) {
    if (m.segments[i].backend == "cuda-legacy-ipc") continue;
    if (next_fd == state->segment_fds.size()) break;
    by_segment[i] = std::move(state->segment_fds[next_fd++]);
  }
  if (next_fd != state->segment_fds.size() ||
      std::count_if(by_segment.begin(), by_segment.end(), [](const ScopedFd& f) { return f.valid(); }) !=
          std::count_if(m.segments.begin(), m.segments.end(), [](const SegmentInfo& s) { return s.backend != "cuda-legacy-ipc"; })) {
    return absl::InternalError(absl::StrCat("received ", state->segment_fds.size(), " segment fds for ",
                                            m.segments.size(), " segments"));
  }
  state->segment_fds = std::move(by_segment);
  std::vector<const char*> bases(m.segments.size(), nullptr);
  state->imports.resize(m.segments.size());
  for (size_t i = 0; i < m.segments.size(); ++i) {
    if (m.segments[i].location == Location::kDevice) {
      WEIGHTD_ASSIGN_OR_RETURN(DeviceBackend * backend, ClientBackendFor(m.segments[i].backend));
      ArenaExport exported{m.segments[i].backend, m.segments[i].gpu_uuid, m.segments[i].size, m.segments[i].handle,
                           std::move(state->segment_fds[i])};
      absl::StatusOr<std::unique_ptr<ImportedArena>> imported = backend->Import(std::move(exported));
      if (!imported.ok()) return Annotate(imported.status(), absl::StrCat("importing segment ", i, " on ", m.segments[i].gpu_uuid));
      bases[i] = static_cast<const char*>((*imported)->device_pointer());
      state->imports[i] = std::move(*imported);
      continue;
    }
    if (m.segments[i].size == 0) continue;
    void* addr = mmap(nullptr, m.segments[i].size, PROT_READ, MAP_SHARED, state->segment_fds[i].get(), 0);
    if (addr == MAP_FAILED) return ErrnoToStatus(absl::StrCat("mmap segment ", i), errno);
    state->mappings.emplace_back(addr, m.segments[i].size);
    bases[i] = static_cast<const char*>(addr);
  }
  state->views.reserve(m.tensors.size());
  for (const TensorInfo& t : m.tensors) {
    if (t.segment >= bases.size() || t.offset + t.nbytes > m.segments[t.segment].size) {
      return absl::InternalError(absl::StrCat("tensor '", t.name, "' lies outside its segment"));
    }
    const ImportedArena* imported = state->imports[t.segment].get();
    state->views.push_back({&t, bases[t.segment] + t.offset, t.nbytes, t.location,
                            imported ? m.segments[t.segment].gpu_uuid : "", imported ? imported->device_ordinal() : -1});
  }
  // A hash index, not a sort: 100,000 long names sort in tens of milliseconds.
  state->by_name.reserve(state->views.size());
  for (size_t i = 0; i < state->views.size(); ++i) state->by_name.emplace(state->views[i].info->name, i);
  state->attach_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return MappedModel(std::shared_ptr<MappedModel::State>(std::move(state)));
}

absl::StatusOr<std::pair<ModelSummary, bool>> Client::Unload(const std::string& name, bool force) {
  v1::UnloadModelRequest request;
  request.set_name(name);
  request.set_force(force);
  v1::UnloadModelResponse response;
  grpc::ClientContext context;
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(impl_->stub->UnloadModel(&context, request, &response)));
  return std::make_pair(FromProto(response.model()), response.freed());
}

absl::StatusOr<std::string> Client::Health(const std::string& service) {
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  grpc::health::v1::HealthCheckResponse response;
  grpc::ClientContext context;
  grpc::Status status = impl_->health->Check(&context, request, &response);
  if (status.error_code() == grpc::StatusCode::NOT_FOUND) return std::string("SERVICE_UNKNOWN");
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(status));
  return grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
}

}  // namespace weightd
