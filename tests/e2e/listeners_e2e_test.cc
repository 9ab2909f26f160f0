// End-to-end: who may do what on the TCP gRPC listener (--grpc-address).
// Plain TCP is read-only; admin methods over TCP need mutual TLS, and the
// daemon refuses to start with an admin-capable TCP listener without it.
// A real weightd and real weightctl processes, on loopback port 0.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "common/base/scoped_fd.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/pki.h"
#include "tests/testing/process.h"
#include "tests/testing/scrape.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::DaemonProcess;
using testing::TempDir;
using testing::kOpenssl;
using testing::MakeCertificates;

constexpr char kAdminRefusal[] = "needs the Unix socket or a TCP listener with mutual TLS";

void WriteCheckpoint(const std::string& path) {
  testing::SafetensorsBuilder builder;
  builder.Add("a.weight", "F32", {4, 4}, std::string(64, 'a')).Add("b.bias", "F32", {4}, std::string(16, 'b'));
  testing::WriteFile(path, builder.Build());
}

// weightctl against `target` with extra global options (TLS files).
CommandResult CtlAt(const std::string& target, const std::vector<std::string>& options,
                    const std::vector<std::string>& args) {
  std::vector<std::string> argv = {testing::WeightctlBinary(), "--socket", target};
  argv.insert(argv.end(), options.begin(), options.end());
  argv.insert(argv.end(), args.begin(), args.end());
  return testing::RunCommand(argv);
}

std::vector<std::string> ModelStates(const std::string& ls_json) {
  std::vector<std::string> out;
  const json ls = json::parse(ls_json);
  for (const json& m : ls["models"]) out.push_back(m["name"].get<std::string>() + "=" + m["state"].get<std::string>());
  return out;
}

std::vector<std::string> DaemonArgs(std::vector<std::string> extra) {
  std::vector<std::string> args = {"--grpc-address", "127.0.0.1:0", "--device-backend", "emulated", "--mlock", "false"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// Issue 12 item 5: a uid the Unix socket refuses could load, list and
// force-unload another tenant's model over plain TCP.
TEST(TcpListener, PlainTcpServesReadsAndRefusesEveryAdminMethod) {
  DaemonProcess d(DaemonArgs({}));
  WriteCheckpoint(d.models_dir() + "/m.safetensors");
  ASSERT_EQ(d.Ctl({"load", "m", "m.safetensors"}).code, 0);
  int port = d.TcpListenerPort();
  ASSERT_GT(port, 0) << d.process().Stderr();
  std::string tcp = absl::StrCat("127.0.0.1:", port);

  CommandResult ls = CtlAt(tcp, {}, {"ls", "--json"});
  ASSERT_EQ(ls.code, 0) << ls.err;
  EXPECT_EQ(ModelStates(ls.out), std::vector<std::string>{"m=READY"});
  CommandResult manifest = CtlAt(tcp, {}, {"manifest", "m", "--json"});
  ASSERT_EQ(manifest.code, 0) << manifest.err;
  EXPECT_EQ(json::parse(manifest.out)["tensors"].size(), 2u);
  CommandResult health = CtlAt(tcp, {}, {"health", "m"});
  EXPECT_EQ(health.out, "SERVING\n") << health.err;

  for (const std::vector<std::string>& admin : std::vector<std::vector<std::string>>{
           {"load", "m2", "m.safetensors"}, {"unload", "m", "--force"}, {"unload", "m"}, {"attach", "m"}}) {
    CommandResult r = CtlAt(tcp, {}, admin);
    EXPECT_EQ(r.code, 2) << admin[0] << ": " << r.out << r.err;
    EXPECT_TRUE(absl::StrContains(r.err, kAdminRefusal)) << admin[0] << ": " << r.err;
  }
  // Detach has no weightctl command: a stub, with a lease id that looks real.
  auto stub = v1::Weightd::NewStub(grpc::CreateChannel(tcp, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  v1::DetachRequest detach;
  detach.set_lease_id(std::string(32, 'a'));
  v1::DetachResponse detached;
  grpc::Status s = stub->Detach(&context, detach, &detached);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(absl::StrContains(s.error_message(), kAdminRefusal)) << s.error_message();
  // Nothing changed: the model is still READY, unleased, and m2 was never loaded.
  CommandResult after = d.Ctl({"ls", "--json"});
  ASSERT_EQ(after.code, 0) << after.err;
  EXPECT_EQ(ModelStates(after.out), std::vector<std::string>{"m=READY"});
  EXPECT_EQ(json::parse(after.out)["models"][0]["leases"], 0);
}

TEST(TcpListener, AdminOnTcpWithoutMutualTlsRefusesToStart) {
  TempDir dir;
  CommandResult r = testing::RunCommand({testing::WeightdBinary(), "--socket", dir.Join("w.sock"), "--metrics-address",
                                         "", "--grpc-address", "127.0.0.1:0", "--grpc-tcp-admin", "true"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "weightd: --grpc-tcp-admin needs mutual TLS on --grpc-address: set --grpc-tls-cert, --grpc-tls-key and "
            "--grpc-tls-client-ca\n");
  EXPECT_NE(access(dir.Join("w.sock").c_str(), F_OK), 0);  // it never listened
}

TEST(TcpListener, MutualTlsAdmitsAdminOnlyWithAClientCertificateOfTheConfiguredCa) {
  if (access(kOpenssl, X_OK) != 0) GTEST_SKIP() << kOpenssl << " is absent: apt-get install openssl";
  TempDir pki;
  std::string log;
  ASSERT_TRUE(MakeCertificates(pki, &log)) << log;
  DaemonProcess d(DaemonArgs({"--grpc-tls-cert", pki.Join("server.pem"), "--grpc-tls-key", pki.Join("server.key"),
                              "--grpc-tls-client-ca", pki.Join("ca.pem"), "--grpc-tcp-admin", "true"}));
  WriteCheckpoint(d.models_dir() + "/m.safetensors");
  int port = d.TcpListenerPort();
  ASSERT_GT(port, 0) << d.process().Stderr();
  std::string tcp = absl::StrCat("127.0.0.1:", port);
  std::vector<std::string> client = {"--tls-ca", pki.Join("ca.pem"), "--tls-cert", pki.Join("client.pem"),
                                     "--tls-key", pki.Join("client.key")};

  // Refused at the handshake: no TLS, TLS without a certificate, a certificate of another CA.
  for (const std::vector<std::string>& refused : std::vector<std::vector<std::string>>{
           {},
           {"--tls-ca", pki.Join("ca.pem")},
           {"--tls-ca", pki.Join("ca.pem"), "--tls-cert", pki.Join("rogue.pem"), "--tls-key", pki.Join("rogue.key")}}) {
    CommandResult r = CtlAt(tcp, refused, {"ls"});
    EXPECT_EQ(r.code, 1) << ::testing::PrintToString(refused) << ": " << r.out << r.err;
    EXPECT_EQ(r.out, "");
  }
  CommandResult load = CtlAt(tcp, client, {"load", "m", "m.safetensors", "--json"});
  ASSERT_EQ(load.code, 0) << load.err;
  EXPECT_EQ(json::parse(load.out)["state"], "READY");
  CommandResult ls = CtlAt(tcp, client, {"ls", "--json"});
  ASSERT_EQ(ls.code, 0) << ls.err;
  EXPECT_EQ(ModelStates(ls.out), std::vector<std::string>{"m=READY"});
  CommandResult unload = CtlAt(tcp, client, {"unload", "m", "--force"});
  EXPECT_EQ(unload.code, 0) << unload.err;
  EXPECT_EQ(ModelStates(d.Ctl({"ls", "--json"}).out), std::vector<std::string>{});
}

TEST(TcpListener, MutualTlsWithoutAdminIsStillReadOnly) {
  if (access(kOpenssl, X_OK) != 0) GTEST_SKIP() << kOpenssl << " is absent: apt-get install openssl";
  TempDir pki;
  std::string log;
  ASSERT_TRUE(MakeCertificates(pki, &log)) << log;
  DaemonProcess d(DaemonArgs({"--grpc-tls-cert", pki.Join("server.pem"), "--grpc-tls-key", pki.Join("server.key"),
                              "--grpc-tls-client-ca", pki.Join("ca.pem")}));
  WriteCheckpoint(d.models_dir() + "/m.safetensors");
  std::string tcp = absl::StrCat("127.0.0.1:", d.TcpListenerPort());
  std::vector<std::string> client = {"--tls-ca", pki.Join("ca.pem"), "--tls-cert", pki.Join("client.pem"),
                                     "--tls-key", pki.Join("client.key")};
  CommandResult ls = CtlAt(tcp, client, {"ls", "--json"});
  EXPECT_EQ(ls.code, 0) << ls.err;
  CommandResult load = CtlAt(tcp, client, {"load", "m", "m.safetensors"});
  EXPECT_EQ(load.code, 2) << load.err;
  EXPECT_TRUE(absl::StrContains(load.err, kAdminRefusal)) << load.err;
}

// The watchdog self-check probes a TLS listener by connecting only: a
// health probe without the clients' certificate would fail its handshake
// and withhold WATCHDOG=1 forever, restarting a healthy daemon in a loop.
TEST(TcpListener, SelfCheckPassesWithAMutualTlsListener) {
  if (access(kOpenssl, X_OK) != 0) GTEST_SKIP() << kOpenssl << " is absent: apt-get install openssl";
  TempDir pki;
  std::string log;
  ASSERT_TRUE(MakeCertificates(pki, &log)) << log;
  DaemonProcess d(DaemonArgs({"--grpc-tls-cert", pki.Join("server.pem"), "--grpc-tls-key", pki.Join("server.key"),
                              "--grpc-tls-client-ca", pki.Join("ca.pem"), "--self-check-interval-seconds", "0.1"}));
  ASSERT_GT(d.TcpListenerPort(), 0) << d.process().Stderr();
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // several checks
  EXPECT_EQ(d.Stop(), 0);
  EXPECT_FALSE(absl::StrContains(d.process().Stderr(), "self-check failed")) << d.process().Stderr();
}

// Regression (review of issue 12): gRPC's own TLS listener stops accepting
// for good after one EMFILE, and the self-check, which only connected, kept
// passing (the kernel completes a connect from the accept queue).
TEST(TcpListener, AWedgedTlsListenerFailsTheSelfCheck) {
  if (access(kOpenssl, X_OK) != 0) GTEST_SKIP() << kOpenssl << " is absent: apt-get install openssl";
  if (access("/usr/bin/prlimit", X_OK) != 0) GTEST_SKIP() << "/usr/bin/prlimit is absent (util-linux)";
  TempDir pki;
  std::string log;
  ASSERT_TRUE(MakeCertificates(pki, &log)) << log;
  DaemonProcess d(DaemonArgs({"--grpc-tls-cert", pki.Join("server.pem"), "--grpc-tls-key", pki.Join("server.key"),
                              "--self-check-interval-seconds", "0.2"}),
                  {"/usr/bin/prlimit", "--nofile=96:96", "--"});
  int port = d.TcpListenerPort();
  ASSERT_GT(port, 0) << d.process().Stderr();
  std::vector<ScopedFd> held;
  for (int i = 0; i < 300 && !absl::StrContains(d.process().Stderr(), "Too many open files"); ++i) {
    ScopedFd sock = testing::ConnectLoopback(port);
    if (!sock.valid()) break;
    held.push_back(std::move(sock));
    if (i % 20 == 19) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  if (!absl::StrContains(d.process().Stderr(), "Too many open files")) {
    GTEST_SKIP() << held.size() << " connections did not exhaust a 96-descriptor limit here";
  }
  held.clear();
  std::string failed = absl::StrCat("self-check failed: TCP listener 127.0.0.1:", port, " does not accept");
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!absl::StrContains(d.process().Stderr(), failed) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(absl::StrContains(d.process().Stderr(), failed)) << d.process().Stderr();
}

}  // namespace
}  // namespace weightd
