// Client::BeginLayout and LayoutWriter: publishing a runtime layout
// (docs/api.md "Runtime layouts", server/layout/layout_publish.h).
#include <errno.h>
#include <sys/mman.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/client_internal.h"
#include "common/base/status.h"

namespace weightd {

struct LayoutWriter::State {
  std::shared_ptr<ClientStubs> stubs;  // the channel the publish was begun on
  std::string writer_id;
  std::string model;
  uint64_t generation = 0;
  uint32_t rank = 0;
  uint64_t bytes_staged = 0;
  bool published_by_other = false;
  std::vector<WritableTensor> tensors;
  std::vector<ScopedFd> fds;       // the staged memfds, by segment
  std::vector<uint64_t> sizes;     // their sizes
  std::vector<void*> mappings;     // their writable mappings (nullptr: not mapped); empty while unmapped
  ScopedFd conn;  // the fd-socket connection: the publish's lease
  bool ended = false;

  // Maps every staged memfd read-write and points the tensors into them. A
  // memfd the daemon sealed already (a commit that sealed one segment and
  // was refused on the next) refuses with EPERM: its tensors stay nullptr.
  absl::Status Map() {
    mappings.assign(fds.size(), nullptr);
    for (size_t i = 0; i < fds.size(); ++i) {
      // MAP_POPULATE: the writer touches every page of its tensors anyway.
      void* addr = mmap(nullptr, sizes[i], PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fds[i].get(), 0);
      if (addr != MAP_FAILED) {
        mappings[i] = addr;
      } else if (errno != EPERM) {
        int error = errno;
        Unmap();
        return ErrnoToStatus(absl::StrCat("mmap staged layout segment ", i, " read-write"), error);
      }
    }
    for (WritableTensor& t : tensors) {
      t.data = mappings[t.info.segment] ? static_cast<char*>(mappings[t.info.segment]) + t.info.offset : nullptr;
    }
    return absl::OkStatus();
  }
  void Unmap() {
    for (size_t i = 0; i < mappings.size(); ++i) {
      if (mappings[i] != nullptr) munmap(mappings[i], sizes[i]);
    }
    mappings.clear();
    for (WritableTensor& t : tensors) t.data = nullptr;
  }
  ~State() { Unmap(); }  // then `conn` closes: the daemon aborts a publish not committed
};

LayoutWriter::LayoutWriter(std::unique_ptr<State> state) : state_(std::move(state)) {}
LayoutWriter::LayoutWriter(LayoutWriter&&) noexcept = default;
LayoutWriter& LayoutWriter::operator=(LayoutWriter&&) noexcept = default;
LayoutWriter::~LayoutWriter() = default;

bool LayoutWriter::published_by_other() const { return state_->published_by_other; }
const std::vector<WritableTensor>& LayoutWriter::tensors() const { return state_->tensors; }
WritableTensor* LayoutWriter::Find(absl::string_view name) {
  for (WritableTensor& t : state_->tensors) {
    if (t.info.name == name) return &t;
  }
  return nullptr;
}
const std::string& LayoutWriter::model() const { return state_->model; }
uint64_t LayoutWriter::generation() const { return state_->generation; }
uint32_t LayoutWriter::rank() const { return state_->rank; }
uint64_t LayoutWriter::bytes_staged() const { return state_->bytes_staged; }
std::vector<int> LayoutWriter::staged_fds() const {
  std::vector<int> out;
  for (const ScopedFd& fd : state_->fds) out.push_back(fd.get());
  return out;
}

absl::StatusOr<LayoutCommitInfo> LayoutWriter::Commit(const std::map<std::string, std::string>& expected_hashes) {
  State& s = *state_;
  if (s.published_by_other) {
    return absl::FailedPreconditionError(absl::StrCat("layout of model ", s.model, " rank ", s.rank,
                                                      " was published by another writer; attach it instead"));
  }
  if (s.ended) return absl::FailedPreconditionError("this layout publish was already committed or aborted");
  s.Unmap();  // F_SEAL_WRITE fails while any writable mapping exists
  v1::CommitLayoutRequest request;
  request.set_writer_id(s.writer_id);
  for (const auto& [name, hash] : expected_hashes) (*request.mutable_expected_hashes())[name] = hash;
  grpc::ClientContext context;
  v1::CommitLayoutResponse response;
  absl::Status status = FromGrpc(s.stubs->weightd->CommitLayout(&context, request, &response));
  if (status.ok()) {
    s.ended = true;
    s.fds.clear();  // sealed now; the daemon holds its own references
    s.conn.Reset();
    return LayoutCommitInfo{FromProto(response.layout()), response.seconds()};
  }
  // A refusal the writer can fix leaves the staged memory unsealed and the
  // publish open: map it again. Sealed (the publish ended): mmap is refused
  // with EPERM and the tensors stay unmapped.
  if (absl::IsFailedPrecondition(status) || absl::IsInvalidArgument(status)) (void)s.Map();
  return status;
}

absl::Status LayoutWriter::Abort() {
  State& s = *state_;
  if (s.ended || s.published_by_other) return absl::OkStatus();
  s.Unmap();
  v1::AbortLayoutRequest request;
  request.set_writer_id(s.writer_id);
  grpc::ClientContext context;
  v1::AbortLayoutResponse response;
  absl::Status status = FromGrpc(s.stubs->weightd->AbortLayout(&context, request, &response));
  s.ended = true;
  s.fds.clear();
  s.conn.Reset();  // also ends it, should the RPC have failed
  return absl::IsNotFound(status) ? absl::OkStatus() : status;
}

namespace {

v1::BeginLayoutRequest ToProto(const LayoutOptions& o) {
  v1::BeginLayoutRequest r;
  r.set_name(o.model);
  r.set_key(o.key);
  r.mutable_identity()->insert(o.identity.begin(), o.identity.end());
  r.set_rank(o.rank);
  for (const LayoutTensorRequest& t : o.tensors) {
    v1::LayoutTensorSpec* spec = r.add_tensors();
    spec->set_name(t.name);
    spec->set_dtype(t.dtype);
    for (uint64_t d : t.shape) spec->add_shape(d);
    for (uint64_t d : t.strides) spec->add_strides(d);
    spec->set_placement(t.location == Location::kDevice ? v1::DEVICE : v1::HOST);
  }
  r.set_gpu_uuid(o.gpu_uuid);
  r.set_generation(o.generation);
  r.set_wait_seconds(o.wait_seconds);
  return r;
}

// The staged tensors of `response`, each checked to lie inside its segment.
absl::Status TakeTensors(const v1::BeginLayoutResponse& response, LayoutWriter::State& s) {
  for (const v1::TensorEntry& t : response.tensors()) {
    WritableTensor w{FromProto(t), s.rank, nullptr};
    const TensorInfo& i = w.info;
    if (i.segment >= s.sizes.size() || i.offset > s.sizes[i.segment] || i.nbytes > s.sizes[i.segment] - i.offset) {
      return absl::InternalError(absl::StrCat("layout tensor '", i.name, "' lies outside its staged segment ",
                                              i.segment, " (offset ", i.offset, ", ", i.nbytes, " bytes)"));
    }
    s.tensors.push_back(std::move(w));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LayoutWriter> Client::BeginLayout(const LayoutOptions& options) {
  v1::BeginLayoutRequest request = ToProto(options);
  auto state = std::make_unique<LayoutWriter::State>();
  state->stubs = impl_->Current();
  grpc::ClientContext context;
  if (options.wait_seconds > 0 && options.wait_seconds <= 3600) {  // the daemon refuses other values
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(static_cast<int64_t>(options.wait_seconds * 1000) + 60000));
  }
  v1::BeginLayoutResponse response;
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(state->stubs->weightd->BeginLayout(&context, request, &response)));
  LayoutWriter::State& s = *state;
  s.model = response.model();
  s.generation = response.generation();
  s.rank = response.rank();
  s.bytes_staged = response.bytes_staged();
  if (response.published()) {
    s.published_by_other = true;
    s.ended = true;
    return LayoutWriter(std::move(state));
  }
  s.writer_id = response.writer_id();
  for (const auto& segment : response.segments()) s.sizes.push_back(segment.size());
  WEIGHTD_RETURN_IF_ERROR(TakeTensors(response, s));
  double claim = response.claim_timeout_seconds();
  int timeout_ms = claim > 0 && claim <= 86400 ? static_cast<int>(claim * 1000) : 10000;
  WEIGHTD_RETURN_IF_ERROR(ClaimLease(response.fd_socket(), s.writer_id, timeout_ms, &s.conn, &s.fds));
  if (s.fds.size() != s.sizes.size()) {
    return absl::InternalError(
        absl::StrCat("fd socket: ", s.fds.size(), " fds for ", s.sizes.size(), " staged layout segments"));
  }
  WEIGHTD_RETURN_IF_ERROR(s.Map());
  return LayoutWriter(std::move(state));
}

absl::StatusOr<uint32_t> Client::DropLayout(const std::string& name, const std::string& key,
                                            std::optional<uint32_t> rank) {
  v1::DropLayoutRequest request;
  request.set_name(name);
  request.set_key(key);
  if (rank.has_value()) request.set_rank(*rank);
  grpc::ClientContext context;
  v1::DropLayoutResponse response;
  WEIGHTD_RETURN_IF_ERROR(FromGrpc(impl_->stub->DropLayout(&context, request, &response)));
  return response.dropped();
}

}  // namespace weightd
