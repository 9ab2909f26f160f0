// The weightctl binary against a real daemon: WEIGHTD_SOCKET names the
// daemon when --socket is not given, and --socket wins over it, before or
// after the command.
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"

namespace weightd {
namespace {

using testing::CommandResult;

// weightctl with WEIGHTD_SOCKET=<socket> in its environment.
CommandResult CtlWithEnv(const std::string& socket, std::vector<std::string> args) {
  std::vector<std::string> argv = {"/usr/bin/env", "WEIGHTD_SOCKET=" + socket, testing::WeightctlBinary()};
  argv.insert(argv.end(), args.begin(), args.end());
  return testing::RunCommand(argv);
}

TEST(WeightctlE2E, SocketFromTheEnvironment) {
  testing::DaemonProcess d;
  CommandResult r = CtlWithEnv(d.socket(), {"ls", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  nlohmann::json listed_r = nlohmann::json::parse(r.out);
  EXPECT_EQ(listed_r["models"], nlohmann::json::array());
  EXPECT_EQ(listed_r["daemon_instance"].get<std::string>().size(), 16u) << r.out;  // 64 random bits, hex
}

TEST(WeightctlE2E, SocketFlagWinsOverTheEnvironment) {
  testing::DaemonProcess d;
  std::string nowhere = d.dir().Join("nowhere.sock");
  EXPECT_EQ(CtlWithEnv(nowhere, {"--socket", d.socket(), "ls"}).code, 0);
  EXPECT_EQ(CtlWithEnv(nowhere, {"ls", "--socket", d.socket()}).code, 0);
  CommandResult r = CtlWithEnv(d.socket(), {"ls", "--socket=" + nowhere});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find(nowhere + ": No such file or directory"), std::string::npos) << r.err;
}

// A relative socket path is a path, not a DNS name: "DIR/w.sock" and
// "w.sock" (no ':') reach the daemon from the directory they are relative
// to, and a missing one says so. Before, both were resolved as host names
// and failed with a DNS error.
TEST(WeightctlE2E, ARelativeSocketPathIsAPath) {
  testing::DaemonProcess d;
  std::string dir = d.dir().path();
  std::string parent = dir.substr(0, dir.rfind('/'));
  std::string base = dir.substr(dir.rfind('/') + 1);
  auto ctl_in = [](const std::string& cwd, const std::string& socket) {
    return testing::RunCommand({"/bin/sh", "-c", "cd \"$1\" && exec \"$2\" --socket \"$3\" ls --json", "sh", cwd,
                                testing::WeightctlBinary(), socket});
  };
  CommandResult nested = ctl_in(parent, base + "/w.sock");
  EXPECT_EQ(nested.code, 0) << nested.err;
  nlohmann::json listed_nested = nlohmann::json::parse(nested.out);
  EXPECT_EQ(listed_nested["models"], nlohmann::json::array());
  EXPECT_EQ(listed_nested["daemon_instance"].get<std::string>().size(), 16u) << nested.out;  // 64 random bits, hex
  CommandResult here = ctl_in(dir, "w.sock");
  EXPECT_EQ(here.code, 0) << here.err;
  CommandResult missing = ctl_in(dir, "nosuch.sock");
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.err.find(dir + "/nosuch.sock: No such file or directory"), std::string::npos) << missing.err;
  CommandResult tcp = ctl_in(dir, "127.0.0.1:1");  // HOST:PORT stays a TCP target
  EXPECT_EQ(tcp.code, 1);
  EXPECT_NE(tcp.err.find("ipv4:127.0.0.1:1"), std::string::npos) << tcp.err;
}

}  // namespace
}  // namespace weightd
