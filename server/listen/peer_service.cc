#include "server/listen/peer_service.h"

#include <chrono>
#include <set>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/base/status.h"
#include "server/api/convert.h"
#include "server/listen/grpc_limits.h"
#include "server/listen/health_port.h"
#include "server/listen/rpc_metrics.h"
#include "server/listen/tcp_listener.h"
#include "weightd/v1/peer.grpc.pb.h"

namespace weightd {
namespace {

using TransferReactor = grpc::ServerBidiReactor<v1::PeerTransferRequest, v1::PeerTransferReply>;

// The joiner's name as it gave it (PeerTransferRequest.joiner), when it is
// 1..64 characters of [A-Za-z0-9._:-]; else "unnamed". Connections reach
// gRPC through our acceptor as fds, so gRPC cannot tell the address.
std::string JoinerName(const std::string& given) {
  bool ok = !given.empty() && given.size() <= 64;
  for (char c : given) ok = ok && (absl::ascii_isalnum(c) || c == '.' || c == '_' || c == ':' || c == '-');
  return ok ? given : "unnamed";
}

}  // namespace

class PeerListener::Service final : public v1::Peer::CallbackService {
 public:
  Service(PeerSeed* seed) : seed_(seed), reaper_([this] { Reap(); }) {}
  ~Service() override {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    reaper_.join();
  }

  TransferReactor* Transfer(grpc::CallbackServerContext* context) override;

  // Ends every open session with `status` and refuses new ones.
  void EndAll(const grpc::Status& status);

  class Reactor;

 private:
  friend class Reactor;
  void Track(Reactor* r);
  void Untrack(Reactor* r);
  void Reap();

  PeerSeed* seed_;
  absl::Mutex mu_;
  std::set<Reactor*> open_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool refusing_ ABSL_GUARDED_BY(mu_) = false;
  std::thread reaper_;
};

class PeerListener::Service::Reactor final : public TransferReactor {
 public:
  Reactor(Service* service, grpc::CallbackServerContext* context)
      : service_(service), started_(std::chrono::steady_clock::now()) {
    service_->Track(this);
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (session_ == nullptr && !opened_) {
      opened_ = true;
      if (!ok) return End(grpc::Status(grpc::StatusCode::CANCELLED, "the joiner sent no request"));
      joiner_ = JoinerName(request_.joiner());
      absl::StatusOr<std::unique_ptr<PeerSeed::Session>> session = service_->seed_->Open(request_.name(), joiner_, request_.lanes());
      if (!session.ok()) return End(ToGrpcStatus(session.status()));
      session_ = std::move(*session);
      service_->seed_->Describe(*session_, &reply_);
      StartWrite(&reply_);
      StartRead(&request_);
      return;
    }
    if (ok && request_.done() && session_ != nullptr) session_->Finished(request_.bytes_read(), request_.verified());
    End(grpc::Status::OK);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) End(grpc::Status(grpc::StatusCode::CANCELLED, "the joiner went away"));
  }
  void OnCancel() override { End(grpc::Status(grpc::StatusCode::CANCELLED, "cancelled")); }
  void OnDone() override {
    service_->Untrack(this);
    delete this;  // the session ends here: registrations and lease released
  }

  // Ends the call once; later calls do nothing.
  void End(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }
  bool Expired(std::chrono::milliseconds limit) const { return std::chrono::steady_clock::now() - started_ > limit; }

 private:
  Service* service_;
  std::string joiner_;
  std::chrono::steady_clock::time_point started_;
  v1::PeerTransferRequest request_;
  v1::PeerTransferReply reply_;
  std::unique_ptr<PeerSeed::Session> session_;
  bool opened_ = false;
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

TransferReactor* PeerListener::Service::Transfer(grpc::CallbackServerContext* context) {
  {
    absl::MutexLock lock(&mu_);
    if (refusing_) {
      class Refuse final : public TransferReactor {
       public:
        Refuse() { Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "weightd is shutting down")); }
        void OnDone() override { delete this; }
      };
      return new Refuse;
    }
  }
  return new Reactor(this, context);
}

void PeerListener::Service::Track(Reactor* r) {
  absl::MutexLock lock(&mu_);
  open_.insert(r);
}

void PeerListener::Service::Untrack(Reactor* r) {
  absl::MutexLock lock(&mu_);
  open_.erase(r);
}

void PeerListener::Service::EndAll(const grpc::Status& status) {
  absl::MutexLock lock(&mu_);
  refusing_ = true;
  for (Reactor* r : open_) r->End(status);
}

// Ends sessions past the limit; a reactor is untracked (under mu_) before
// it is deleted, so every pointer in open_ is live here.
void PeerListener::Service::Reap() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Milliseconds(250))) {
    for (Reactor* r : open_) {
      if (r->Expired(seed_->options().session_limit)) {
        r->End(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            "the transfer session passed the seed's --peer-deadline-seconds"));
      }
    }
  }
}

PeerListener::PeerListener() = default;

PeerListener::~PeerListener() { Shutdown(); }

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Start(const PeerListenerOptions& options, PeerSeed* seed,
                                                                  Metrics* metrics) {
  std::unique_ptr<PeerListener> peer(new PeerListener());
  peer->service_ = std::make_unique<Service>(seed);
  // Plain TCP, or mutual TLS (the peer_tls_* keys are all set or none).
  std::shared_ptr<grpc::ServerCredentials> tls;
  if (!options.tls_cert.empty()) {
    WEIGHTD_ASSIGN_OR_RETURN(tls, ServerTlsCredentials({options.tls_cert, options.tls_key, options.tls_ca,
                                                        "--peer-tls-cert", "--peer-tls-key", "--peer-tls-ca"}));
  }
  grpc::ServerBuilder builder;
  WEIGHTD_ASSIGN_OR_RETURN(ScopedFd listener,
                           AddTcpPort(options.limits, options.address, "--peer-address", tls, builder, &peer->port_));
  builder.SetOption(WithoutReflectionOption());
  builder.RegisterService(peer->service_.get());
  builder.SetMaxSendMessageSize(-1);
  ApplyGrpcLimits(options.limits, builder);  // streams per connection; connections: AddTcpPort
  CountRpcs(builder, metrics);
  peer->server_ = builder.BuildAndStart();
  if (peer->server_ == nullptr || peer->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on --peer-address ", options.address));
  }
  WEIGHTD_ASSIGN_OR_RETURN(peer->acceptor_, AcceptTcp(options.limits, std::move(listener),
                                                     absl::StrCat("peer listener ", options.address),
                                                     peer->server_.get()));
  return peer;
}

void PeerListener::Shutdown() {
  acceptor_.reset();
  if (service_) service_->EndAll(grpc::Status(grpc::StatusCode::UNAVAILABLE, "weightd is shutting down"));
  if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace weightd
