#include "weightd/client.h"

#include <grpcpp/grpcpp.h>
#include <limits.h>
#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <chrono>
#include <mutex>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "client/client_internal.h"
#include "client/pin.h"
#include "common/format/content_hash.h"
#include "common/format/packed_manifest.h"
#include "common/memory/device.h"
#include "common/memory/host_segment.h"
#include "common/io/env.h"
#include "common/base/status.h"
#include "common/transport/unix_socket.h"
#include "common/transport/fd_channel_codec.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

// The CPUs this process may run on (sched_getaffinity(2)), which the daemon
// maps to a NUMA node to choose a copy (AttachOptions::numa_node). Empty
// when the call fails.
std::vector<int> AllowedCpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}


}  // namespace

absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

namespace {

// The progress messages of a LoadModel or ReloadModel stream, to the DONE one.
absl::StatusOr<LoadResult> ReadLoadStream(grpc::ClientReaderInterface<v1::LoadModelProgress>& reader,
                                          const std::function<void(const LoadProgressInfo&)>& progress) {
  v1::LoadModelProgress message;
  LoadResult result;
  bool done = false;
  while (reader.Read(&message)) {
    if (progress) {
      progress({v1::LoadModelProgress::Phase_Name(message.phase()), message.bytes_done(), message.bytes_total(),
                message.files_done(), message.files_total(), message.seconds()});
    }
    if (message.phase() == v1::LoadModelProgress::DONE) {
      result.model = FromProto(message.model());
      result.reused = message.reused();
      result.bytes_read = message.bytes_total();
      result.bytes_reused = message.bytes_reused();
      done = true;
    }
  }
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(reader.Finish()));
  if (!done) return absl::InternalError("load stream ended without a DONE message");
  return result;
}

}  // namespace

ModelSummary FromProto(const v1::ModelInfo& m) {
  ModelSummary s;
  s.name = m.name();
  s.generation = m.generation();
  s.state = v1::ModelState_Name(m.state());  // the proto's spelling, as the Python client's
  s.checkpoint_path = m.checkpoint_path();
  s.checkpoint_bytes = m.checkpoint_bytes();
  s.host_bytes = m.host_bytes();
  s.locked_bytes = m.locked_bytes();
  s.huge_page_bytes = m.huge_page_bytes();
  for (const auto& d : m.device_bytes()) s.device_bytes[d.gpu_uuid()] = d.bytes();
  s.leases = m.leases();
  s.fingerprint = m.fingerprint();
  s.tensor_count = m.tensor_count();
  s.tp_size = m.tp_size();
  s.load_seconds = m.load_seconds();
  s.warnings.assign(m.warnings().begin(), m.warnings().end());
  s.bytes_done = m.bytes_done();
  s.bytes_total = m.bytes_total();
  s.error = m.error();
  s.bytes_read = m.bytes_read();
  s.bytes_shared = m.bytes_shared();
  s.version_label = m.version_label();
  s.source = m.source();
  s.numa_nodes.assign(m.numa_nodes().begin(), m.numa_nodes().end());
  for (const auto& l : m.layouts()) s.layouts.push_back(FromProto(l));
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
  info.strides.assign(t.strides().begin(), t.strides().end());
  return info;
}

LayoutSummary FromProto(const v1::LayoutInfo& l) {
  LayoutSummary s;
  s.key = l.key();
  s.rank = l.rank();
  s.identity.insert(l.identity().begin(), l.identity().end());
  s.generation = l.generation();
  s.tensor_count = l.tensor_count();
  s.host_bytes = l.host_bytes();
  for (const auto& d : l.device_bytes()) s.device_bytes[d.gpu_uuid()] = d.bytes();
  s.leases = l.leases();
  s.fingerprint = l.fingerprint();
  s.publish_seconds = l.publish_seconds();
  s.published_at = l.published_at();
  return s;
}

SegmentInfo FromProto(const v1::SegmentDescriptor& s) {
  return {s.placement() == v1::DEVICE ? Location::kDevice : Location::kHost, s.size(), s.backend(), s.gpu_uuid(),
          s.ipc_handle(), s.export_kind() == v1::SegmentDescriptor::EXPORT_FD};
}

namespace {

// A target is a Unix socket path when it is absolute or holds no ':'
// ("w.sock", "d1/w.sock", "./w.sock"), made absolute against the working
// directory once, at Connect, so a later chdir or a reconnect cannot change
// which socket it names; anything else is a gRPC target ("unix://...",
// "HOST:PORT", "dns:///host:port"). A relative path with a ':' needs
// "unix:" before it.
std::string NormalizeTarget(const std::string& target) {
  if (target.empty() || (target[0] != '/' && target.find(':') != std::string::npos)) return target;
  if (target[0] == '/') return "unix://" + target;
  char cwd[PATH_MAX];
  if (getcwd(cwd, sizeof cwd) == nullptr) return "unix:" + target;  // relative to the directory then
  return absl::StrCat("unix://", cwd, "/", target);
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
  WEIGHTD_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPemFile("--tls-ca", o.tls_ca_file));
  if (!o.tls_cert_file.empty()) {
    WEIGHTD_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPemFile("--tls-cert", o.tls_cert_file));
    WEIGHTD_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPemFile("--tls-key", o.tls_key_file));
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
  if (!queued.ok()) return reply;
  absl::StatusOr<FdChannelMessage> parsed = ParseFdChannelMessage(*queued);
  return parsed.ok() && parsed->kind == FdChannelMessage::Kind::kErr ? queued : reply;
}

// One message of `kind` or INTERNAL quoting `payload`; an ERR is the daemon's status.
absl::StatusOr<FdChannelMessage> ExpectMessage(const std::string& payload, FdChannelMessage::Kind kind) {
  absl::StatusOr<FdChannelMessage> m = ParseFdChannelMessage(payload);
  if (m.ok() && m->kind == FdChannelMessage::Kind::kErr) {
    return absl::Status(m->error.code(), absl::StrCat("fd socket: ", m->error.message()));
  }
  if (!m.ok() || m->kind != kind) {
    return absl::InternalError(absl::StrCat("fd socket: unexpected reply '", payload, "'"));
  }
  return m;
}

absl::Status ParseClaimReply(const std::string& reply, int sock, int timeout_ms, std::vector<ScopedFd>* fds) {
  WEIGHTD_ASSIGN_OR_RETURN(FdChannelMessage ok, ExpectMessage(reply, FdChannelMessage::Kind::kOk));
  while (fds->size() < ok.fd_count) {
    WEIGHTD_ASSIGN_OR_RETURN(std::string more, ReceiveMessage(sock, fds, timeout_ms));
    if (!ExpectMessage(more, FdChannelMessage::Kind::kMore).ok()) {
      return absl::InternalError("fd socket: expected MORE");
    }
  }
  if (fds->size() != ok.fd_count) return absl::InternalError("fd socket: received more fds than announced");
  return absl::OkStatus();
}

// Receives the segment fds for `lease_id` on the fd socket ("OK n" + "MORE"s).
}  // namespace

absl::Status ClaimLease(const std::string& fd_socket, const std::string& lease_id, int timeout_ms, ScopedFd* conn,
                        std::vector<ScopedFd>* fds) {
  WEIGHTD_ASSIGN_OR_RETURN(*conn, ConnectSeqpacket(fd_socket));
  absl::Status sent = SendMessage(conn->get(), EncodeClaim(lease_id), {});
  absl::StatusOr<std::string> reply = ReceiveReply(conn->get(), fds, sent.ok() ? timeout_ms : 0);
  if (!reply.ok()) return sent.ok() ? reply.status() : sent;
  return ParseClaimReply(*reply, conn->get(), timeout_ms, fds);
}

// ---------------------------------------------------------------- MappedModel

struct MappedModel::State {
  Manifest manifest;
  std::vector<TensorView> views;                         // manifest order
  // The name index, built by the first Find() (under index_once): a
  // 100,000-tensor attach need not hash every name before it returns.
  std::once_flag index_once;
  absl::flat_hash_map<absl::string_view, size_t> by_name;  // keys point into manifest.tensors
  std::vector<std::pair<void*, size_t>> mappings;
  std::vector<std::unique_ptr<ImportedArena>> imports;  // by segment; null for host segments
  std::vector<ScopedFd> segment_fds;
  ScopedFd lease;  // the fd-socket connection: closing it ends the lease
  double attach_seconds = 0;
  bool copy_on_write = false;  // AttachOptions::copy_on_write
  bool prefault = false;       // AttachOptions::prefault
  // AttachOptions::pin: the pinner, and per manifest tensor its index among
  // the pinner's tensors (-1: not pinned). Null and empty without pin.
  std::unique_ptr<HostPinner> pinner;
  std::vector<int64_t> pinned_index;

  // Unpins, then unmaps everything before `lease` closes: pinned pages must
  // stay mapped until cuMemHostUnregister; the daemon may free a
  // generation's memory as soon as its last lease ends, and for
  // cuda-legacy-ipc arenas a cuMemFree before the importer's
  // cuIpcCloseMemHandle is undefined behaviour (CUDA Driver API,
  // cuIpcOpenMemHandle). Device imports wait for this process's queued GPU
  // work first (see ImportedArena).
  ~State() {
    pinner.reset();
    imports.clear();
    for (auto& [addr, size] : mappings) munmap(addr, size);
  }
};

namespace {

// ------------------------------------------------ Attach, step by step

// Fills `info` in place (no temporaries: this runs once per tensor).
void FillFromPacked(const PackedTensor& t, TensorInfo& info) {
  info.name.assign(t.name.data(), t.name.size());
  info.dtype.assign(t.dtype.data(), t.dtype.size());
  info.shape.resize(t.ndim);
  for (uint32_t k = 0; k < t.ndim; ++k) info.shape[k] = t.Dim(k);
  info.location = t.placement == kPackedPlacementDevice ? Location::kDevice : Location::kHost;
  info.segment = t.segment;
  info.offset = t.offset;
  info.nbytes = t.nbytes;
  info.full_shape.resize(t.full_ndim);
  for (uint32_t k = 0; k < t.full_ndim; ++k) info.full_shape[k] = t.FullDim(k);
  info.split_dim = t.split_dim;
  info.split_start = t.split_start;
  info.content_hash = ContentHashHex(t.content_hash);
}

// The tensors from AttachResponse.packed_tensors when the daemon sent the
// packed table, else from its TensorEntry messages (a daemon that predates
// the table). DATA_LOSS for a malformed table.
absl::Status TensorsOf(const v1::AttachResponse& response, std::vector<TensorInfo>* out) {
  if (response.packed_tensors().empty()) {
    out->reserve(response.tensors_size());
    for (const auto& t : response.tensors()) out->push_back(FromProto(t));
    return absl::OkStatus();
  }
  if (response.tensors_size() > 0) {
    return absl::DataLossError("the daemon's Attach reply carries both packed_tensors and TensorEntry messages");
  }
  WEIGHTD_ASSIGN_OR_RETURN(PackedManifest table, PackedManifest::Parse(response.packed_tensors()));
  out->resize(table.size());
  for (uint32_t i = 0; i < table.size(); ++i) FillFromPacked(table.Tensor(i), (*out)[i]);
  return absl::OkStatus();
}

absl::StatusOr<Manifest> ManifestOf(const v1::AttachResponse& response) {
  Manifest m;
  m.model = response.model();
  m.generation = response.generation();
  m.rank = response.rank();
  m.fingerprint = response.fingerprint();
  m.version_label = response.version_label();
  m.layout = response.layout();
  m.identity.insert(response.identity().begin(), response.identity().end());
  for (const auto& s : response.segments()) m.segments.push_back(FromProto(s));
  WEIGHTD_RETURN_IF_ERROR(TensorsOf(response, &m.tensors));
  return m;
}

std::string FdSocketPath(const v1::AttachResponse& response) {
  const char* fd_socket_override = std::getenv("WEIGHTD_FD_SOCKET");
  return fd_socket_override != nullptr ? fd_socket_override : response.fd_socket();
}

int ClaimTimeoutMs(const v1::AttachResponse& response) {
  double seconds = response.claim_timeout_seconds();
  return seconds > 0 && seconds <= 86400 ? static_cast<int>(seconds * 1000) : 10000;
}

// The received fds, one per segment exported by fd, in segment order; an
// invalid ScopedFd for segments exported by handle bytes.
absl::StatusOr<std::vector<ScopedFd>> MatchFdsToSegments(std::vector<ScopedFd> fds, const Manifest& m) {
  auto with_fd = [](const SegmentInfo& s) { return s.fd_attached; };
  if (fds.size() != static_cast<size_t>(std::count_if(m.segments.begin(), m.segments.end(), with_fd))) {
    return absl::InternalError(
        absl::StrCat("received ", fds.size(), " segment fds for ", m.segments.size(), " segments"));
  }
  std::vector<ScopedFd> by_segment(m.segments.size());
  auto next = fds.begin();
  for (size_t i = 0; i < m.segments.size(); ++i) {
    if (m.segments[i].fd_attached) by_segment[i] = std::move(*next++);
  }
  return by_segment;
}

// Imports device segment `i` with the backend that exported it; its base.
absl::StatusOr<const char*> ImportSegment(size_t i, MappedModel::State& state) {
  const SegmentInfo& segment = state.manifest.segments[i];
  absl::StatusOr<std::unique_ptr<ImportedArena>> imported =
      ImportArena({segment.backend, segment.gpu_uuid, segment.size, segment.handle, std::move(state.segment_fds[i]),
                   state.copy_on_write});
  if (!imported.ok()) {
    return Annotate(imported.status(), absl::StrCat("importing segment ", i, " on ", segment.gpu_uuid));
  }
  state.imports[i] = std::move(*imported);
  return static_cast<const char*>(state.imports[i]->device_pointer());
}

// Maps host segment `i` lazily or prefaulted, read-only or copy-on-write; its base.
absl::StatusOr<const char*> MapHostSegment(size_t i, MappedModel::State& state) {
  uint64_t size = state.manifest.segments[i].size;
  if (size == 0) return static_cast<const char*>(nullptr);
  absl::StatusOr<char*> addr = MapSegmentFd(state.segment_fds[i].get(), size, state.copy_on_write, state.prefault);
  if (!addr.ok()) return Annotate(addr.status(), absl::StrCat("segment ", i));
  state.mappings.emplace_back(*addr, size);
  return static_cast<const char*>(*addr);
}

// Maps or imports every segment; the base address of each.
absl::StatusOr<std::vector<const char*>> MapSegments(MappedModel::State& state) {
  const std::vector<SegmentInfo>& segments = state.manifest.segments;
  std::vector<const char*> bases(segments.size(), nullptr);
  state.imports.resize(segments.size());
  for (size_t i = 0; i < segments.size(); ++i) {
    bool device = segments[i].location == Location::kDevice;
    WEIGHTD_ASSIGN_OR_RETURN(bases[i], device ? ImportSegment(i, state) : MapHostSegment(i, state));
  }
  return bases;
}

// One view per tensor at its segment's base + offset.
absl::Status BuildViews(const std::vector<const char*>& bases, MappedModel::State& state) {
  const Manifest& m = state.manifest;
  state.views.reserve(m.tensors.size());
  for (const TensorInfo& t : m.tensors) {
    if (t.segment >= bases.size() || t.offset > m.segments[t.segment].size ||
        t.nbytes > m.segments[t.segment].size - t.offset) {  // no overflow, whatever the daemon sent
      return absl::InternalError(absl::StrCat("tensor '", t.name, "' lies outside its segment"));
    }
    const ImportedArena* imported = state.imports[t.segment].get();
    state.views.push_back({&t, bases[t.segment] + t.offset, t.nbytes, t.location,
                           imported ? m.segments[t.segment].gpu_uuid : "", imported ? imported->device_ordinal() : -1});
  }
  return absl::OkStatus();
}

}  // namespace

MappedModel::MappedModel(std::shared_ptr<State> state) : state_(std::move(state)) {}
MappedModel::MappedModel(MappedModel&&) noexcept = default;
MappedModel& MappedModel::operator=(MappedModel&&) noexcept = default;
MappedModel::~MappedModel() = default;

const Manifest& MappedModel::manifest() const { return state_->manifest; }
const std::vector<TensorView>& MappedModel::tensors() const { return state_->views; }
double MappedModel::attach_seconds() const { return state_->attach_seconds; }

const TensorView* MappedModel::Find(absl::string_view name) const {
  State& s = *state_;
  // A hash index, not a sort: 100,000 long names sort in tens of milliseconds.
  std::call_once(s.index_once, [&s] {
    s.by_name.reserve(s.views.size());
    for (size_t i = 0; i < s.views.size(); ++i) s.by_name.emplace(s.views[i].info->name, i);
  });
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

bool MappedModel::copy_on_write() const { return state_->copy_on_write; }

PinStatus MappedModel::pin_status() const {
  return state_->pinner ? ToPinStatus(state_->pinner->progress()) : PinStatus{};
}

absl::Status MappedModel::WaitPinned(absl::Duration timeout) const {
  if (!state_->pinner) {
    return absl::FailedPreconditionError(
        absl::StrCat("model ", QuoteName(manifest().model), " was attached without pin (AttachOptions::pin)"));
  }
  return state_->pinner->Wait(timeout);
}

uint64_t MappedModel::device_ptr(const TensorView& view) const {
  if (!state_->pinner || view.info == nullptr) return 0;
  size_t i = view.info - state_->manifest.tensors.data();
  if (i >= state_->pinned_index.size() || state_->pinned_index[i] < 0) return 0;
  return state_->pinner->DevicePointer(state_->pinned_index[i]);
}

bool MappedModel::device_read_only() const {
  for (const auto& imported : state_->imports) {
    if (imported && !imported->read_only()) return false;
  }
  return true;
}

// ---------------------------------------------------------------- Client

// ---------------------------------------------------------------- ModelWatch

struct ModelWatch::State {
  std::shared_ptr<grpc::Channel> channel;  // kept for the stream's life
  grpc::ClientContext context;             // TryCancel is thread-safe
  std::unique_ptr<grpc::ClientReader<v1::ModelEvent>> reader;
  absl::Status ended;  // set by the Next() that saw the stream end

  ~State() {
    if (reader == nullptr || !ended.ok()) return;
    context.TryCancel();
    v1::ModelEvent drained;
    while (reader->Read(&drained)) {
    }
    reader->Finish();
  }
};

ModelWatch::ModelWatch(std::unique_ptr<State> state) : state_(std::move(state)) {}
ModelWatch::ModelWatch(ModelWatch&&) noexcept = default;
ModelWatch& ModelWatch::operator=(ModelWatch&&) noexcept = default;
ModelWatch::~ModelWatch() = default;

absl::StatusOr<WatchEvent> ModelWatch::Next() {
  if (!state_->ended.ok()) return state_->ended;
  v1::ModelEvent e;
  if (state_->reader->Read(&e)) {
    return WatchEvent{v1::ModelEvent::Kind_Name(e.kind()), e.model(),       e.generation(), e.version_label(),
                      e.fingerprint(),                     e.time(),        e.layout(),     e.rank()};
  }
  absl::Status status = FromGrpc(state_->reader->Finish());
  // The daemon ends a stream only with an error; OK would mean a daemon
  // that does not implement it.
  state_->ended = status.ok() ? absl::UnavailableError("the daemon ended the watch") : status;
  return state_->ended;
}

void ModelWatch::Cancel() { state_->context.TryCancel(); }

// ---------------------------------------------------------------- Client

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const std::string& target, const ConnectOptions& options) {
  if (target.empty()) return absl::InvalidArgumentError("empty daemon target");
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials, ChannelCredentials(options));
  auto impl = std::make_unique<Impl>();
  impl->target = NormalizeTarget(target);
  impl->credentials = std::move(credentials);
  {
    absl::MutexLock lock(&impl->mu);
    impl->stubs = impl->Make();
  }
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

absl::StatusOr<UpgradeInfo> Client::UpgradeDaemon() {
  grpc::ClientContext context;
  v1::UpgradeDaemonResponse response;
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(impl_->stub->UpgradeDaemon(&context, v1::UpgradeDaemonRequest(), &response)));
  return UpgradeInfo{response.binary(), response.daemon_instance(), response.models()};
}

absl::StatusOr<Client::DaemonState> Client::Daemon() {
  grpc::ClientContext context;
  v1::ListModelsResponse response;
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(impl_->stub->ListModels(&context, v1::ListModelsRequest(), &response)));
  DaemonState state{response.daemon_instance(), response.last_upgrade_error(), {}};
  for (const auto& m : response.models()) state.models.push_back(FromProto(m));
  return state;
}

absl::StatusOr<std::string> Client::DaemonInstance() {
  WEIGHTD_ASSIGN_OR_RETURN(DaemonState state, Daemon());
  return state.instance;
}

absl::StatusOr<LoadResult> Client::Load(const std::string& name, const std::string& checkpoint_path,
                                        const LoadOptions& options,
                                        const std::function<void(const LoadProgressInfo&)>& progress) {
  v1::LoadModelRequest request;
  request.set_name(name);
  request.set_checkpoint_path(checkpoint_path);
  for (const std::string& p : options.host_resident_patterns) request.add_host_resident_patterns(p);
  for (const std::string& p : options.include_patterns) request.add_include_patterns(p);
  for (const std::string& p : options.exclude_patterns) request.add_exclude_patterns(p);
  request.set_numa_copies(options.numa_copies);
  request.set_tp_size(options.tp_size);
  for (const auto& [pattern, dim] : options.tp_rules) {
    v1::TpRule* rule = request.add_tp_rules();
    rule->set_pattern(pattern);
    rule->set_dim(dim);
  }
  for (const std::string& d : options.devices) request.add_devices(d);
  for (const std::string& p : options.peers) request.add_peers(p);
  grpc::ClientContext context;
  return ReadLoadStream(*impl_->stub->LoadModel(&context, request), progress);
}

absl::StatusOr<LoadResult> Client::Reload(const std::string& name, const std::string& checkpoint_path,
                                          const std::function<void(const LoadProgressInfo&)>& progress) {
  v1::ReloadModelRequest request;
  request.set_name(name);
  request.set_checkpoint_path(checkpoint_path);
  grpc::ClientContext context;
  return ReadLoadStream(*impl_->stub->ReloadModel(&context, request), progress);
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
    manifest.version_label = page.version_label();
    for (const auto& s : page.segments()) manifest.segments.push_back(FromProto(s));
    for (const auto& t : page.tensors()) manifest.tensors.push_back(FromProto(t));
  }
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(reader->Finish()));
  return manifest;
}

namespace {

// The CUDA ordinal that registers pinned pages: the option's, else the
// model's first CUDA arena's, else 0.
int PinOrdinal(const PinOptions& pin, const MappedModel::State& state) {
  if (pin.device_ordinal >= 0) return pin.device_ordinal;
  for (size_t i = 0; i < state.imports.size(); ++i) {
    absl::StatusOr<SegmentBackend> kind = ParseSegmentBackend(state.manifest.segments[i].backend);
    bool cuda = kind.ok() && (*kind == SegmentBackend::kCudaVmm || *kind == SegmentBackend::kCudaLegacyIpc);
    if (cuda && state.imports[i]) return state.imports[i]->device_ordinal();
  }
  return 0;
}

// Starts pinning the `selected` tensors of a mapped model (see client/pin.h).
absl::Status PinMappedTensors(const std::vector<size_t>& selected, const std::vector<const char*>& bases,
                              const PinOptions& pin, MappedModel::State& state) {
  if (pin.patterns.empty()) return absl::OkStatus();
  state.pinned_index.assign(state.manifest.tensors.size(), -1);
  for (size_t j = 0; j < selected.size(); ++j) state.pinned_index[selected[j]] = static_cast<int64_t>(j);
  WEIGHTD_ASSIGN_OR_RETURN(state.pinner,
                           StartPinning(state.manifest, selected, bases, pin.chunk_bytes, PinOrdinal(pin, state)));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MappedModel> Client::Attach(const std::string& name, uint32_t rank, const AttachOptions& options) {
  auto start = std::chrono::steady_clock::now();
  WEIGHTD_RETURN_IF_ERROR(CheckPinOptions(options));
  v1::AttachRequest request;
  request.set_name(name);
  request.set_rank(rank);
  if (options.packed_manifest) request.set_manifest_encoding(v1::AttachRequest::PACKED_TABLE_V1);
  if (options.numa_node.has_value()) request.set_numa_node(*options.numa_node);
  for (int cpu : AllowedCpus()) request.add_cpus(static_cast<uint32_t>(cpu));
  request.set_layout(options.layout);
  request.mutable_identity()->insert(options.identity.begin(), options.identity.end());
  v1::AttachResponse response;
  grpc::ClientContext context;
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(impl_->stub->Attach(&context, request, &response)));
  auto state = std::make_unique<MappedModel::State>();
  state->copy_on_write = options.copy_on_write;
  state->prefault = options.prefault;
  absl::StatusOr<Manifest> manifest = ManifestOf(response);
  absl::StatusOr<std::vector<size_t>> pinned =
      manifest.ok() ? SelectPinnedTensors(*manifest, options.pin) : manifest.status();
  if (!pinned.ok()) {
    // Ends the lease now rather than at its claim timeout; a failure changes nothing.
    v1::DetachRequest detach;
    detach.set_lease_id(response.lease_id());
    v1::DetachResponse ignored;
    grpc::ClientContext detach_context;
    detach_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    impl_->stub->Detach(&detach_context, detach, &ignored);
    return pinned.status();
  }
  state->manifest = std::move(*manifest);
  state->manifest.numa_node = response.numa_node();
  WEIGHTD_RETURN_IF_ERROR(ClaimLease(FdSocketPath(response), response.lease_id(), ClaimTimeoutMs(response),
                                     &state->lease, &state->segment_fds));
  WEIGHTD_ASSIGN_OR_RETURN(state->segment_fds, MatchFdsToSegments(std::move(state->segment_fds), state->manifest));
  WEIGHTD_ASSIGN_OR_RETURN(std::vector<const char*> bases, MapSegments(*state));
  WEIGHTD_RETURN_IF_ERROR(BuildViews(bases, *state));
  WEIGHTD_RETURN_IF_ERROR(PinMappedTensors(*pinned, bases, options.pin, *state));
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

absl::StatusOr<ModelWatch> Client::Watch(const std::string& name) {
  auto state = std::make_unique<ModelWatch::State>();
  std::shared_ptr<ClientStubs> stubs = impl_->Current();
  state->channel = stubs->channel;
  v1::WatchModelRequest request;
  request.set_name(name);
  state->reader = stubs->weightd->WatchModel(&state->context, request);
  // The daemon sends "weightd-watch: subscribed" once the subscription is in
  // place; a refusal (or an unreachable daemon) ends the call without it.
  state->reader->WaitForInitialMetadata();
  const auto& metadata = state->context.GetServerInitialMetadata();
  auto subscribed = metadata.find("weightd-watch");
  if (subscribed == metadata.end() || subscribed->second != "subscribed") {
    v1::ModelEvent ignored;
    while (state->reader->Read(&ignored)) {
    }
    absl::Status refused = FromGrpc(state->reader->Finish());
    state->reader.reset();
    return refused.ok() ? absl::UnimplementedError("the daemon does not serve WatchModel") : refused;
  }
  return ModelWatch(std::move(state));
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

// ---------------------------------------------------------------- Updater

struct Updater::State {
  std::shared_ptr<ClientStubs> stubs;  // the channel the update was begun on
  v1::Weightd::Stub* stub = nullptr;   // stubs->weightd
  std::string update_id;
  uint64_t base_generation = 0, bytes_staged = 0, bytes_shared = 0;
  std::vector<WritableTensor> tensors;
  std::vector<std::pair<void*, size_t>> mappings;  // by staged segment
  ScopedFd conn;  // the fd-socket connection: the update's lease
  bool ended = false;

  void Unmap() {
    for (auto& [addr, size] : mappings) {
      if (addr != nullptr) munmap(addr, size);
    }
    mappings.clear();
    for (WritableTensor& t : tensors) t.data = nullptr;
  }
  ~State() { Unmap(); }  // then `conn` closes: the daemon aborts an update not committed
};

Updater::Updater(std::unique_ptr<State> state) : state_(std::move(state)) {}
Updater::Updater(Updater&&) noexcept = default;
Updater& Updater::operator=(Updater&&) noexcept = default;
Updater::~Updater() = default;

const std::vector<WritableTensor>& Updater::tensors() const { return state_->tensors; }
WritableTensor* Updater::Find(absl::string_view name, uint32_t rank) {
  for (WritableTensor& t : state_->tensors) {
    if (t.info.name == name && t.rank == rank) return &t;
  }
  return nullptr;
}
uint64_t Updater::base_generation() const { return state_->base_generation; }
uint64_t Updater::bytes_staged() const { return state_->bytes_staged; }
uint64_t Updater::bytes_shared() const { return state_->bytes_shared; }

absl::StatusOr<CommitInfo> Updater::Commit(const std::map<std::string, std::string>& expected_hashes,
                                           const std::string& version_label) {
  if (state_->ended) return absl::FailedPreconditionError("this update was already committed or aborted");
  state_->Unmap();
  v1::CommitUpdateRequest request;
  request.set_update_id(state_->update_id);
  for (const auto& [name, hash] : expected_hashes) (*request.mutable_expected_hashes())[name] = hash;
  request.set_version_label(version_label);
  grpc::ClientContext context;
  v1::CommitUpdateResponse response;
  absl::Status status = FromGrpc(state_->stub->CommitUpdate(&context, request, &response));
  state_->ended = true;
  state_->conn.Reset();
  if (!status.ok()) return status;
  return CommitInfo{FromProto(response.model()), response.tensors_changed(), response.bytes_written(),
                    response.bytes_shared(), response.seconds()};
}

absl::Status Updater::Abort() {
  if (state_->ended) return absl::OkStatus();
  state_->Unmap();
  v1::AbortUpdateRequest request;
  request.set_update_id(state_->update_id);
  grpc::ClientContext context;
  v1::AbortUpdateResponse response;
  absl::Status status = FromGrpc(state_->stub->AbortUpdate(&context, request, &response));
  state_->ended = true;
  state_->conn.Reset();  // also ends it, should the RPC have failed
  return absl::IsNotFound(status) ? absl::OkStatus() : status;
}

absl::StatusOr<Updater> Client::BeginUpdate(const std::string& name, const std::vector<std::string>& tensors) {
  v1::BeginUpdateRequest request;
  request.set_name(name);
  for (const std::string& t : tensors) request.add_tensors(t);
  grpc::ClientContext context;
  v1::BeginUpdateResponse response;
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(impl_->stub->BeginUpdate(&context, request, &response)));
  auto state = std::make_unique<Updater::State>();
  state->stubs = impl_->Current();
  state->stub = state->stubs->weightd.get();
  state->update_id = response.update_id();
  state->base_generation = response.base_generation();
  state->bytes_staged = response.bytes_staged();
  state->bytes_shared = response.bytes_shared();
  std::vector<ScopedFd> fds;
  int timeout_ms = static_cast<int>(response.claim_timeout_seconds() * 1000);
  WEIGHTD_RETURN_IF_ERROR(ClaimLease(response.fd_socket(), response.update_id(), timeout_ms, &state->conn, &fds));
  if (fds.size() != static_cast<size_t>(response.segments_size())) {
    return absl::InternalError(absl::StrCat("fd socket: ", fds.size(), " fds for ", response.segments_size(),
                                            " staged segments"));
  }
  for (int i = 0; i < response.segments_size(); ++i) {
    uint64_t size = response.segments(i).size();
    void* addr = nullptr;
    if (size > 0) {
      // MAP_POPULATE: the staged pages exist already; mapping them up front spares the
      // writer one page fault per 4 KiB page (measured: 1.4 s -> 0.6 s for 2.4 GiB).
      addr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fds[i].get(), 0);
      if (addr == MAP_FAILED) return ErrnoToStatus(absl::StrCat("mmap staged segment ", i, " read-write"), errno);
    }
    state->mappings.emplace_back(addr, size);
  }
  for (const v1::UpdateTensor& t : response.tensors()) {
    WritableTensor w{FromProto(t.entry()), t.rank(), nullptr};
    if (w.info.segment >= state->mappings.size() || w.info.offset > state->mappings[w.info.segment].second ||
        w.info.nbytes > state->mappings[w.info.segment].second - w.info.offset) {
      return absl::InternalError(absl::StrCat("update tensor ", w.info.name, " lies outside its staged segment"));
    }
    w.data = static_cast<char*>(state->mappings[w.info.segment].first) + w.info.offset;
    state->tensors.push_back(std::move(w));
  }
  return Updater(std::move(state));
}

}  // namespace weightd
