// End-to-end device path on the emulated backend: a TP=2 plan over the demo
// checkpoint, ranks attached from separate processes and verified slice by
// slice, one host-resident table shared by both ranks.
#include <signal.h>

#include <fstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::Tp2Plan;
using testing::DaemonProcess;
using testing::Process;

// inode of the first mapping of memfd:weightd:<segment> in `pid`, or "".
std::string MappedInode(pid_t pid, const std::string& segment) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (!absl::StrContains(line, "/memfd:weightd:" + segment)) continue;
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
    return f[4];
  }
  return "";
}

class DeviceE2E : public ::testing::Test {
 protected:
  DeviceE2E() : d_({"--device-backend", "emulated"}) {
    path_ = d_.models_dir() + "/small";
    CommandResult r = testing::RunCommand({testing::WeightctlBinary(), "make-demo", path_, "--preset", "small"});
    EXPECT_EQ(r.code, 0) << r.err;
  }
  DaemonProcess d_;
  std::string path_;
};

TEST_F(DeviceE2E, BothRanksAttachFromSeparateProcessesAndVerifyEverySlice) {
  CommandResult load = d_.Ctl(Tp2Plan("llama", "small"));
  ASSERT_EQ(load.code, 0) << load.err;
  json loaded = json::parse(load.out);
  EXPECT_EQ(loaded["bytes"], 272656384);  // the checkpoint's tensor bytes, read once
  EXPECT_EQ(loaded["host_bytes"], 32000 * 1024 * 2);
  EXPECT_EQ(loaded["device_bytes"]["GPU-emulated-0"], loaded["device_bytes"]["GPU-emulated-1"]);
  Process r0(d_.CtlArgv({"attach", "llama", "--rank", "0", "--verify", path_, "--hold", "30"}), d_.dir().path());
  Process r1(d_.CtlArgv({"attach", "llama", "--rank", "1", "--verify", path_, "--hold", "30"}), d_.dir().path());
  for (int i = 0; i < 600 && !(absl::StrContains(r0.Stdout(), "verified") && absl::StrContains(r1.Stdout(), "verified")); ++i) {
    if (!r0.Running() || !r1.Running()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(absl::StrContains(r0.Stdout(), "verified 57 tensors, 201877504 bytes")) << r0.Stdout() << r0.Stderr();
  EXPECT_TRUE(absl::StrContains(r1.Stdout(), "verified 57 tensors, 201877504 bytes")) << r1.Stdout() << r1.Stderr();
  // The host-resident table is the same pages for both ranks; each rank maps its own arena.
  std::string host0 = MappedInode(r0.pid(), "llama:host"), host1 = MappedInode(r1.pid(), "llama:host");
  EXPECT_FALSE(host0.empty());
  EXPECT_EQ(host0, host1);
  EXPECT_NE(MappedInode(r0.pid(), "arena:GPU-emulated-0"), "");
  EXPECT_EQ(MappedInode(r0.pid(), "arena:GPU-emulated-1"), "");
  EXPECT_NE(MappedInode(r1.pid(), "arena:GPU-emulated-1"), "");
  r0.Signal(SIGKILL);
  r1.Signal(SIGKILL);
}

TEST_F(DeviceE2E, ManifestShowsShardShapesAndSplits) {
  ASSERT_EQ(d_.Ctl(Tp2Plan("llama", "small")).code, 0);
  CommandResult m = d_.Ctl({"manifest", "llama", "--rank", "1", "--json"});
  ASSERT_EQ(m.code, 0) << m.err;
  json doc = json::parse(m.out);
  EXPECT_EQ(doc["rank"], 1);
  int checked = 0;
  for (const json& t : doc["tensors"]) {
    if (t["name"] == "model.layers.0.self_attn.o_proj.weight") {
      EXPECT_EQ(t["shape"], json({1024, 512}));
      EXPECT_EQ(t["full_shape"], json({1024, 1024}));
      EXPECT_EQ(t["split_dim"], 1);
      EXPECT_EQ(t["split_start"], 512);
      EXPECT_EQ(t["placement"], "device");
      ++checked;
    }
    if (t["name"] == "model.embed_tokens.weight") {
      EXPECT_EQ(t["placement"], "host");
      EXPECT_EQ(t["split_dim"], -1);
      ++checked;
    }
    if (t["name"] == "model.norm.weight") {
      EXPECT_EQ(t["split_dim"], -1);
      EXPECT_EQ(t["placement"], "device");
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3);
  EXPECT_EQ(doc["segments"][1]["backend"], "emulated");
  EXPECT_EQ(doc["segments"][1]["gpu_uuid"], "GPU-emulated-1");
}

TEST_F(DeviceE2E, BadPlansAreRefusedBeforeAnyByteIsRead) {
  CommandResult r = d_.Ctl({"load", "x", "small", "--tp-size", "3", "--tp-rule", "q_proj:0", "--devices", "0,1,2"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err,
            "weightctl: tensor 'model.layers.0.self_attn.q_proj.weight' of shape [1024, 1024], TP rule 'q_proj:0' "
            "with tp_size 3: dim 0 of size 1024 is not divisible by 3\n");
  r = d_.Ctl({"load", "x", "small", "--tp-size", "2", "--tp-rule", "norm:1", "--devices", "0,1"});
  EXPECT_EQ(r.err,
            "weightctl: tensor 'model.layers.0.input_layernorm.weight' of shape [1024], TP rule 'norm:1' with "
            "tp_size 2: dim 1 is out of range for rank 1\n");
  r = d_.Ctl({"load", "x", "small", "--tp-size", "2", "--devices", "0"});
  EXPECT_EQ(r.err, "weightctl: the plan has tp_size 2 but 1 device(s); give one device per rank\n");
  r = d_.Ctl({"load", "x", "small", "--devices", "GPU-nope"});
  EXPECT_TRUE(absl::StartsWith(r.err, "weightctl: no device 'GPU-nope' on the emulated backend")) << r.err;
  r = d_.Ctl({"load", "x", "small", "--tp-rule", "q_proj"});
  EXPECT_EQ(r.err, "weightctl: --tp-rule must be PATTERN:DIM, got 'q_proj'\n");
  EXPECT_TRUE(json::parse(d_.Ctl({"ls", "--json"}).out)["models"].empty());
}

TEST(DeviceE2EHostOnly, DevicesOnAHostOnlyDaemonAreRefused) {
  DaemonProcess d({"--device-backend", "none"});
  ASSERT_EQ(testing::RunCommand({testing::WeightctlBinary(), "make-demo", d.models_dir() + "/t"}).code, 0);
  CommandResult r = d.Ctl({"load", "x", "t", "--devices", "0"});
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(absl::StrContains(r.err, "this daemon has no device backend")) << r.err;
}

}  // namespace
}  // namespace weightd
