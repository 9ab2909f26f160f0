// weightctl inspect / make-demo run in-process: exit codes, one-line errors,
// JSON keys of DESIGN.md.
#include <algorithm>
#include <fstream>
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
  EXPECT_EQ(r.err, "weightctl: unknown demo preset 'huge' (use tiny, small or llama-1b)\n");
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
}  // namespace weightd::cli
