// What client.cc and layout_writer.cc share: the channel and stubs of a
// Client, the status conversion, the proto conversions and the fd-socket
// claim. Not installed; no user of the library includes it.
#ifndef WEIGHTD_CLIENT_CLIENT_INTERNAL_H_
#define WEIGHTD_CLIENT_CLIENT_INTERNAL_H_

#include <grpcpp/grpcpp.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/base/scoped_fd.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "weightd/client.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {

// The daemon's gRPC status as an absl::Status (same code and message).
absl::Status FromGrpc(const grpc::Status& s);
ModelSummary FromProto(const v1::ModelInfo& m);
LayoutSummary FromProto(const v1::LayoutInfo& l);
TensorInfo FromProto(const v1::TensorEntry& t);
SegmentInfo FromProto(const v1::SegmentDescriptor& s);
// Connects to `fd_socket`, claims `lease_id` ("CLAIM <id>") and receives the
// fds the daemon sends for it ("OK n" + "MORE"s) within `timeout_ms`; *conn
// is the connection that is the lease (or writer grant) from then on.
absl::Status ClaimLease(const std::string& fd_socket, const std::string& lease_id, int timeout_ms, ScopedFd* conn,
                        std::vector<ScopedFd>* fds);

// One channel to the daemon and its stubs.
struct ClientStubs {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Weightd::Stub> weightd;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;
};

// Reconnecting after a daemon restart. gRPC retries a failed connection
// with exponential backoff (up to 120 s by default) and fails calls fast
// with UNAVAILABLE meanwhile, so a client of a restarted daemon could keep
// failing for minutes. Here a call that finds the channel in
// TRANSIENT_FAILURE gets a new channel instead, which connects at once;
// backoff is also capped at 1 s. `impl_->stub->Method(...)` reads the
// current stubs through StubRef, a temporary that holds them (shared_ptr)
// until the end of the full expression: the whole unary call.
struct Client::Impl {
  template <typename StubT, std::unique_ptr<StubT> ClientStubs::*kMember>
  struct StubRef {
    std::shared_ptr<ClientStubs> stubs;
    StubT* operator->() const { return (stubs.get()->*kMember).get(); }
  };
  template <typename StubT, std::unique_ptr<StubT> ClientStubs::*kMember>
  struct StubProxy {
    Impl* impl;
    StubRef<StubT, kMember> operator->() const { return {impl->Current()}; }
  };

  std::string target;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  absl::Mutex mu;
  std::shared_ptr<ClientStubs> stubs ABSL_GUARDED_BY(mu);
  StubProxy<v1::Weightd::Stub, &ClientStubs::weightd> stub{this};
  StubProxy<grpc::health::v1::Health::Stub, &ClientStubs::health> health{this};

  std::shared_ptr<ClientStubs> Make() const {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);  // an Attach of 100,000+ tensors exceeds the 4 MiB default
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    auto s = std::make_shared<ClientStubs>();
    s->channel = grpc::CreateCustomChannel(target, credentials, args);
    s->weightd = v1::Weightd::NewStub(s->channel);
    s->health = grpc::health::v1::Health::NewStub(s->channel);
    return s;
  }
  // The stubs for the next call: a new channel when the current one is
  // waiting out a reconnect backoff.
  std::shared_ptr<ClientStubs> Current() {
    absl::MutexLock lock(&mu);
    if (stubs->channel->GetState(/*try_to_connect=*/false) == GRPC_CHANNEL_TRANSIENT_FAILURE) stubs = Make();
    return stubs;
  }
};

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_CLIENT_INTERNAL_H_
