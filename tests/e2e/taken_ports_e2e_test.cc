// End-to-end: a second daemon started on a port another weightd already
// listens on refuses to start, for every kind of TCP listener, with the line
// docs/operations.md gives; the first keeps answering alone. Before, gRPC's
// own listeners (the health port, a TLS --grpc-address, a TLS peer port) set
// SO_REUSEPORT, so the second daemon started and the kernel spread
// connections between the two: Kubernetes probes got either daemon's answer.
// Real weightd and weightctl processes on loopback port 0.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/pki.h"
#include "tests/testing/process.h"

namespace weightd {
namespace {

using testing::CommandResult;
using testing::DaemonProcess;
using testing::TempDir;

struct ListenerKind {
  std::string name;          // for the test's name
  std::string flag;          // the address flag
  std::string logged;        // the daemon's "... on 127.0.0.1:PORT" prefix
  std::string refusal;       // the start error, followed by " 127.0.0.1:PORT"
  std::string tls;           // "" plain; "grpc" or "peer": the TLS flags of that port
};

void PrintTo(const ListenerKind& kind, std::ostream* os) { *os << kind.name; }

std::vector<std::string> TlsFlags(const std::string& kind, const TempDir& pki) {
  if (kind == "grpc") {
    return {"--grpc-tls-cert", pki.Join("server.pem"), "--grpc-tls-key", pki.Join("server.key")};
  }
  if (kind == "peer") {
    return {"--peer-tls-cert", pki.Join("node-a.pem"), "--peer-tls-key", pki.Join("node-a.key"), "--peer-tls-ca",
            pki.Join("ca.pem")};
  }
  return {};
}

class TakenPort : public ::testing::TestWithParam<ListenerKind> {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);  // the peer transport's helpers, inherited by the daemons
    setenv("UCX_NET_DEVICES", "lo", 1);
  }
};

TEST_P(TakenPort, ASecondDaemonRefusesToStartAndTheFirstAnswersAlone) {
  const ListenerKind& kind = GetParam();
  TempDir pki;
  if (!kind.tls.empty()) {
    if (access(testing::kOpenssl, X_OK) != 0) GTEST_SKIP() << testing::kOpenssl << " is absent: apt-get install openssl";
    std::string log;
    ASSERT_TRUE(testing::MakeCertificates(pki, &log)) << log;
  }
  auto args = [&](const std::string& address) {
    std::vector<std::string> a = {kind.flag, address, "--device-backend", "emulated", "--mlock", "false"};
    std::vector<std::string> tls = TlsFlags(kind.tls, pki);
    a.insert(a.end(), tls.begin(), tls.end());
    return a;
  };
  DaemonProcess first(args("127.0.0.1:0"));
  ASSERT_TRUE(first.process().Running()) << first.process().Stderr();
  int port = first.LoggedPort(kind.logged);
  ASSERT_GT(port, 0) << first.process().Stderr();
  std::string taken = absl::StrCat("127.0.0.1:", port);

  // Its Unix socket may answer for a moment before the TCP listeners start:
  // the refusal is the exit within 10 s.
  DaemonProcess second(args(taken));
  testing::WaitFor([&] { return !second.process().Running(); }, std::chrono::seconds(10));
  bool started = second.process().Running();
  if (started) second.process().Signal(SIGKILL);
  ASSERT_FALSE(started) << "a second daemon started on the taken port " << taken << ":\n" << second.process().Stderr();
  EXPECT_EQ(second.process().Wait(), 1) << second.process().Stderr();
  EXPECT_NE(second.process().Stderr().find(absl::StrCat(kind.refusal, " ", taken)), std::string::npos)
      << second.process().Stderr();
  EXPECT_EQ(second.process().Stderr().find(kind.logged + taken), std::string::npos) << second.process().Stderr();

  EXPECT_TRUE(first.process().Running());
  EXPECT_EQ(first.Ctl({"ls"}).code, 0);
  if (kind.flag == "--health-address") {
    // Every probe reaches the first daemon: the daemon's own service is SERVING.
    for (int i = 0; i < 6; ++i) {
      CommandResult health = testing::RunCommand({testing::WeightctlBinary(), "--socket", taken, "health"});
      EXPECT_EQ(health.code, 0) << health.out << health.err;
      EXPECT_NE(health.out.find("SERVING"), std::string::npos) << health.out;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    EveryListener, TakenPort,
    ::testing::Values(
        ListenerKind{"Metrics", "--metrics-address", "metrics on http://", "cannot serve metrics on --metrics-address",
                     ""},
        ListenerKind{"HealthPort", "--health-address", "health service on ", "cannot listen on --health-address", ""},
        ListenerKind{"GrpcPlainTcp", "--grpc-address", "gRPC TCP listener on ", "cannot listen on --grpc-address", ""},
        ListenerKind{"GrpcTls", "--grpc-address", "gRPC TCP listener on ", "cannot listen on --grpc-address", "grpc"},
        ListenerKind{"PeerPlainTcp", "--peer-address", "peer listener on ", "cannot listen on --peer-address", ""},
        ListenerKind{"PeerMutualTls", "--peer-address", "peer listener on ", "cannot listen on --peer-address",
                     "peer"}),
    [](const ::testing::TestParamInfo<ListenerKind>& info) { return info.param.name; });

}  // namespace
}  // namespace weightd
