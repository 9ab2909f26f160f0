// weightctl run in-process: its command line (--help, typed options, the
// socket's environment variable), exit codes, one-line errors, and the JSON
// keys of DESIGN.md for inspect and make-demo.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "client/cli/commands.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"

namespace weightd::cli {
namespace {

struct Result {
  int code;
  std::string out, err;
};

Result Weightctl(std::vector<std::string> argv) {
  std::ostringstream out, err;
  int code = RunWeightctl(argv, out, err);
  return {code, out.str(), err.str()};
}

TEST(WeightctlInspect, JsonHasDesignKeys) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("m.safetensors"), testing::SafetensorsBuilder()
                                                    .Add("w", "BF16", {2, 2}, std::string(8, '\0'))
                                                    .Add("s", "F8_E8M0", {4}, "abcd")
                                                    .Metadata("format", "pt")
                                                    .Build());
  Result r = Weightctl({"inspect", dir.Join("m.safetensors"), "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  nlohmann::json doc = nlohmann::json::parse(r.out);
  ASSERT_EQ(doc["tensors"].size(), 2u);
  EXPECT_EQ(doc["tensors"][0]["name"], "w");
  EXPECT_EQ(doc["tensors"][0]["dtype"], "BF16");
  EXPECT_EQ(doc["tensors"][0]["shape"], nlohmann::json({2, 2}));
  EXPECT_EQ(doc["tensors"][0]["nbytes"], 8);
  EXPECT_EQ(doc["tensors"][0]["file"], "m.safetensors");
  EXPECT_EQ(doc["tensors"][1]["dtype"], "F8_E8M0");
  EXPECT_EQ(doc["total_bytes"], 12);
  EXPECT_EQ(doc["metadata"]["m.safetensors"]["format"], "pt");
  EXPECT_EQ(doc["warnings"], nlohmann::json::array());
}

TEST(WeightctlInspect, TableListsTensorsAndTotalsByDtype) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("m.safetensors"),
                     testing::SafetensorsBuilder().Add("w", "F32", {3}, std::string(12, '\0')).Build());
  Result r = Weightctl({"inspect", dir.Join("m.safetensors")});
  ASSERT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("w "), std::string::npos);
  EXPECT_NE(r.out.find("F32                1 tensors             12 bytes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("total: 1 tensors in 1 file(s), 12 bytes"), std::string::npos);
}

TEST(WeightctlInspect, BadCheckpointExitsTwoWithOneLine) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("x.safetensors"), "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n");
  Result r = Weightctl({"inspect", dir.Join("x.safetensors"), "--json"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "weightctl: x.safetensors: git-LFS pointer, not a safetensors file (run `git lfs pull`)\n");
}

TEST(WeightctlInspect, EverySharedErrorCaseExitsTwo) {
  WEIGHTD_REQUIRE_SHARED(shared);
  std::ifstream f(shared + "/cases/cases.json");
  for (const auto& c : nlohmann::json::parse(f)) {
    Result r = Weightctl({"inspect", shared + "/cases/" + c["path"].get<std::string>(), "--json"});
    if (c["expect"] == "ok") {
      ASSERT_EQ(r.code, 0) << c["name"] << r.err;
      EXPECT_EQ(nlohmann::json::parse(r.out)["tensors"].size(), c["tensors"].get<size_t>());
    } else {
      EXPECT_EQ(r.code, 2) << c["name"];
      EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    }
  }
}

TEST(Weightctl, VersionAndHelpExitZero) {
  Result r = Weightctl({"--version"});
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out, std::string("weightctl ") + WEIGHTD_VERSION + "\n");
  EXPECT_EQ(r.err, "");
  r = Weightctl({"--help"});
  EXPECT_EQ(r.code, 0);
  EXPECT_EQ(r.out.rfind("usage: weightctl [--socket PATH] COMMAND [ARGS]", 0), 0u) << r.out;
}

TEST(Weightctl, UsageErrorsExitTwo) {
  EXPECT_EQ(Weightctl({}).code, 2);
  Result r = Weightctl({"frobnicate"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: unknown command 'frobnicate' (see weightctl --help)\n");
  r = Weightctl({"inspect", "a", "--bogus"});
  EXPECT_EQ(r.err, "weightctl: unknown option --bogus\n");
  r = Weightctl({"make-demo", "/tmp/x", "--preset", "huge"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: unknown demo preset 'huge' (use tiny, small, llama-1b or engram)\n");
}

TEST(Weightctl, EveryCommandHasHelpWithItsUsageLine) {
  for (const Command& command : Commands()) {
    for (std::vector<std::string> argv : {std::vector<std::string>{command.name, "--help"},
                                          {"--socket", "/nowhere.sock", command.name, "-h"}}) {
      Result r = Weightctl(argv);
      EXPECT_EQ(r.code, 0) << command.name << ": " << r.err;
      EXPECT_EQ(r.err, "") << command.name;
      EXPECT_EQ(r.out.rfind("usage: weightctl [--socket PATH] " + Usage(command) + "\n\n" + command.summary + "\n", 0), 0u)
          << r.out;
      EXPECT_NE(r.out.find("global options: --socket PATH|HOST:PORT (or $WEIGHTD_SOCKET)"), std::string::npos) << r.out;
    }
  }
}

TEST(Weightctl, TopLevelHelpListsEveryCommandsUsage) {
  Result r = Weightctl({"--help"});
  ASSERT_EQ(r.code, 0);
  for (const Command& command : Commands()) {
    EXPECT_NE(r.out.find("  " + Usage(command) + "\n      " + command.summary + "\n"), std::string::npos) << r.out;
  }
  EXPECT_NE(r.out.find("(Env:WEIGHTD_SOCKET)"), std::string::npos) << r.out;
}

TEST(Weightctl, UsageLinesFollowTheDesignContract) {
  std::map<std::string, std::string> usage;
  for (const Command& command : Commands()) usage[command.name] = Usage(command);
  // The contract's options in its order; --include/--exclude (a subset
  // load, issue "Engram host tables") and --peer are additions after it.
  EXPECT_EQ(usage["load"], "load NAME PATH [--host-resident PATTERN ...] [--tp-size N] [--tp-rule PATTERN:DIM ...] "
                           "[--devices LIST] [--include PATTERN ...] [--exclude PATTERN ...] [--numa-copies] "
                           "[--peer HOST:PORT ...] [--json]");
  EXPECT_EQ(usage["update"], "update NAME --from DIR [--version-label LABEL] [--json]");
  EXPECT_EQ(usage["ls"], "ls [--json]");
  EXPECT_EQ(usage["manifest"], "manifest NAME [--rank R] [--json]");
  EXPECT_EQ(usage["attach"],
            "attach NAME [--rank R] [--verify CHECKPOINT_DIR] [--hold SECONDS] [--prefault] [--numa-node N] "
            "[--layout KEY] [--identity K=V ...] [--verify-layout] [--json]");
  EXPECT_EQ(usage["layouts"], "layouts NAME [--json]");
  EXPECT_EQ(usage["drop-layout"], "drop-layout NAME KEY [--rank R]");
  EXPECT_EQ(usage["unload"], "unload NAME [--force]");
  EXPECT_EQ(usage["health"], "health [MODEL] [--json]");
  EXPECT_EQ(usage["inspect"], "inspect PATH [--json]");
  EXPECT_EQ(usage["make-demo"], "make-demo DIR [--preset tiny|small|llama-1b|engram]");
}

TEST(Weightctl, BadTypedValuesExitTwoWithOneLineBeforeConnecting) {
  Result r = Weightctl({"--socket", "/nowhere.sock", "manifest", "m", "--rank", "x"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "weightctl: --rank: must be an integer in [0, 1048576], got 'x'\n");
  r = Weightctl({"attach", "m", "--rank", "-1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: --rank: must be an integer in [0, 1048576], got '-1'\n");
  r = Weightctl({"attach", "m", "--hold", "soon"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: --hold: must be a number >= 0, got 'soon'\n");
  r = Weightctl({"load", "m", "p", "--tp-size", "0"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: --tp-size: must be an integer in [1, 1024], got '0'\n");
}

TEST(Weightctl, LayoutFlagsAreCheckedBeforeAnyRequest) {
  Result r = Weightctl({"--socket", "/nowhere.sock", "attach", "m", "--layout", "k", "--identity", "engine"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "weightctl: --identity must be KEY=VALUE, got 'engine'\n");
  r = Weightctl({"--socket", "/nowhere.sock", "attach", "m", "--layout", "k", "--identity", "a=1", "--identity", "a=2"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: --identity names 'a' twice\n");
  r = Weightctl({"--socket", "/nowhere.sock", "attach", "m", "--verify-layout"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: --identity and --verify-layout need --layout KEY\n");
  r = Weightctl({"--socket", "/nowhere.sock", "attach", "m", "--layout", "k", "--verify", "/ckpt"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: --verify compares checkpoint tensors; a layout's are checked with --verify-layout\n");
  r = Weightctl({"--socket", "/nowhere.sock", "drop-layout", "m", "k", "--rank", "x"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: --rank must be an integer in [0, 1048576], got 'x'\n");
  r = Weightctl({"--socket", "/nowhere.sock", "drop-layout", "m"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: KEY is required; usage: weightctl drop-layout NAME KEY [--rank R]\n");
}

TEST(Weightctl, MissingOrExtraPositionalsNameTheUsage) {
  Result r = Weightctl({"unload"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: NAME is required; usage: weightctl unload NAME [--force]\n");
  r = Weightctl({"health", "a", "b"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: unexpected argument 'b'; usage: weightctl health [MODEL] [--json]\n");
  r = Weightctl({"unload", "-x"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: unknown option -x\n");
  r = Weightctl({"--json", "ls"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: unknown option --json\n");
}

TEST(Weightctl, UpdateWithoutFromExitsTwoBeforeConnecting) {
  Result r = Weightctl({"--socket", "/nowhere.sock", "update", "m"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err,
            "weightctl: --from is required; usage: weightctl update NAME --from DIR [--version-label LABEL] [--json]\n");
}

TEST(Weightctl, SocketFlagWinsOverTheEnvironment) {
  testing::TempDir dir;
  ASSERT_EQ(setenv("WEIGHTD_SOCKET", dir.Join("env.sock").c_str(), 1), 0);
  Result from_env = Weightctl({"ls"});
  Result after = Weightctl({"ls", "--socket", dir.Join("flag.sock")});
  Result before = Weightctl({"--socket=" + dir.Join("flag.sock"), "ls"});
  unsetenv("WEIGHTD_SOCKET");
  EXPECT_EQ(from_env.code, 1);
  EXPECT_NE(from_env.err.find(dir.Join("env.sock") + ": No such file or directory"), std::string::npos) << from_env.err;
  for (const Result& r : {after, before}) {
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.err.find(dir.Join("flag.sock") + ": No such file or directory"), std::string::npos) << r.err;
  }
}

TEST(WeightctlMakeDemo, WritesTinyPresetThatInspects) {
  testing::TempDir dir;
  Result r = Weightctl({"make-demo", dir.Join("demo"), "--preset", "tiny"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("21 tensors, 7604736 bytes"), std::string::npos) << r.out;
  Result i = Weightctl({"inspect", dir.Join("demo"), "--json"});
  ASSERT_EQ(i.code, 0) << i.err;
  nlohmann::json doc = nlohmann::json::parse(i.out);
  EXPECT_EQ(doc["tensors"].size(), 21u);
  EXPECT_EQ(doc["total_bytes"], 7604736);
}

}  // namespace
TEST(Weightctl, AnArgumentThatIsNotUtf8IsRefusedNamingIt) {
  // Found by a new user: --include $'\xff\xfe' reached gRPC and came back as
  // an empty "weightctl: " line.
  Result r = Weightctl({"load", "x2", "/models/m", "--include", "\xff\xfe"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: argument 5 (\\xff\\xfe) is not valid UTF-8; names, paths and patterns must be\n");
  EXPECT_EQ(Weightctl({"load", "caf\xc3\xa9", "/models/m", "--socket", "/nonexistent/w.sock"}).err.find("UTF-8"),
            std::string::npos);  // valid UTF-8 passes on (and fails later, on the socket)
}

}  // namespace weightd::cli
