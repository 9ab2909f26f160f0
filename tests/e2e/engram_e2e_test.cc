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
#include <map>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"
#include "tests/testing/scrape.h"

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
  EngramE2E() : d_({"--device-backend", "emulated", "--metrics-address", "127.0.0.1:0"}) {
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
  // weightd_host_resident_bytes: host segment bytes, each segment once.
  double HostResidentBytes() {
    int port = d_.LoggedPort("metrics on http://");
    absl::StatusOr<std::string> body = testing::HttpGet(port, "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    return testing::SampleValue(body.ok() ? *body : "", "weightd_host_resident_bytes").value_or(-1);
  }
  // The daemon's proportional share of the shared memory it maps (memfd
  // pages: host segments and the emulated GPUs' arenas; no client maps
  // them here, so the whole of each page), from /proc/PID/smaps_rollup.
  uint64_t DaemonPssShmem() {
    std::ifstream in("/proc/" + std::to_string(d_.pid()) + "/smaps_rollup");
    std::string key;
    uint64_t kib = 0;
    while (in >> key) {
      if (key == "Pss_Shmem:" && in >> kib) return kib << 10;
    }
    ADD_FAILURE() << "no Pss_Shmem in smaps_rollup";
    return 0;
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
  // `weightctl ls` shows the split: the tables on the host, the rest on each GPU.
  CommandResult ls = d_.Ctl({"ls", "--json"});
  ASSERT_EQ(ls.code, 0) << ls.err;
  json listed = json::parse(ls.out)["models"];
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0]["host_bytes"], kTableBytes);  // four tables, 64-byte aligned already: no padding
  EXPECT_EQ(listed[0]["device_bytes"], loaded["device_bytes"]["GPU-emulated-0"].get<uint64_t>() +
                                           loaded["device_bytes"]["GPU-emulated-1"].get<uint64_t>());
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

// One copy across names, subsets and plans (server/load/shared_segments.h):
// each later load shares the segments already served whose contents are
// the same, reading and allocating only what differs.
TEST_F(EngramE2E, ASecondNameASubsetAndAnotherPlanShareTheTablesInsteadOfReadingThem) {
  CommandResult first = Load(EngramPlan("ds", true));
  ASSERT_EQ(first.code, 0) << first.err;
  json ds = json::parse(first.out);
  const double host_resident = HostResidentBytes();
  EXPECT_GE(host_resident, static_cast<double>(kTableBytes));
  const uint64_t shmem = DaemonPssShmem();
  EXPECT_GE(shmem, kTableBytes);  // the tables are mapped (and locked) by the daemon

  // The same plan under a second name: nothing read, nothing new.
  CommandResult twin_load = Load(EngramPlan("ds-twin", true));
  ASSERT_EQ(twin_load.code, 0) << twin_load.err;
  json twin = json::parse(twin_load.out);
  EXPECT_EQ(twin["bytes_read"], 0) << twin.dump();
  EXPECT_EQ(twin["fingerprint"], ds["fingerprint"]);
  EXPECT_EQ(HostResidentBytes(), host_resident);

  // A draft model without the Engram tensors: 5 fewer tensors, no host
  // segment, and its arenas hold what ds's hold for the same files.
  std::vector<std::string> draft_args = EngramPlan("draft", false);
  draft_args.insert(draft_args.end(), {"--exclude", ".engram."});
  CommandResult draft_load = Load(draft_args);
  ASSERT_EQ(draft_load.code, 0) << draft_load.err;
  json draft = json::parse(draft_load.out);
  EXPECT_EQ(draft["tensors"], kTensors - 5);
  EXPECT_EQ(draft["bytes_read"], 0) << draft.dump();
  EXPECT_EQ(draft["host_bytes"], 0);
  for (const json& t : Manifest("draft", 0)["tensors"]) {
    EXPECT_FALSE(absl::StrContains(t["name"].get<std::string>(), ".engram.")) << t["name"];
  }
  EXPECT_EQ(HostResidentBytes(), host_resident);
  // Neither load added a page of shared memory (a copy of the tables or a
  // fresh arena would: both are memfds the daemon maps).
  EXPECT_LT(DaemonPssShmem(), shmem + (256 << 10)) << "before " << shmem;

  // Another TP plan (q_proj replicated, not split): the tables and every
  // arena of a file without q_proj are shared; only the files whose arenas
  // change layout are read, and no Engram file is one of them.
  std::vector<std::string> other = {"load", "ds-q", "engram", "--tp-size", "2", "--tp-rule", "gate_proj:0",
                                    "--devices", "GPU-emulated-0,GPU-emulated-1", "--host-resident",
                                    ".engram.embed.", "--json"};
  CommandResult other_load = Load(other);
  ASSERT_EQ(other_load.code, 0) << other_load.err;
  json q = json::parse(other_load.out);
  CommandResult inspect = d_.Ctl({"inspect", path_, "--json"});
  ASSERT_EQ(inspect.code, 0) << inspect.err;
  std::map<std::string, uint64_t> file_bytes;
  std::set<std::string> q_files;
  json catalog = json::parse(inspect.out);
  for (const json& t : catalog["tensors"]) {
    std::string name = t["name"], file = t["file"];
    if (absl::StrContains(name, ".engram.embed.")) continue;  // host tables: shared
    file_bytes[file] += t["nbytes"].get<uint64_t>();
    if (absl::StrContains(name, "q_proj")) q_files.insert(file);
  }
  uint64_t expected_read = 0;
  for (const std::string& f : q_files) {
    EXPECT_FALSE(absl::StrContains(f, "engram")) << f;
    expected_read += file_bytes[f];
  }
  EXPECT_GT(expected_read, 0u);
  EXPECT_EQ(q["bytes_read"], expected_read) << q.dump();
  EXPECT_EQ(HostResidentBytes(), host_resident);

  // Unloading the first name keeps the others' tables, with their bytes.
  ASSERT_EQ(d_.Ctl({"unload", "ds"}).code, 0);
  EXPECT_EQ(HostResidentBytes(), host_resident);
  Process verify(d_.CtlArgv({"attach", "ds-twin", "--rank", "1", "--verify", path_}), d_.dir().path());
  EXPECT_EQ(verify.Wait(), 0) << verify.Stderr();
  EXPECT_TRUE(absl::StrContains(verify.Stdout(), "verified 26 tensors")) << verify.Stdout();
}

}  // namespace
}  // namespace weightd
