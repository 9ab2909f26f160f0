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
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/unix_socket.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
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

}  // namespace
}  // namespace weightd
