// End-to-end reliability: a real weightd under a small descriptor limit, run
// out of descriptors by real connections, and flooded with stalled streams
// (docs/operations.md "Reliability").
#include <grpcpp/grpcpp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/transport/unix_socket.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "tests/testing/scrape.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

using testing::CommandResult;
using testing::DaemonProcess;

constexpr char kPrlimit[] = "/usr/bin/prlimit";

// Polls `condition` every 50 ms for up to `seconds`; true once it holds.
bool Eventually(const std::function<bool()>& condition, double seconds) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

// The value of line `key` ("Threads:", "Max open files") of a /proc file.
std::string ProcLine(pid_t pid, const std::string& file, const std::string& key) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/" + file);
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, key)) return std::string(absl::StripAsciiWhitespace(line.substr(key.size())));
  }
  return "";
}

ScopedFd ConnectStream(const std::string& path) {
  ScopedFd sock(socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  if (connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return ScopedFd();
  return sock;
}

TEST(Reliability, DaemonRaisesTheSoftDescriptorLimitToTheHardLimit) {
  if (access(kPrlimit, X_OK) != 0) GTEST_SKIP() << kPrlimit << " is absent (util-linux)";
  DaemonProcess d({}, {kPrlimit, "--nofile=64:512", "--"});
  ASSERT_EQ(d.Ctl({"ls"}).code, 0) << d.process().Stderr();
  std::vector<std::string> limits = absl::StrSplit(ProcLine(d.pid(), "limits", "Max open files"), ' ', absl::SkipEmpty());
  ASSERT_GE(limits.size(), 2u);
  EXPECT_EQ(limits[0], "512");  // soft, raised
  EXPECT_EQ(limits[1], "512");  // hard
  EXPECT_TRUE(absl::StrContains(d.process().Stderr(), "raised the open-file limit (RLIMIT_NOFILE) from 64 to 512"))
      << d.process().Stderr();
}

// Regression: gRPC's listener logged "Failed accept4: Too many open files"
// once and never accepted again, even after every connection had closed.
TEST(Reliability, ApiAnswersAgainAfterDescriptorsRunOut) {
  if (access(kPrlimit, X_OK) != 0) GTEST_SKIP() << kPrlimit << " is absent (util-linux)";
  // soft = hard, so raising the soft limit cannot hide the shortage.
  DaemonProcess d({}, {kPrlimit, "--nofile=96:96", "--"});
  ASSERT_EQ(d.Ctl({"ls"}).code, 0) << d.process().Stderr();
  std::vector<ScopedFd> connections;
  for (int i = 0; i < 400 && !absl::StrContains(d.process().Stderr(), "Too many open files"); ++i) {
    ScopedFd c = ConnectStream(d.socket());
    if (!c.valid()) break;  // the backlog is full
    connections.push_back(std::move(c));
    if (i % 20 == 19) std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let the daemon accept
  }
  bool exhausted = Eventually([&] { return absl::StrContains(d.process().Stderr(), "Too many open files"); }, 10);
  if (!exhausted) {
    GTEST_SKIP() << connections.size() << " connections did not exhaust a 96-descriptor limit here; daemon said:\n"
                 << d.process().Stderr();
  }
  connections.clear();
  auto released = std::chrono::steady_clock::now();
  bool answered = Eventually([&] { return d.Ctl({"ls", "--json"}).code == 0; }, 5);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - released).count();
  EXPECT_TRUE(answered) << "no answer 5 s after the descriptors were released; daemon said:\n" << d.process().Stderr();
  EXPECT_LT(seconds, 5);
  EXPECT_TRUE(absl::StrContains(d.process().Stderr(), "accepting again")) << d.process().Stderr();
}

TEST(Reliability, ConnectionsBeyondTheBoundAreClosedUntilSomeEnd) {
  DaemonProcess d({"--grpc-max-connections", "4", "--self-check-interval-seconds", "0.2"});
  std::vector<ScopedFd> held;
  for (int i = 0; i < 4; ++i) held.push_back(ConnectStream(d.socket()));
  ASSERT_TRUE(Eventually([&] { return d.Ctl({"ls"}).code != 0; }, 5)) << "a fifth connection was served";
  EXPECT_TRUE(absl::StrContains(d.process().Stderr(), "gRPC socket " + d.socket() +
                                                          ": 4 connections open (--grpc-max-connections); closing "
                                                          "new ones until some end"))
      << d.process().Stderr();
  std::this_thread::sleep_for(std::chrono::milliseconds(600));  // three self-checks
  EXPECT_FALSE(absl::StrContains(d.process().Stderr(), "self-check failed")) << "the daemon's own probe gets in";
  held.clear();
  EXPECT_TRUE(Eventually([&] { return d.Ctl({"ls"}).code == 0; }, 5)) << d.process().Stderr();
}

// Regression (review of issue 12): connections that never sent a byte held
// every slot of --grpc-max-connections forever.
TEST(Reliability, SilentConnectionsAreClosedAfterTheFirstBytesTimeout) {
  DaemonProcess d({"--grpc-max-connections", "3", "--grpc-first-bytes-timeout-seconds", "0.5"});
  std::vector<ScopedFd> silent;
  for (int i = 0; i < 3; ++i) silent.push_back(ConnectStream(d.socket()));
  // Still held open by this test; the daemon gives up on them.
  EXPECT_TRUE(Eventually([&] { return d.Ctl({"ls"}).code == 0; }, 5)) << d.process().Stderr();
  char byte;
  for (ScopedFd& s : silent) EXPECT_EQ(recv(s.get(), &byte, 1, 0), 0) << "the daemon closed it";
}

// Opens TCP connections to `port` until the daemon logs `sign` or 400 are open.
std::vector<ScopedFd> ExhaustWithTcp(DaemonProcess& d, int port, const std::string& sign) {
  std::vector<ScopedFd> connections;
  for (int i = 0; i < 400 && !absl::StrContains(d.process().Stderr(), sign); ++i) {
    ScopedFd c = testing::ConnectLoopback(port);
    if (!c.valid()) break;
    connections.push_back(std::move(c));
    if (i % 20 == 19) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return connections;
}

// Regression (review of issue 12): the plain-TCP listener was gRPC's own,
// which never accepts again after EMFILE, and had no connection bound.
TEST(Reliability, PlainTcpListenerAnswersAgainAfterDescriptorsRunOut) {
  if (access(kPrlimit, X_OK) != 0) GTEST_SKIP() << kPrlimit << " is absent (util-linux)";
  DaemonProcess d({"--grpc-address", "127.0.0.1:0"}, {kPrlimit, "--nofile=96:96", "--"});
  int port = d.TcpListenerPort();
  ASSERT_GT(port, 0) << d.process().Stderr();
  std::string tcp = absl::StrCat("127.0.0.1:", port);
  std::vector<ScopedFd> connections = ExhaustWithTcp(d, port, "Too many open files");
  if (!Eventually([&] { return absl::StrContains(d.process().Stderr(), "Too many open files"); }, 10)) {
    GTEST_SKIP() << connections.size() << " connections did not exhaust a 96-descriptor limit here";
  }
  connections.clear();
  auto ls = [&] { return testing::RunCommand({testing::WeightctlBinary(), "--socket", tcp, "ls"}).code == 0; };
  EXPECT_TRUE(Eventually(ls, 5)) << "the TCP listener stayed dead; daemon said:\n" << d.process().Stderr();
  EXPECT_TRUE(absl::StrContains(d.process().Stderr(), "gRPC TCP listener 127.0.0.1:0: accepting again"))
      << d.process().Stderr();
}

int Threads(pid_t pid) {
  int n = 0;
  return absl::SimpleAtoi(ProcLine(pid, "status", "Threads:"), &n) ? n : -1;
}

// GetManifest calls whose client never reads: each handler blocks in Write
// once the flow-control window is full, holding a server thread.
class StalledStreams {
 public:
  StalledStreams(const std::string& socket, int connections, int streams_per_connection) {
    for (int c = 0; c < connections; ++c) {
      grpc::ChannelArguments args;
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // one connection per channel
      auto stub = v1::Weightd::NewStub(grpc::CreateCustomChannel("unix:" + socket, grpc::InsecureChannelCredentials(), args));
      for (int s = 0; s < streams_per_connection; ++s) {
        v1::GetManifestRequest request;
        request.set_name("many");
        request.set_page_size(1);
        contexts_.push_back(std::make_unique<grpc::ClientContext>());
        readers_.push_back(stub->GetManifest(contexts_.back().get(), request));
      }
      stubs_.push_back(std::move(stub));
    }
  }
  ~StalledStreams() {
    for (auto& context : contexts_) context->TryCancel();
    for (auto& reader : readers_) (void)reader->Finish();
  }

 private:
  std::vector<std::unique_ptr<v1::Weightd::Stub>> stubs_;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_;
  std::vector<std::unique_ptr<grpc::ClientReader<v1::ManifestPage>>> readers_;
};

// Regression: 300 stalled streams pinned 313 threads. The defaults bound
// sync-server threads to 64 (--grpc-max-threads) and streams to 16 per
// connection (--grpc-max-streams-per-connection).
TEST(Reliability, StalledStreamsHoldAtMostTheThreadBound) {
  DaemonProcess d;
  testing::SafetensorsBuilder builder;
  for (int i = 0; i < 4000; ++i) {
    builder.Add(absl::StrCat("model.layers.", i, ".self_attn.q_proj.weight_with_a_long_name"), "F32", {1},
                std::string(4, 'x'));
  }
  testing::WriteFile(d.models_dir() + "/many.safetensors", builder.Build());
  ASSERT_EQ(d.Ctl({"load", "many", "many.safetensors"}).code, 0);
  int before = Threads(d.pid());
  {
    StalledStreams stalled(d.socket(), 8, 16);  // 128 streams
    std::this_thread::sleep_for(std::chrono::seconds(3));
    int during = Threads(d.pid());
    EXPECT_GE(during, before + 32) << "the streams did not stall, so the test proves nothing";
    EXPECT_LE(during, before + 64 + 4) << "threads before: " << before;
    CommandResult health = d.Ctl({"health"});
    EXPECT_EQ(health.out, "SERVING\n") << health.err;
  }
  EXPECT_TRUE(Eventually([&] { return d.Ctl({"ls"}).code == 0; }, 10)) << d.process().Stderr();
}

}  // namespace
}  // namespace weightd
