// The fd channel's protocol against a real daemon, speaking the raw gRPC API
// and the raw SEQPACKET messages (server/listen/fd_channel.h).
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <thread>

#include "absl/strings/match.h"
#include "common/transport/unix_socket.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

using testing::DaemonProcess;

class FdChannelE2E : public ::testing::Test {
 protected:
  explicit FdChannelE2E(std::vector<std::string> args = {}) : d_(std::move(args)) {
    EXPECT_EQ(testing::RunCommand({testing::WeightctlBinary(), "make-demo", d_.models_dir() + "/tiny"}).code, 0);
    EXPECT_EQ(d_.Ctl({"load", "tiny", "tiny"}).code, 0);
    stub_ = v1::Weightd::NewStub(grpc::CreateChannel("unix://" + d_.socket(), grpc::InsecureChannelCredentials()));
  }

  v1::AttachResponse Attach() {
    v1::AttachRequest request;
    request.set_name("tiny");
    v1::AttachResponse response;
    grpc::ClientContext context;
    grpc::Status status = stub_->Attach(&context, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response;
  }

  // Sends CLAIM on a new connection; returns the reply and keeps the connection in `conn`.
  std::string Claim(const std::string& fd_socket, const std::string& lease, ScopedFd* conn, size_t* fds_received) {
    absl::StatusOr<ScopedFd> c = ConnectSeqpacket(fd_socket);
    EXPECT_TRUE(c.ok()) << c.status();
    *conn = std::move(*c);
    EXPECT_TRUE(SendMessage(conn->get(), "CLAIM " + lease, {}).ok());
    std::vector<ScopedFd> fds;
    absl::StatusOr<std::string> reply = ReceiveMessage(conn->get(), &fds, 5000);
    *fds_received = fds.size();
    return reply.ok() ? *reply : std::string(reply.status().message());
  }

  int Leases() {
    auto ls = nlohmann::json::parse(d_.Ctl({"ls", "--json"}).out);
    return ls["models"].empty() ? -1 : ls["models"][0]["leases"].get<int>();
  }

  DaemonProcess d_;
  std::unique_ptr<v1::Weightd::Stub> stub_;
};

TEST_F(FdChannelE2E, ClaimSendsOneFdPerSegmentAndASecondClaimIsRefused) {
  v1::AttachResponse attach = Attach();
  EXPECT_EQ(attach.fd_socket(), d_.dir().Join("w.fd.sock"));
  EXPECT_EQ(attach.lease_id().size(), 32u);
  EXPECT_EQ(attach.claim_timeout_seconds(), 10.0);
  ScopedFd first, second;
  size_t fds = 0;
  EXPECT_EQ(Claim(attach.fd_socket(), attach.lease_id(), &first, &fds), "OK 2");  // two files: two host segments
  EXPECT_EQ(fds, 2u);
  EXPECT_EQ(Claim(attach.fd_socket(), attach.lease_id(), &second, &fds),
            "ERR 9 lease already claimed on another connection");
  EXPECT_EQ(fds, 0u);
  EXPECT_EQ(Leases(), 1);
  first.Reset();  // closing the connection ends the lease
  for (int i = 0; i < 100 && Leases() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(Leases(), 0);
}

TEST_F(FdChannelE2E, UnknownLeaseAndGarbageAreRefused) {
  ScopedFd conn;
  size_t fds = 0;
  std::string fd_socket = d_.dir().Join("w.fd.sock");
  EXPECT_EQ(Claim(fd_socket, "0123456789abcdef0123456789abcdef", &conn, &fds), "ERR 5 unknown or expired lease id");
  absl::StatusOr<ScopedFd> raw = ConnectSeqpacket(fd_socket);
  ASSERT_TRUE(raw.ok());
  ASSERT_TRUE(SendMessage(raw->get(), "HELLO", {}).ok());
  absl::StatusOr<std::string> reply = ReceiveMessage(raw->get(), nullptr, 5000);
  ASSERT_TRUE(reply.ok());
  EXPECT_EQ(*reply, "ERR 3 expected 'CLAIM <lease_id>'");
  v1::DetachRequest detach;
  detach.set_lease_id("nope");
  v1::DetachResponse response;
  grpc::ClientContext context;
  grpc::Status status = stub_->Detach(&context, detach, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "unknown or expired lease id");
}

TEST_F(FdChannelE2E, DetachEndsAClaimedLease) {
  v1::AttachResponse attach = Attach();
  ScopedFd conn;
  size_t fds = 0;
  ASSERT_EQ(Claim(attach.fd_socket(), attach.lease_id(), &conn, &fds), "OK 2");
  v1::DetachRequest detach;
  detach.set_lease_id(attach.lease_id());
  v1::DetachResponse response;
  grpc::ClientContext context;
  ASSERT_TRUE(stub_->Detach(&context, detach, &response).ok());
  EXPECT_EQ(Leases(), 0);
  // The daemon closes the connection of a detached lease.
  absl::StatusOr<std::string> eof = ReceiveMessage(conn.get(), nullptr, 2000);
  EXPECT_EQ(eof.status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(FdChannelE2E, SocketsAreGroupReadableOnly) {
  struct stat st;
  ASSERT_EQ(stat(d_.socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  ASSERT_EQ(stat(d_.dir().Join("w.fd.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
}

class ShortClaimTimeout : public FdChannelE2E {
 protected:
  ShortClaimTimeout() : FdChannelE2E({"--lease-claim-timeout-seconds", "0.3"}) {}
};

TEST_F(ShortClaimTimeout, UnclaimedLeaseExpires) {
  v1::AttachResponse attach = Attach();
  EXPECT_EQ(attach.claim_timeout_seconds(), 0.3);
  EXPECT_EQ(Leases(), 1);
  for (int i = 0; i < 300 && Leases() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(Leases(), 0);
  ScopedFd conn;
  size_t fds = 0;
  EXPECT_EQ(Claim(attach.fd_socket(), attach.lease_id(), &conn, &fds), "ERR 5 unknown or expired lease id");
}

class OneFdConnection : public FdChannelE2E {
 protected:
  OneFdConnection() : FdChannelE2E({"--fd-socket-max-connections", "1"}) {}
};

// Regression: a refused connection was closed before the daemon read the
// client's CLAIM, so a CLAIM sent after the refusal failed with EPIPE and one
// sent before it made the reply read fail with ECONNRESET.
TEST_F(OneFdConnection, RefusedClientReadsTheReasonThenEndOfFile) {
  std::string fd_socket = d_.dir().Join("w.fd.sock");
  absl::StatusOr<ScopedFd> held = ConnectSeqpacket(fd_socket);  // the one connection allowed
  ASSERT_TRUE(held.ok()) << held.status();
  for (int delay_ms : {0, 200}) {  // CLAIM before and after the daemon has refused
    absl::StatusOr<ScopedFd> refused = ConnectSeqpacket(fd_socket);
    ASSERT_TRUE(refused.ok()) << refused.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    EXPECT_TRUE(SendMessage(refused->get(), "CLAIM 0123456789abcdef0123456789abcdef", {}).ok()) << delay_ms;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    absl::StatusOr<std::string> reply = ReceiveMessage(refused->get(), nullptr, 5000);
    EXPECT_EQ(reply.value_or(std::string(reply.status().message())), "ERR 8 too many fd-socket connections (1)");
    absl::StatusOr<std::string> eof = ReceiveMessage(refused->get(), nullptr, 5000);
    EXPECT_EQ(eof.status(), absl::UnavailableError("fd socket closed by peer")) << delay_ms;
  }
}

}  // namespace
}  // namespace weightd
