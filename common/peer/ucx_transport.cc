// The UCX (UCP) PeerTransport. One context, one worker (thread mode
// SERIALIZED: every UCP call is made under mu_), and a progress thread that
// sleeps on the worker's event fd (UCP_FEATURE_WAKEUP) between bursts of
// work. Reads are RMA GETs (ucp_get_nbx) of the seed's registered memory;
// over TCP, UCX serves them in software on the seed's progress thread.
// References: UCX 1.13 ucp.h (ucp_init, ucp_worker_create, ucp_worker_arm,
// ucp_mem_map, ucp_rkey_pack, ucp_ep_create, ucp_ep_rkey_unpack,
// ucp_get_nbx, ucp_ep_close_nbx).
#include <fcntl.h>
#include <poll.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/log.h"
#include "common/base/scoped_fd.h"
#include "common/base/status.h"
#include "common/peer/peer_transport.h"

namespace weightd {
namespace {

// A read is cut into GETs of at most this many bytes, all issued at once,
// so that one large read keeps several requests in flight.
constexpr uint64_t kPieceBytes = 4ull << 20;
// UCX parses worker addresses and packed keys without being told their
// length; what a peer sent is copied into a zeroed buffer this much larger,
// so malformed bytes cannot make the parser read past our memory.
constexpr size_t kParsePadding = 64 << 10;
constexpr char kTcpSegSize[] = "256k";

absl::Status UcxError(absl::string_view what, ucs_status_t status) {
  std::string message = absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
      return absl::ResourceExhaustedError(message);
    case UCS_ERR_INVALID_PARAM:
      return absl::InvalidArgumentError(message);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(message);
    default:
      return absl::UnavailableError(message);
  }
}

std::string Padded(const std::string& bytes) {
  std::string out(bytes.size() + kParsePadding, '\0');
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

class UcxTransport;

class UcxRegion final : public PeerRegion {
 public:
  UcxRegion(UcxTransport* transport, ucp_mem_h memh, RemoteRegion remote)
      : transport_(transport), memh_(memh), remote_(std::move(remote)) {}
  ~UcxRegion() override;
  RemoteRegion Describe() const override { return remote_; }

 private:
  UcxTransport* transport_;
  ucp_mem_h memh_;
  RemoteRegion remote_;
};

// The reads of one Read() call; lives on its caller's stack until every
// request it issued has completed.
struct Batch {
  size_t outstanding = 0;
  absl::Status error;
};

class UcxConnection;

class UcxTransport final : public PeerTransport {
 public:
  ~UcxTransport() override {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    Wake();
    if (progress_.joinable()) progress_.join();
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  absl::Status Init() {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return UcxError("ucp_config_read", st);
    // UCX over TCP serves a GET in software, one reply per segment of
    // UCX_TCP_TX_SEG_SIZE bytes (8 KiB by default): larger segments cut the
    // per-fragment cost (docs/performance.md "Peer seeding"). UCX 1.13
    // applies a modified transport key by its name within the transport's
    // table ("TX_SEG_SIZE", not "TCP_TX_SEG_SIZE"); RX must be >= TX. An
    // operator's own UCX_TCP_*_SEG_SIZE wins.
    if (std::getenv("UCX_TCP_TX_SEG_SIZE") == nullptr && std::getenv("UCX_TCP_RX_SEG_SIZE") == nullptr) {
      (void)ucp_config_modify(config, "TX_SEG_SIZE", kTcpSegSize);
      (void)ucp_config_modify(config, "RX_SEG_SIZE", kTcpSegSize);
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP;
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) return UcxError("ucp_init", st);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    st = ucp_worker_create(context_, &wp, &worker_);
    if (st != UCS_OK) return UcxError("ucp_worker_create", st);
    ucp_address_t* address = nullptr;
    size_t length = 0;
    st = ucp_worker_get_address(worker_, &address, &length);
    if (st != UCS_OK) return UcxError("ucp_worker_get_address", st);
    address_.assign(reinterpret_cast<const char*>(address), length);
    ucp_worker_release_address(worker_, address);
    st = ucp_worker_get_efd(worker_, &efd_);
    if (st != UCS_OK) return UcxError("ucp_worker_get_efd", st);
    int pipe_fds[2];
    if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) return ErrnoToStatus("pipe2", errno);
    wake_read_ = ScopedFd(pipe_fds[0]);
    wake_write_ = ScopedFd(pipe_fds[1]);
    progress_ = std::thread([this] { ProgressLoop(); });
    return absl::OkStatus();
  }

  std::string name() const override { return "ucx"; }
  std::string worker_address() const override { return address_; }

  absl::StatusOr<std::unique_ptr<PeerRegion>> Register(const void* base, uint64_t size) override {
    absl::MutexLock lock(&mu_);
    ucp_mem_map_params_t mp{};
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH | UCP_MEM_MAP_PARAM_FIELD_PROT;
    mp.address = const_cast<void*>(base);
    mp.length = std::max<uint64_t>(size, 1);
    mp.prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_REMOTE_READ;
    ucp_mem_h memh = nullptr;
    ucs_status_t st = ucp_mem_map(context_, &mp, &memh);
    if (st != UCS_OK) return UcxError(absl::StrCat("ucp_mem_map of ", size, " bytes"), st);
    void* packed = nullptr;
    size_t packed_size = 0;
    st = ucp_rkey_pack(context_, memh, &packed, &packed_size);
    if (st != UCS_OK) {
      ucp_mem_unmap(context_, memh);
      return UcxError("ucp_rkey_pack", st);
    }
    RemoteRegion remote{reinterpret_cast<uint64_t>(base), size, std::string(static_cast<char*>(packed), packed_size)};
    ucp_rkey_buffer_release(packed);
    return std::unique_ptr<PeerRegion>(new UcxRegion(this, memh, std::move(remote)));
  }

  absl::StatusOr<std::unique_ptr<PeerConnection>> Connect(const std::string& worker_address,
                                                          const std::vector<RemoteRegion>& regions) override;

  void StallForTest() override {
    absl::MutexLock lock(&mu_);
    stalled_ = true;
  }

  void Unmap(ucp_mem_h memh) {
    absl::MutexLock lock(&mu_);
    ucp_mem_unmap(context_, memh);
  }

  // Makes the progress thread run a round now (after posting work).
  void Wake() {
    char c = 1;
    (void)!write(wake_write_.get(), &c, 1);
  }

  absl::Mutex mu_;  // every UCP call
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;

 private:
  void ProgressLoop() {
    for (;;) {
      ucs_status_t armed;
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
        if (!stalled_) {
          while (ucp_worker_progress(worker_) != 0) {
          }
        }
        armed = stalled_ ? UCS_OK : ucp_worker_arm(worker_);
      }
      if (armed == UCS_ERR_BUSY) continue;  // more events arrived meanwhile
      pollfd fds[2] = {{efd_, POLLIN, 0}, {wake_read_.get(), POLLIN, 0}};
      poll(fds, 2, 100);
      char drain[64];
      while (read(wake_read_.get(), drain, sizeof drain) > 0) {
      }
    }
  }

  std::string address_;
  int efd_ = -1;
  ScopedFd wake_read_, wake_write_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool stalled_ ABSL_GUARDED_BY(mu_) = false;
  std::thread progress_;
};

UcxRegion::~UcxRegion() { transport_->Unmap(memh_); }

class UcxConnection final : public PeerConnection {
 public:
  explicit UcxConnection(UcxTransport* transport) : t_(transport) {}

  ~UcxConnection() override {
    absl::MutexLock lock(&t_->mu_);
    for (ucp_rkey_h rkey : rkeys_) ucp_rkey_destroy(rkey);
    rkeys_.clear();
    if (ep_ == nullptr) return;
    // Flush and close (force a broken one); a close that does not finish
    // within 5 s is left to the worker's destruction.
    if (!close_issued_) CloseLocked(broken_.ok() ? 0 : UCP_EP_CLOSE_FLAG_FORCE);
    if (!t_->mu_.AwaitWithTimeout(absl::Condition(&closed_), absl::Seconds(5))) {
      LogWarning("UCX peer endpoint did not close within 5 s");
    }
  }

  absl::Status Open(const std::string& worker_address, const std::vector<RemoteRegion>& regions) {
    if (worker_address.empty() || worker_address.size() > kMaxPeerWorkerAddressBytes) {
      return absl::InvalidArgumentError(absl::StrCat("peer worker address of ", worker_address.size(),
                                                     " bytes (must be 1..", kMaxPeerWorkerAddressBytes, ")"));
    }
    std::string address = Padded(worker_address);
    absl::MutexLock lock(&t_->mu_);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(address.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxConnection::OnEndpointError;
    ep.err_handler.arg = this;
    ucs_status_t st = ucp_ep_create(t_->worker_, &ep, &ep_);
    if (st != UCS_OK) {
      ep_ = nullptr;
      return UcxError("ucp_ep_create", st);
    }
    for (size_t i = 0; i < regions.size(); ++i) {
      const RemoteRegion& r = regions[i];
      if (r.key.empty() || r.key.size() > kMaxPeerRemoteKeyBytes) {
        return absl::InvalidArgumentError(absl::StrCat("remote key ", i, " of ", r.key.size(), " bytes (must be 1..",
                                                       kMaxPeerRemoteKeyBytes, ")"));
      }
      std::string key = Padded(r.key);
      ucp_rkey_h rkey = nullptr;
      st = ucp_ep_rkey_unpack(ep_, key.data(), &rkey);
      if (st != UCS_OK) return UcxError(absl::StrCat("ucp_ep_rkey_unpack of remote key ", i), st);
      rkeys_.push_back(rkey);
      regions_.push_back({r.address, r.size, ""});
    }
    t_->Wake();
    return absl::OkStatus();
  }

  absl::Status Read(const std::vector<PeerRead>& reads, std::chrono::steady_clock::time_point deadline) override {
    for (const PeerRead& r : reads) {
      if (r.region >= regions_.size() || r.offset > regions_[r.region].size ||
          r.n > regions_[r.region].size - r.offset) {
        return absl::InvalidArgumentError(absl::StrCat("read of ", r.n, " bytes at ", r.offset, " of region ",
                                                       r.region, " is outside the peer's regions"));
      }
    }
    Batch batch;
    absl::MutexLock lock(&t_->mu_);
    if (!broken_.ok()) return broken_;
    for (const PeerRead& r : reads) {
      for (uint64_t done = 0; done < r.n && batch.error.ok(); done += kPieceBytes) {
        Issue(r, done, std::min(kPieceBytes, r.n - done), batch);
      }
    }
    t_->Wake();
    absl::Time until = absl::FromChrono(std::chrono::system_clock::now() + (deadline - std::chrono::steady_clock::now()));
    auto settled = [&] { return batch.outstanding == 0 || !broken_.ok(); };
    t_->mu_.AwaitWithDeadline(absl::Condition(&settled), until);
    if (batch.outstanding > 0) {
      // Broken or late: fail what is in flight so no transfer outlives the call.
      if (broken_.ok()) broken_ = absl::DeadlineExceededError("peer reads did not finish before the deadline");
      if (!close_issued_) CloseLocked(UCP_EP_CLOSE_FLAG_FORCE);
      t_->Wake();
      t_->mu_.Await(absl::Condition(+[](Batch* b) { return b->outstanding == 0; }, &batch));
    }
    if (!broken_.ok()) return broken_;
    if (!batch.error.ok()) broken_ = batch.error;
    return broken_;
  }

 private:
  struct Region {
    uint64_t address, size;
    std::string unused;
  };

  void Issue(const PeerRead& r, uint64_t at, uint64_t n, Batch& batch) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t_->mu_) {
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = &UcxConnection::OnGetDone;
    param.user_data = &batch;
    ucs_status_ptr_t sp = ucp_get_nbx(ep_, r.dst + at, n, regions_[r.region].address + r.offset + at,
                                      rkeys_[r.region], &param);
    if (UCS_PTR_IS_ERR(sp)) {
      batch.error = UcxError("ucp_get_nbx", UCS_PTR_STATUS(sp));
    } else if (sp != nullptr) {
      ++batch.outstanding;
    }
  }

  // Callbacks run inside ucp_worker_progress, under t_->mu_.
  static void OnGetDone(void* request, ucs_status_t status, void* user_data) {
    auto* batch = static_cast<Batch*>(user_data);
    if (status != UCS_OK && batch->error.ok()) batch->error = UcxError("peer read", status);
    --batch->outstanding;
    ucp_request_free(request);
  }
  static void OnEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
    auto* self = static_cast<UcxConnection*>(arg);
    if (self->broken_.ok()) self->broken_ = UcxError("peer connection failed", status);
  }
  static void OnClosed(void* request, ucs_status_t, void* user_data) {
    static_cast<UcxConnection*>(user_data)->closed_ = true;
    ucp_request_free(request);
  }

  void CloseLocked(uint32_t flags) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t_->mu_) {
    close_issued_ = true;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = flags;
    param.cb.send = &UcxConnection::OnClosed;
    param.user_data = this;
    ucs_status_ptr_t sp = ucp_ep_close_nbx(ep_, &param);
    if (sp == nullptr || UCS_PTR_IS_ERR(sp)) closed_ = true;
    t_->Wake();
  }

  UcxTransport* t_;
  ucp_ep_h ep_ = nullptr;
  std::vector<ucp_rkey_h> rkeys_;
  std::vector<Region> regions_;
  absl::Status broken_;  // guarded by t_->mu_
  bool closed_ = false;  // guarded by t_->mu_
  bool close_issued_ = false;  // guarded by t_->mu_
};

absl::StatusOr<std::unique_ptr<PeerConnection>> UcxTransport::Connect(const std::string& worker_address,
                                                                      const std::vector<RemoteRegion>& regions) {
  auto connection = std::make_unique<UcxConnection>(this);
  WEIGHTD_RETURN_IF_ERROR(connection->Open(worker_address, regions));
  return std::unique_ptr<PeerConnection>(std::move(connection));
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerTransport>> MakeUcxTransport() {
  auto transport = std::make_unique<UcxTransport>();
  if (absl::Status st = transport->Init(); !st.ok()) return Annotate(st, "UCX peer transport");
  return std::unique_ptr<PeerTransport>(std::move(transport));
}

}  // namespace weightd
