// The DeepSeek-V4.1-shaped demo (weightctl make-demo --preset engram) through
// a real daemon and real client processes: with --host-resident
// .engram.embed. and a TP=2 plan on the emulated GPUs exactly the FP8 row
// tables and F8_E8M0 scale tables stay on the host, every other tensor
// (the Engram file's non-table tensor too) lands on the devices, and every
// byte equals the files; with no pattern everything goes to the devices; a
// load without devices never touches the device path; files in the folder
// that are not safetensors shards are never opened.
#include <sys/stat.h>

#include <fstream>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::DaemonProcess;
using testing::Process;

constexpr int kTensors = 26;                            // the engram preset's
constexpr uint64_t kTableBytes = 2 * (4096 * 256 + 4096 * 8);  // two FP8 tables and their scales

std::vector<std::string> EngramPlan(const std::string& name, bool host_tables) {
  std::vector<std::string> args = {"load", name, "engram", "--tp-size", "2",
                                   "--tp-rule", "q_proj:0", "--tp-rule", "gate_proj:0",
                                   "--devices", "GPU-emulated-0,GPU-emulated-1", "--json"};
  if (host_tables) args.insert(args.end(), {"--host-resident", ".engram.embed."});
  return args;
}

class EngramE2E : public ::testing::Test {
 protected:
  EngramE2E() : d_({"--device-backend", "emulated"}) {
    path_ = d_.models_dir() + "/engram";
    CommandResult r = testing::RunCommand({testing::WeightctlBinary(), "make-demo", path_, "--preset", "engram"});
    EXPECT_EQ(r.code, 0) << r.err;
    // Not shards: a FIFO (opening it would block the load) and a text file.
    EXPECT_EQ(mkfifo((path_ + "/optimizer.bin").c_str(), 0644), 0);
    std::ofstream(path_ + "/notes.txt") << "not a checkpoint\n";
  }
  // The load, bounded: a load that opened the FIFO would never return.
  CommandResult Load(const std::vector<std::string>& args) {
    Process load(d_.CtlArgv(args), d_.dir().path());
    bool done = testing::WaitFor([&] { return !load.Running(); }, std::chrono::seconds(60));
    if (!done) load.Signal(SIGKILL);
    int code = load.Wait();
    EXPECT_TRUE(done) << "the load did not return within 60 s";
    return {code, load.Stdout(), load.Stderr()};
  }
  json Manifest(const std::string& name, int rank) {
    CommandResult m = d_.Ctl({"manifest", name, "--rank", std::to_string(rank), "--json"});
    EXPECT_EQ(m.code, 0) << m.err;
    return json::parse(m.out);
  }
  DaemonProcess d_;
  std::string path_;
};

TEST_F(EngramE2E, OnlyTheTablesStayOnTheHostAndEveryByteEqualsTheFiles) {
  CommandResult load = Load(EngramPlan("ds", true));
  ASSERT_EQ(load.code, 0) << load.err;
  json loaded = json::parse(load.out);
  EXPECT_EQ(loaded["tensors"], kTensors);
  EXPECT_GT(loaded["device_bytes"]["GPU-emulated-0"], 0);
  EXPECT_GT(loaded["device_bytes"]["GPU-emulated-1"], 0);
  for (int rank : {0, 1}) {
    json m = Manifest("ds", rank);
    std::set<std::string> names;
    uint64_t host_bytes = 0;
    int host = 0;
    for (const json& t : m["tensors"]) {
      std::string name = t["name"];
      EXPECT_TRUE(names.insert(name).second) << name << " listed twice";
      bool table = absl::StrContains(name, ".engram.embed.");
      EXPECT_EQ(t["placement"], table ? "host" : "device") << name;
      if (table) {
        ++host;
        host_bytes += t["nbytes"].get<uint64_t>();
        EXPECT_EQ(t["dtype"], absl::EndsWith(name, ".scale") ? "F8_E8M0" : "F8_E4M3") << name;
      }
    }
    EXPECT_EQ(names.size(), static_cast<size_t>(kTensors)) << "rank " << rank;
    EXPECT_EQ(host, 4) << "rank " << rank;
    EXPECT_EQ(host_bytes, kTableBytes) << "rank " << rank;
    EXPECT_TRUE(names.count("model.layers.1.engram.gate_proj.weight"));  // in an Engram file, not a table
  }
  // Two client processes, one per rank, compare every byte with the files.
  Process r0(d_.CtlArgv({"attach", "ds", "--rank", "0", "--verify", path_}), d_.dir().path());
  Process r1(d_.CtlArgv({"attach", "ds", "--rank", "1", "--verify", path_}), d_.dir().path());
  EXPECT_EQ(r0.Wait(), 0) << r0.Stderr();
  EXPECT_EQ(r1.Wait(), 0) << r1.Stderr();
  EXPECT_TRUE(absl::StrContains(r0.Stdout(), "verified 26 tensors")) << r0.Stdout();
  EXPECT_TRUE(absl::StrContains(r1.Stdout(), "verified 26 tensors")) << r1.Stdout();
}

TEST_F(EngramE2E, WithoutAPatternEveryTensorGoesToTheDevices) {
  CommandResult load = Load(EngramPlan("all-devices", false));
  ASSERT_EQ(load.code, 0) << load.err;
  json m = Manifest("all-devices", 0);
  ASSERT_EQ(m["tensors"].size(), static_cast<size_t>(kTensors));
  for (const json& t : m["tensors"]) EXPECT_EQ(t["placement"], "device") << t["name"];
}

TEST_F(EngramE2E, ALoadWithoutDevicesNeverTouchesTheDevicePath) {
  CommandResult load = Load({"load", "host-only", "engram", "--json"});
  ASSERT_EQ(load.code, 0) << load.err;
  json loaded = json::parse(load.out);
  EXPECT_TRUE(loaded["device_bytes"].empty()) << loaded.dump();
  json m = Manifest("host-only", 0);
  ASSERT_EQ(m["tensors"].size(), static_cast<size_t>(kTensors));
  for (const json& t : m["tensors"]) EXPECT_EQ(t["placement"], "host") << t["name"];
  for (const json& s : m["segments"]) EXPECT_EQ(s["placement"], "host");
  Process verify(d_.CtlArgv({"attach", "host-only", "--verify", path_}), d_.dir().path());
  EXPECT_EQ(verify.Wait(), 0) << verify.Stderr();
  EXPECT_TRUE(absl::StrContains(verify.Stdout(), "verified 26 tensors")) << verify.Stdout();
}

}  // namespace
}  // namespace weightd
