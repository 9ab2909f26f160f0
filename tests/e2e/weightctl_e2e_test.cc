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
  EXPECT_EQ(nlohmann::json::parse(r.out), nlohmann::json({{"models", nlohmann::json::array()}}));
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

}  // namespace
}  // namespace weightd
