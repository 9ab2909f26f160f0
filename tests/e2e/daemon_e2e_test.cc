// End-to-end: a real weightd on a temporary socket, real weightctl client
// processes, and /proc to check that clients share the daemon's pages.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/format/demo_checkpoint.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::DaemonProcess;
using testing::Process;

json Ls(const DaemonProcess& d) {
  CommandResult r = d.Ctl({"ls", "--json"});
  EXPECT_EQ(r.code, 0) << r.err;
  return json::parse(r.out);
}

const json* FindModel(const json& ls, const std::string& name, const std::string& state = "") {
  for (const json& m : ls["models"]) {
    if (m["name"] == name && (state.empty() || m["state"] == state)) return &m;
  }
  return nullptr;
}

// Polls `condition` every 10 ms for up to `limit`; returns the time it took.
template <typename F>
double WaitFor(F condition, double limit_seconds) {
  auto start = std::chrono::steady_clock::now();
  while (true) {
    double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (condition() || elapsed > limit_seconds) return elapsed;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

struct MemfdMapping {
  std::string inode;
  uint64_t pss_kib = 0;
};

// The mappings of memfd:weightd:<segment> in process `pid`, from /proc/PID/smaps.
std::vector<MemfdMapping> MemfdMappings(pid_t pid, const std::string& segment) {
  std::ifstream smaps("/proc/" + std::to_string(pid) + "/smaps");
  std::vector<MemfdMapping> out;
  std::string line;
  bool in_segment = false;
  while (std::getline(smaps, line)) {
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
    if (fields.size() >= 6 && fields[0].find('-') != std::string::npos && !absl::EndsWith(fields[0], ":")) {
      in_segment = absl::StrContains(line, "/memfd:weightd:" + segment);
      if (in_segment) out.push_back({fields[4], 0});
    } else if (in_segment && fields.size() >= 2 && fields[0] == "Pss:") {
      (void)absl::SimpleAtoi(fields[1], &out.back().pss_kib);
    }
  }
  return out;
}

int CountMemfds(pid_t pid) {
  std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(dir.c_str());
  int count = 0;
  while (dirent* e = readdir(d)) {
    char target[256] = {};
    std::string path = dir + "/" + e->d_name;
    if (readlink(path.c_str(), target, sizeof(target) - 1) > 0 && absl::StartsWith(target, "/memfd:weightd:")) ++count;
  }
  closedir(d);
  return count;
}

std::string MakeDemo(const DaemonProcess& d, const std::string& name, const std::string& preset) {
  std::string dir = d.models_dir() + "/" + name;
  CommandResult r = testing::RunCommand({testing::WeightctlBinary(), "make-demo", dir, "--preset", preset});
  EXPECT_EQ(r.code, 0) << r.err;
  return dir;
}

TEST(DaemonE2E, LoadsCheckpointsAndTwoProcessesVerifyEveryByte) {
  DaemonProcess d;
  std::vector<std::pair<std::string, std::string>> models = {{"demo", MakeDemo(d, "demo", "small")}};
  if (auto shared = testing::SharedDir()) {
    std::string real = *shared + "/real-checkpoints/";
    models.push_back({"flux-sharded", real + "fluxml-sharded"});
    models.push_back({"flux", real + "fluxml-nonsharded/model.safetensors"});
    models.push_back({"lora", real + "gpt2-tigrinya-lora"});
  } else {
    std::cerr << "../shared is absent: real checkpoints skipped, demo only\n";
  }
  for (const auto& [name, path] : models) {
    CommandResult load = d.Ctl({"load", name, path, "--json"});
    ASSERT_EQ(load.code, 0) << load.err;
    EXPECT_EQ(json::parse(load.out)["state"], "READY");
    // Two client processes at once, each verifying every tensor byte for byte.
    Process a(d.CtlArgv({"attach", name, "--verify", path}), d.dir().path());
    Process b(d.CtlArgv({"attach", name, "--verify", path}), d.dir().path());
    ASSERT_EQ(a.Wait(), 0) << a.Stderr();
    ASSERT_EQ(b.Wait(), 0) << b.Stderr();
    auto verified_line = [](const std::string& out) {
      size_t at = out.find("verified ");
      return at == std::string::npos ? std::string() : out.substr(at, out.find('\n', at) - at);
    };
    EXPECT_TRUE(absl::StartsWith(verified_line(a.Stdout()), "verified ")) << a.Stdout();
    EXPECT_EQ(verified_line(a.Stdout()), verified_line(b.Stdout()));
  }
  json ls = Ls(d);
  EXPECT_EQ(ls["models"].size(), models.size());
  EXPECT_EQ((*FindModel(ls, "demo"))["tensor_count"], 2 + 9 * 6 + 1);
  if (testing::SharedDir()) {
    EXPECT_EQ((*FindModel(ls, "flux-sharded"))["tensor_count"], 36);
    EXPECT_EQ((*FindModel(ls, "lora"))["tensor_count"], 72);
  }
  EXPECT_EQ(d.Stop(), 0);  // SIGTERM: a clean exit
}

TEST(DaemonE2E, ClientsMapTheSameMemfdAndAddNoCopies) {
  DaemonProcess d;
  MakeDemo(d, "tiny", "tiny");
  ASSERT_EQ(d.Ctl({"load", "tiny", "tiny"}).code, 0);
  // --verify touches every page; --hold keeps the mappings while we look.
  Process a(d.CtlArgv({"attach", "tiny", "--verify", d.models_dir() + "/tiny", "--hold", "20"}), d.dir().path());
  Process b(d.CtlArgv({"attach", "tiny", "--verify", d.models_dir() + "/tiny", "--hold", "20"}), d.dir().path());
  // "verified" comes after every page was read ("attached" before).
  WaitFor([&] { return absl::StrContains(a.Stdout(), "verified") && absl::StrContains(b.Stdout(), "verified"); }, 20);
  std::vector<MemfdMapping> ma = MemfdMappings(a.pid(), "tiny:host");
  std::vector<MemfdMapping> mb = MemfdMappings(b.pid(), "tiny:host");
  std::vector<MemfdMapping> md = MemfdMappings(d.pid(), "tiny:host");
  // The tiny demo has two files: one host segment each (server/load/plan.h).
  ASSERT_EQ(ma.size(), 2u);
  ASSERT_EQ(mb.size(), 2u);
  ASSERT_EQ(md.size(), 2u);
  auto inodes = [](const std::vector<MemfdMapping>& m) { return std::set<std::string>{m[0].inode, m[1].inode}; };
  EXPECT_EQ(inodes(ma).size(), 2u);
  EXPECT_EQ(inodes(ma), inodes(mb));  // the same memory objects, not copies
  EXPECT_EQ(inodes(ma), inodes(md));
  json model = *FindModel(Ls(d), "tiny");
  // Each of the two segments is a whole number of pages.
  uint64_t segments_kib = (model["host_bytes"].get<uint64_t>() + 2 * 4095) / 4096 * 4;
  // PSS divides each shared page among its mappers: the sum over every
  // process mapping the segments is at most their size, however many clients.
  auto pss = [](const std::vector<MemfdMapping>& m) { return m[0].pss_kib + m[1].pss_kib; };
  EXPECT_LE(pss(ma) + pss(mb) + pss(md), segments_kib);
  EXPECT_GT(pss(ma), 0u);
  EXPECT_EQ(model["leases"], 2);
}

TEST(DaemonE2E, SigkilledClientReleasesItsLeaseWithinOneSecond) {
  DaemonProcess d;
  MakeDemo(d, "tiny", "tiny");
  ASSERT_EQ(d.Ctl({"load", "tiny", "tiny"}).code, 0);
  Process client(d.CtlArgv({"attach", "tiny", "--hold", "60"}), d.dir().path());
  WaitFor([&] { return (*FindModel(Ls(d), "tiny"))["leases"] == 1; }, 10);
  ASSERT_EQ((*FindModel(Ls(d), "tiny"))["leases"], 1);
  client.Signal(SIGKILL);
  EXPECT_EQ(client.Wait(), 128 + SIGKILL);
  double seconds = WaitFor([&] { return (*FindModel(Ls(d), "tiny"))["leases"] == 0; }, 5);
  EXPECT_EQ((*FindModel(Ls(d), "tiny"))["leases"], 0);
  EXPECT_LT(seconds, 1.0);
}

TEST(DaemonE2E, UnloadWhileLeasedDrainsThenFrees) {
  DaemonProcess d;
  MakeDemo(d, "tiny", "tiny");
  ASSERT_EQ(d.Ctl({"load", "tiny", "tiny"}).code, 0);
  EXPECT_EQ(CountMemfds(d.pid()), 2);  // one host segment per file of the tiny demo
  Process client(d.CtlArgv({"attach", "tiny", "--hold", "60"}), d.dir().path());
  WaitFor([&] { return (*FindModel(Ls(d), "tiny"))["leases"] == 1; }, 10);
  CommandResult unload = d.Ctl({"unload", "tiny"});
  ASSERT_EQ(unload.code, 0) << unload.err;
  EXPECT_TRUE(absl::StrContains(unload.out, "DRAINING until its 1 lease(s) end")) << unload.out;
  ASSERT_NE(FindModel(Ls(d), "tiny", "DRAINING"), nullptr);
  EXPECT_EQ(d.Ctl({"attach", "tiny"}).code, 2);  // no new leases
  EXPECT_EQ(CountMemfds(d.pid()), 2);           // still held by the lease
  client.Signal(SIGKILL);
  client.Wait();
  WaitFor([&] { return Ls(d)["models"].empty(); }, 5);
  EXPECT_TRUE(Ls(d)["models"].empty());
  EXPECT_EQ(CountMemfds(d.pid()), 0);  // freed
}

TEST(DaemonE2E, ForceUnloadRevokesLeases) {
  DaemonProcess d;
  MakeDemo(d, "tiny", "tiny");
  ASSERT_EQ(d.Ctl({"load", "tiny", "tiny"}).code, 0);
  Process client(d.CtlArgv({"attach", "tiny", "--hold", "60"}), d.dir().path());
  WaitFor([&] { return (*FindModel(Ls(d), "tiny"))["leases"] == 1; }, 10);
  CommandResult unload = d.Ctl({"unload", "tiny", "--force"});
  ASSERT_EQ(unload.code, 0) << unload.err;
  EXPECT_TRUE(absl::StrContains(unload.out, "freed")) << unload.out;
  EXPECT_TRUE(Ls(d)["models"].empty());
  EXPECT_EQ(CountMemfds(d.pid()), 0);
}

TEST(DaemonE2E, ReloadMakesANewGenerationWhileLeasesKeepTheOld) {
  DaemonProcess d;
  std::string path = MakeDemo(d, "m", "tiny");
  CommandResult first = d.Ctl({"load", "m", "m", "--json"});
  ASSERT_EQ(first.code, 0) << first.err;
  json gen1 = json::parse(first.out);
  // Same files, same plan: reused, no new generation.
  json again = json::parse(d.Ctl({"load", "m", "m", "--json"}).out);
  EXPECT_EQ(again["reused"], true);
  EXPECT_EQ(again["generation"], gen1["generation"]);
  Process client(d.CtlArgv({"attach", "m", "--hold", "60"}), d.dir().path());
  WaitFor([&] { return (*FindModel(Ls(d), "m"))["leases"] == 1; }, 10);
  // Rewrite the checkpoint with different values: a new generation.
  testing::WriteFile(path + "/model-00001-of-00002.safetensors",
                     testing::SafetensorsBuilder().Add("model.embed_tokens.weight", "BF16", {2}, "abcd").Build());
  testing::WriteFile(path + "/model.safetensors.index.json",
                     R"({"weight_map":{"model.embed_tokens.weight":"model-00001-of-00002.safetensors"}})");
  CommandResult second = d.Ctl({"load", "m", "m", "--json"});
  ASSERT_EQ(second.code, 0) << second.err;
  json gen2 = json::parse(second.out);
  EXPECT_EQ(gen2["reused"], false);
  EXPECT_GT(gen2["generation"], gen1["generation"]);
  EXPECT_NE(gen2["fingerprint"], gen1["fingerprint"]);
  json ls = Ls(d);
  ASSERT_NE(FindModel(ls, "m", "READY"), nullptr);
  ASSERT_NE(FindModel(ls, "m", "DRAINING"), nullptr);
  EXPECT_EQ((*FindModel(ls, "m", "DRAINING"))["generation"], gen1["generation"]);
  EXPECT_EQ((*FindModel(ls, "m", "DRAINING"))["fingerprint"], gen1["fingerprint"]);
  client.Signal(SIGKILL);
  client.Wait();
  WaitFor([&] { return Ls(d)["models"].size() == 1; }, 5);
  EXPECT_EQ(Ls(d)["models"].size(), 1u);
}

TEST(DaemonE2E, SharedBadCasesAreRefusedAndLeaveNothingBehind) {
  DaemonProcess d;
  auto shared = testing::SharedDir();
  if (!shared) GTEST_SKIP() << "../shared is absent";
  MakeDemo(d, "tiny", "tiny");
  ASSERT_EQ(d.Ctl({"load", "keep", "tiny"}).code, 0);
  json before = *FindModel(Ls(d), "keep");
  std::ifstream f(*shared + "/cases/cases.json");
  int refused = 0;
  for (const json& c : json::parse(f)) {
    if (c["expect"] != "error") continue;
    std::string path = *shared + "/cases/" + c["path"].get<std::string>();
    CommandResult load = d.Ctl({"load", "bad", path});
    CommandResult inspect = testing::RunCommand({testing::WeightctlBinary(), "inspect", path});
    EXPECT_EQ(load.code, 2) << c["name"];
    EXPECT_EQ(load.err, inspect.err) << c["name"];  // the same one clear line as inspect
    ++refused;
  }
  EXPECT_EQ(refused, 24);  // every "error" case of cases.json
  json ls = Ls(d);
  EXPECT_EQ(ls["models"].size(), 1u);  // no entry for any failed load
  EXPECT_EQ((*FindModel(ls, "keep"))["fingerprint"], before["fingerprint"]);
  EXPECT_EQ(CountMemfds(d.pid()), 2);  // only the healthy model's segments (one per file)
  EXPECT_EQ(d.Ctl({"attach", "keep", "--verify", d.models_dir() + "/tiny"}).code, 0);
}

TEST(DaemonE2E, CatalogWarningsReachTheUser) {
  DaemonProcess d;
  auto shared = testing::SharedDir();
  if (!shared) GTEST_SKIP() << "../shared is absent";
  std::string path = *shared + "/cases/sharded_total_size_wrong";
  CommandResult json_load = d.Ctl({"load", "w", path, "--json"});
  ASSERT_EQ(json_load.code, 0) << json_load.err;
  EXPECT_EQ(json::parse(json_load.out)["warnings"],
            json({"model.safetensors.index.json: metadata.total_size is 1 but the tensors hold 1024 bytes"}));
  CommandResult text_load = d.Ctl({"load", "w", path});
  ASSERT_EQ(text_load.code, 0);
  EXPECT_EQ(text_load.err,
            "weightctl: warning: model.safetensors.index.json: metadata.total_size is 1 but the tensors hold 1024 bytes\n");
}

TEST(DaemonE2E, MalformedRequestsGetClearErrors) {
  DaemonProcess d;
  MakeDemo(d, "tiny", "tiny");
  CommandResult r = d.Ctl({"load", "", "tiny"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: model name must be 1 to 128 characters, got 0\n");
  r = d.Ctl({"load", std::string(5000, 'x'), "tiny"});
  EXPECT_EQ(r.err, "weightctl: model name must be 1 to 128 characters, got 5000\n");
  r = d.Ctl({"load", "a/b", "tiny"});
  EXPECT_EQ(r.err, "weightctl: model name 'a/b' may hold only letters, digits, '.', '_' and '-'\n");
  r = d.Ctl({"attach", "nope"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, "weightctl: no model named 'nope'\n");
  r = d.Ctl({"load", "x", "/etc"});
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(absl::StrContains(r.err, "/etc: resolves to /etc, outside every --model-root")) << r.err;
  ASSERT_EQ(symlink("/etc", (d.models_dir() + "/escape").c_str()), 0);
  r = d.Ctl({"load", "x", "escape"});
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(absl::StrContains(r.err, "escape: resolves to /etc, outside every --model-root")) << r.err;
  r = d.Ctl({"load", "x", "missing"});
  EXPECT_EQ(r.err, "weightctl: missing: no such checkpoint file or folder\n");
  ASSERT_EQ(d.Ctl({"load", "tiny", "tiny"}).code, 0);
  r = d.Ctl({"attach", "tiny", "--rank", "3"});
  EXPECT_EQ(r.err, "weightctl: rank 3 is out of range: model 'tiny' has 1 rank(s)\n");
  r = d.Ctl({"unload", "nope"});
  EXPECT_EQ(r.err, "weightctl: no model named 'nope'\n");
}

// Regression: a second daemon on the same socket once unlinked the first
// one's sockets and orphaned it.
TEST(DaemonE2E, SecondDaemonOnTheSameSocketIsRefused) {
  DaemonProcess first;
  MakeDemo(first, "tiny", "tiny");
  ASSERT_EQ(first.Ctl({"load", "tiny", "tiny"}).code, 0);
  CommandResult second = testing::RunCommand({testing::WeightdBinary(), "--socket", first.socket(), "--model-root",
                                              first.models_dir(), "--metrics-address", ""});
  EXPECT_EQ(second.code, 1);
  EXPECT_TRUE(absl::StrContains(second.err, "another weightd is serving " + first.socket())) << second.err;
  EXPECT_NE(FindModel(Ls(first), "tiny", "READY"), nullptr);  // the first daemon still serves
}

// Regression: a second daemon with another --socket but the same --fd-socket
// once unlinked and took over the first one's fd socket, and removed it on
// exit, so the first daemon's attaches failed for good.
TEST(DaemonE2E, SecondDaemonSharingOnlyTheFdSocketIsRefused) {
  DaemonProcess first;
  MakeDemo(first, "tiny", "tiny");
  ASSERT_EQ(first.Ctl({"load", "tiny", "tiny"}).code, 0);
  std::string fd_socket = first.dir().Join("w.fd.sock");
  testing::TempDir other;
  Process second({testing::WeightdBinary(), "--socket", other.Join("b.sock"), "--fd-socket", fd_socket,
                  "--model-root", first.models_dir(), "--metrics-address", ""},
                 other.path());
  WaitFor([&] { return !second.Running(); }, 10);
  second.Signal(SIGTERM);  // a second daemon that started anyway exits, as it would after an operator's stop
  EXPECT_EQ(second.Wait(), 1);
  std::string refusal = "another weightd is serving " + fd_socket + " (it holds " + fd_socket +
                        ".lock); stop it first or use another --fd-socket\n";
  EXPECT_TRUE(absl::EndsWith(second.Stderr(), refusal)) << second.Stderr();
  CommandResult attach = first.Ctl({"attach", "tiny"});
  EXPECT_EQ(attach.code, 0) << attach.err;  // the first daemon still owns its fd socket
}

// Regression: the fd socket refused with ERR and closed before reading CLAIM,
// so weightctl usually printed "Connection reset by peer" or "Broken pipe".
TEST(DaemonE2E, RefusedAttachPrintsTheDaemonsReason) {
  DaemonProcess d({"--fd-socket-max-connections", "1"});
  MakeDemo(d, "tiny", "tiny");
  ASSERT_EQ(d.Ctl({"load", "tiny", "tiny"}).code, 0);
  testing::TempDir dir;
  Process holder(d.CtlArgv({"attach", "tiny", "--hold", "60"}), dir.path());
  WaitFor([&] { return FindModel(Ls(d), "tiny") != nullptr && (*FindModel(Ls(d), "tiny"))["leases"] == 1; }, 10);
  for (int i = 0; i < 5; ++i) {
    CommandResult r = d.Ctl({"attach", "tiny"});
    EXPECT_EQ(r.code, 2) << i;  // a refused request
    EXPECT_EQ(r.err, "weightctl: fd socket: too many fd-socket connections (1)\n") << i;
  }
}

// The peer check (ERR 7) seen by a real weightctl of another uid.
TEST(DaemonE2E, AttachOfAnotherUidPrintsThePeerRefusal) {
  if (getuid() != 0) GTEST_SKIP() << "needs root to run weightctl as uid 65534 (setpriv)";
  if (access("/usr/bin/setpriv", X_OK) != 0) GTEST_SKIP() << "/usr/bin/setpriv is absent (util-linux)";
  DaemonProcess d;
  MakeDemo(d, "tiny", "tiny");
  ASSERT_EQ(d.Ctl({"load", "tiny", "tiny"}).code, 0);
  // Let uid 65534 reach both sockets, so only the fd socket's peer check refuses it.
  ASSERT_EQ(chmod(d.dir().path().c_str(), 0755), 0);
  ASSERT_EQ(chmod(d.socket().c_str(), 0666), 0);
  ASSERT_EQ(chmod(d.dir().Join("w.fd.sock").c_str(), 0666), 0);
  std::vector<std::string> argv = {"/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"};
  std::vector<std::string> ctl = d.CtlArgv({"attach", "tiny"});
  argv.insert(argv.end(), ctl.begin(), ctl.end());
  for (int i = 0; i < 3; ++i) {
    CommandResult r = testing::RunCommand(argv);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_TRUE(absl::StartsWith(r.err, "weightctl: fd socket: peer uid 65534 gid 65534 (pid ")) << r.err;
    EXPECT_TRUE(absl::EndsWith(r.err, ") is neither the daemon's uid or gid nor in the allowed gids\n")) << r.err;
  }
}

TEST(DaemonE2E, SymlinkLoopIsNamedAsSuch) {
  DaemonProcess d;
  ASSERT_EQ(symlink("loop2", (d.models_dir() + "/loop1").c_str()), 0);
  ASSERT_EQ(symlink("loop1", (d.models_dir() + "/loop2").c_str()), 0);
  CommandResult r = d.Ctl({"load", "x", "loop1"});
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(absl::StrContains(r.err, "Too many levels of symbolic links")) << r.err;
}

TEST(DaemonE2E, UnreachableDaemonIsAClearError) {
  testing::TempDir dir;
  CommandResult r = testing::RunCommand({testing::WeightctlBinary(), "--socket", dir.Join("none.sock"), "ls"});
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(absl::StartsWith(r.err, "weightctl: ")) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(DaemonE2E, PreloadAtStartAndBadFlagsExitTwo) {
  testing::TempDir models;
  ASSERT_EQ(testing::RunCommand({testing::WeightctlBinary(), "make-demo", models.Join("tiny")}).code, 0);
  DaemonProcess d({"--model-root", models.path(), "--preload", "pre=" + models.Join("tiny")});
  WaitFor([&] { return FindModel(Ls(d), "pre", "READY") != nullptr; }, 10);
  EXPECT_NE(FindModel(Ls(d), "pre", "READY"), nullptr);
  CommandResult bad = testing::RunCommand({testing::WeightdBinary(), "--bogus", "1"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_EQ(bad.err, "weightd: unknown flag --bogus\n");
}

}  // namespace
}  // namespace weightd
