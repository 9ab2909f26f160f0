// Restart without reload (issue 15), end to end with real processes: a
// daemon under the fd-store stand-in (tests/testing/fd_store_standin.h, the
// systemd protocol) is SIGKILLed and started again, and a daemon upgrades
// in place (weightctl upgrade, SIGHUP). Every model must come back READY
// with the same generation and fingerprint without a checkpoint byte being
// read: the checkpoints are moved away before the restart, and the load
// byte counter stays 0.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/scoped_fd.h"
#include "nlohmann/json.hpp"
#include "tests/testing/fd_store_standin.h"
#include "tests/testing/process.h"
#include "tests/testing/scrape.h"
#include "tests/testing/shared_inputs.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::Tp2Plan;
using testing::FdStoreStandIn;

int LoggedPort(const std::string& log, const std::string& what) {
  std::smatch m;
  if (!std::regex_search(log, m, std::regex(what + R"( (http://)?127\.0\.0\.1:(\d+))"))) return 0;
  return std::stoi(m[2]);
}

int Count(const std::map<std::string, int>& stored, const std::string& prefix) {
  int n = 0;
  for (const auto& [name, fds] : stored) n += absl::StartsWith(name, prefix) ? fds : 0;
  return n;
}

// A daemon under the stand-in, with model root <tmp>/models.
class RestartE2E : public ::testing::Test {
 protected:
  RestartE2E() : store_(dir_.path()) {
    models_ = dir_.Join("models");
    mkdir(models_.c_str(), 0755);
    socket_ = dir_.Join("w.sock");
  }

  std::vector<std::string> Argv(const std::vector<std::string>& roots) const {
    std::vector<std::string> argv = {testing::WeightdBinary(), "--socket", socket_, "--metrics-address", "127.0.0.1:0",
                                     "--device-backend", "emulated", "--mlock", "false"};
    for (const std::string& r : roots) argv.insert(argv.end(), {"--model-root", r});
    return argv;
  }

  // Starts the daemon through the stand-in; waits until it answers.
  void Start(const std::vector<std::string>& roots) {
    store_.Start(Argv(roots));
    ASSERT_TRUE(FdStoreStandIn::WaitUntil([&] { return Ctl({"ls", "--json"}).code == 0 || !store_.Running(); },
                                          std::chrono::seconds(30)));
    ASSERT_TRUE(store_.Running()) << store_.Stderr(store_.runs() - 1);
  }
  void Start() { Start({models_}); }

  CommandResult Ctl(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {testing::WeightctlBinary(), "--socket", socket_};
    argv.insert(argv.end(), args.begin(), args.end());
    return testing::RunCommand(argv);
  }

  std::string Demo(const std::string& name, const std::string& preset) {
    std::string path = models_ + "/" + name;
    CommandResult r = testing::RunCommand({testing::WeightctlBinary(), "make-demo", path, "--preset", preset});
    EXPECT_EQ(r.code, 0) << r.err;
    return path;
  }

  // name -> {generation, state, fingerprint} of `ls --json`.
  std::map<std::string, json> Models() {
    CommandResult r = Ctl({"ls", "--json"});
    EXPECT_EQ(r.code, 0) << r.err;
    std::map<std::string, json> out;
    json doc = json::parse(r.out);  // alive for the loop: a temporary's member would dangle
    for (const json& m : doc["models"]) {
      out[m["name"]] = {{"generation", m["generation"]}, {"state", m["state"]}, {"fingerprint", m["fingerprint"]}};
    }
    return out;
  }

  std::string Scrape() {
    int port = LoggedPort(store_.Stderr(store_.runs() - 1), "metrics on");
    absl::StatusOr<std::string> body = testing::HttpGet(port, "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    return body.value_or("");
  }

  // Waits until the stand-in holds `records` state records.
  void WaitForRecords(int records) {
    EXPECT_TRUE(FdStoreStandIn::WaitUntil([&] { return Count(store_.Stored(), "wd-rec-") == records; },
                                          std::chrono::seconds(10)))
        << "records stored: " << Count(store_.Stored(), "wd-rec-");
  }

  void Verify(const std::string& name, const std::string& dir, int rank = 0) {
    CommandResult r = Ctl({"attach", name, "--rank", std::to_string(rank), "--verify", dir, "--json"});
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(json::parse(r.out)["verified"], true) << r.out;
  }

  testing::TempDir dir_;
  FdStoreStandIn store_;
  std::string models_, socket_;
};

TEST_F(RestartE2E, SigkilledDaemonServesEveryModelAgainWithoutReadingACheckpoint) {
  std::string tiny = Demo("tiny", "tiny"), small = Demo("small", "small");
  Start();
  ASSERT_EQ(Ctl({"load", "tiny", tiny}).code, 0);
  CommandResult tp = Ctl(Tp2Plan("llama", small));
  ASSERT_EQ(tp.code, 0) << tp.err;
  std::map<std::string, json> before = Models();
  WaitForRecords(2);
  // tiny: one host segment; llama: its host segments plus each rank's
  // arenas. Every segment once.
  EXPECT_GT(Count(store_.Stored(), "wd-seg-"), 2);

  EXPECT_EQ(store_.Kill(SIGKILL), 128 + SIGKILL);
  // Nothing can be read from the checkpoints now.
  ASSERT_EQ(rename(tiny.c_str(), (tiny + ".moved").c_str()), 0);
  ASSERT_EQ(rename(small.c_str(), (small + ".moved").c_str()), 0);
  Start();

  std::map<std::string, json> after = Models();
  EXPECT_EQ(after, before) << store_.Stderr(1);
  EXPECT_EQ(after["tiny"]["state"], "READY");
  EXPECT_EQ(after["llama"]["state"], "READY");
  std::string log = store_.Stderr(1);
  // Records of this daemon's key (beside its socket): no second pass over the bytes.
  EXPECT_TRUE(absl::StrContains(log, "restored 'tiny' generation 1 from the fd store in ")) << log;
  EXPECT_TRUE(std::regex_search(log, std::regex("restored 'tiny' generation 1 from the fd store in [0-9.]+ ms without "
                                                "reading the checkpoint \\(record authenticated by its HMAC\\)")))
      << log;
  EXPECT_TRUE(std::regex_search(log, std::regex("restored 'llama' generation 2 from the fd store in [0-9.]+ ms without "
                                                "reading the checkpoint \\(record authenticated by its HMAC\\)")))
      << log;
  EXPECT_FALSE(absl::StrContains(log, "loaded '")) << log;
  Verify("tiny", tiny + ".moved");
  Verify("llama", small + ".moved", 0);
  Verify("llama", small + ".moved", 1);
  std::string metrics = Scrape();
  EXPECT_EQ(testing::SampleValue(metrics, "weightd_fd_store_restored_models"), 2.0) << metrics;
  EXPECT_EQ(testing::SampleValue(metrics, "weightd_load_bytes_total"), 0.0) << metrics;
  // The store still holds exactly what the restored daemon serves, once.
  EXPECT_EQ(Count(store_.Stored(), "wd-rec-"), 2);

  // Generations go on above the restored ones.
  ASSERT_EQ(rename((tiny + ".moved").c_str(), tiny.c_str()), 0);
  CommandResult again = Ctl({"load", "tiny2", tiny, "--json"});
  ASSERT_EQ(again.code, 0) << again.err;
  EXPECT_EQ(json::parse(again.out)["generation"], 3);
}

// Runtime layouts are kept with their generation (docs/api.md "Runtime
// layouts"): a publish rewrites the record, and a SIGKILLed daemon serves
// each rank's layout again, device arenas included, with the same bytes.
TEST_F(RestartE2E, LayoutsComeBackAfterASigkilledDaemonRestarts) {
  std::string small = Demo("small", "small");
  Start();
  ASSERT_EQ(Ctl(Tp2Plan("llama", small)).code, 0);
  WaitForRecords(1);
  for (const char* rank : {"0", "1"}) {
    CommandResult w = testing::RunCommand({LAYOUT_WRITER_HELPER, socket_, "llama", "eng/fused", rank, "publish", "device"});
    ASSERT_EQ(w.code, 0) << w.out << w.err;
    EXPECT_TRUE(absl::StartsWith(w.out, "committed ")) << w.out;
  }
  // Each publish wrote the record again under a new name; the old one left.
  EXPECT_TRUE(FdStoreStandIn::WaitUntil([&] { return store_.Stored().count("wd-rec-1.2") == 1; },
                                        std::chrono::seconds(10)));
  WaitForRecords(1);
  CommandResult before = Ctl({"layouts", "llama", "--json"});
  ASSERT_EQ(before.code, 0) << before.err;

  EXPECT_EQ(store_.Kill(SIGKILL), 128 + SIGKILL);
  ASSERT_EQ(rename(small.c_str(), (small + ".moved").c_str()), 0);
  Start();

  std::string log = store_.Stderr(1);
  EXPECT_TRUE(absl::StrContains(log, "restored 2 runtime layout(s) of 'llama' generation 1 from the fd store")) << log;
  CommandResult after = Ctl({"layouts", "llama", "--json"});
  ASSERT_EQ(after.code, 0) << after.err;
  json a = json::parse(after.out), b = json::parse(before.out);
  ASSERT_EQ(a["layouts"].size(), 2u) << after.out;
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(a["layouts"][i]["key"], "eng/fused");
    EXPECT_EQ(a["layouts"][i]["rank"], i);
    EXPECT_EQ(a["layouts"][i]["fingerprint"], b["layouts"][i]["fingerprint"]);
    EXPECT_EQ(a["layouts"][i]["identity"], b["layouts"][i]["identity"]);
  }
  for (const char* rank : {"0", "1"}) {
    CommandResult r = Ctl({"attach", "llama", "--rank", rank, "--layout", "eng/fused", "--identity", "engine=e2e",
                           "--verify-layout", "--json"});
    ASSERT_EQ(r.code, 0) << r.err;
    EXPECT_EQ(json::parse(r.out)["verified"], true) << r.out;
  }
  EXPECT_EQ(Count(store_.Stored(), "wd-rec-"), 1);
}

// Without the key (removed, or refused) records are not authenticated:
// every host tensor is hashed again before it is served, and the daemon
// makes a new key for the records it writes from then on.
TEST_F(RestartE2E, ALostRecordKeyCostsAHashOfEveryByteNotAModel) {
  std::string tiny = Demo("tiny", "tiny");
  Start();
  ASSERT_EQ(Ctl({"load", "tiny", tiny}).code, 0);
  std::map<std::string, json> before = Models();
  WaitForRecords(1);
  std::string key = socket_ + ".key";
  struct stat st {};
  ASSERT_EQ(stat(key.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_size, 32);
  EXPECT_EQ(store_.Kill(SIGKILL), 128 + SIGKILL);
  ASSERT_EQ(unlink(key.c_str()), 0);
  Start();
  EXPECT_EQ(Models(), before) << store_.Stderr(1);
  std::string log = store_.Stderr(1);
  EXPECT_TRUE(absl::StrContains(log, "without reading the checkpoint (record not authenticated: every host tensor "
                                     "hashed again)"))
      << log;
  EXPECT_EQ(stat(key.c_str(), &st), 0);  // a new one
  Verify("tiny", tiny);
  // A key others may read is refused by name, and restores hash.
  EXPECT_EQ(store_.Kill(SIGKILL), 128 + SIGKILL);
  ASSERT_EQ(chmod(key.c_str(), 0644), 0);
  Start();
  EXPECT_EQ(Models(), before) << store_.Stderr(2);
  log = store_.Stderr(2);
  EXPECT_TRUE(absl::StrContains(log, "record key " + key + ": has mode 0644 (group or others have access; must be "
                                     "0600); state records are not authenticated"))
      << log;
  EXPECT_TRUE(absl::StrContains(log, "record not authenticated: every host tensor hashed again")) << log;
}

TEST_F(RestartE2E, DamagedRecordsAreDroppedAndTheOthersRestored) {
  // Three copies of the files: one name's segments are not another's
  // (names over the same files share them, as the next test shows).
  std::string tiny = Demo("tiny", "tiny"), tiny_b = Demo("tiny-b", "tiny"), tiny_c = Demo("tiny-c", "tiny");
  Start();
  ASSERT_EQ(Ctl({"load", "a", tiny}).code, 0);    // generation 1: its record will be corrupt
  ASSERT_EQ(Ctl({"load", "b", tiny_b}).code, 0);  // generation 2: a segment will be missing
  ASSERT_EQ(Ctl({"load", "c", tiny_c}).code, 0);  // generation 3: intact
  WaitForRecords(3);
  std::map<std::string, json> before = Models();
  store_.Kill(SIGKILL);

  // a: a sealed record whose bytes are not a state record.
  ScopedFd garbage(memfd_create("garbage", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(write(garbage.get(), "WDSTATE1 but not really", 23), 23);
  ASSERT_EQ(fcntl(garbage.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL), 0);
  store_.Replace("wd-rec-1", std::move(garbage));
  // b: one of its segments is gone. Each load has its own segments, numbered
  // in the order stored: a wd-seg-1,2; b wd-seg-3,4; c wd-seg-5,6.
  ASSERT_EQ(Count(store_.Stored(), "wd-seg-"), 6);  // the tiny demo is two host segments per load
  store_.Erase("wd-seg-3");
  Start();

  std::map<std::string, json> after = Models();
  EXPECT_EQ(after.size(), 1u);
  EXPECT_EQ(after["c"], before["c"]);
  std::string log = store_.Stderr(1);
  EXPECT_TRUE(absl::StrContains(log, "dropped record wd-rec-1 (corrupt)")) << log;
  EXPECT_TRUE(absl::StrContains(log, "dropped record wd-rec-2 of 'b' (missing_fd)")) << log;
  std::string metrics = Scrape();
  EXPECT_EQ(testing::SampleValue(metrics, R"(weightd_fd_store_records_dropped_total{reason="corrupt"})"), 1.0);
  EXPECT_EQ(testing::SampleValue(metrics, R"(weightd_fd_store_records_dropped_total{reason="missing_fd"})"), 1.0);
  EXPECT_EQ(testing::SampleValue(metrics, "weightd_fd_store_restored_models"), 1.0);
  // The dropped records and the segments only they needed left the store.
  EXPECT_TRUE(FdStoreStandIn::WaitUntil(
      [&] {
        std::map<std::string, int> s = store_.Stored();
        return Count(s, "wd-rec-") == 1 && Count(s, "wd-seg-") == 2;
      },
      std::chrono::seconds(5)));
  Verify("c", tiny_c);
  // The names can be loaded again.
  EXPECT_EQ(Ctl({"load", "a", tiny}).code, 0);
}

// Two names over the same files share their host segments
// (server/load/shared_segments.h): the store holds each segment once, and a
// restart gives both names the one copy again.
TEST_F(RestartE2E, SegmentsSharedByTwoNamesAreStoredAndRestoredOnce) {
  std::string tiny = Demo("tiny", "tiny");
  Start();
  ASSERT_EQ(Ctl({"load", "a", tiny}).code, 0);
  ASSERT_EQ(Ctl({"load", "b", tiny}).code, 0);
  WaitForRecords(2);
  std::map<std::string, int> stored = store_.Stored();
  EXPECT_EQ(Count(stored, "wd-seg-"), 2);  // the tiny demo's two host segments, once
  const std::optional<double> one_copy = testing::SampleValue(Scrape(), "weightd_host_resident_bytes");
  ASSERT_TRUE(one_copy.has_value());
  std::map<std::string, json> before = Models();
  store_.Kill(SIGKILL);
  Start();
  EXPECT_EQ(Models(), before);
  EXPECT_EQ(testing::SampleValue(Scrape(), "weightd_host_resident_bytes"), one_copy);
  EXPECT_EQ(Count(store_.Stored(), "wd-seg-"), 2);
  Verify("a", tiny);
  Verify("b", tiny);
  // Unloading one name keeps the segments the other still needs.
  ASSERT_EQ(Ctl({"unload", "a"}).code, 0);
  EXPECT_TRUE(FdStoreStandIn::WaitUntil(
      [&] {
        std::map<std::string, int> s = store_.Stored();
        return Count(s, "wd-rec-") == 1 && Count(s, "wd-seg-") == 2;
      },
      std::chrono::seconds(5)));
  Verify("b", tiny);
}

TEST_F(RestartE2E, ARestartWithFewerModelRootsDropsTheModelsOutsideThem) {
  std::string tiny = Demo("tiny", "tiny");
  std::string other = dir_.Join("other");
  mkdir(other.c_str(), 0755);
  CommandResult made = testing::RunCommand({testing::WeightctlBinary(), "make-demo", other + "/tiny"});
  ASSERT_EQ(made.code, 0) << made.err;
  Start({models_, other});
  ASSERT_EQ(Ctl({"load", "inside", tiny}).code, 0);
  ASSERT_EQ(Ctl({"load", "outside", other + "/tiny"}).code, 0);
  WaitForRecords(2);
  store_.Kill(SIGKILL);
  Start({models_});
  std::map<std::string, json> after = Models();
  EXPECT_EQ(after.size(), 1u);
  EXPECT_EQ(after.count("inside"), 1u);
  std::string log = store_.Stderr(1);
  EXPECT_TRUE(absl::StrContains(log, "of 'outside' (outside_model_roots)")) << log;
}

TEST_F(RestartE2E, UnloadAndReloadKeepTheStoreInStep) {
  std::string tiny = Demo("tiny", "tiny"), tiny_a = Demo("tiny-a", "tiny");  // a's segments are not b's
  Start();
  ASSERT_EQ(Ctl({"load", "a", tiny_a}).code, 0);
  ASSERT_EQ(Ctl({"load", "b", tiny}).code, 0);
  WaitForRecords(2);
  ASSERT_EQ(Ctl({"unload", "a"}).code, 0);
  WaitForRecords(1);
  EXPECT_TRUE(FdStoreStandIn::WaitUntil([&] { return Count(store_.Stored(), "wd-seg-") == 2; }, std::chrono::seconds(5)));
  // A reload after one of the two files was touched reads that file into a
  // new segment and shares the other: the new record replaces the old one,
  // the touched file's old segment (wd-seg-3) leaves the store, the shared
  // one (wd-seg-4) stays, stored once.
  ASSERT_EQ(utimensat(AT_FDCWD, (tiny + "/model-00001-of-00002.safetensors").c_str(), nullptr, 0), 0);
  ASSERT_EQ(Ctl({"reload", "b"}).code, 0);
  EXPECT_TRUE(FdStoreStandIn::WaitUntil([&] { return store_.Stored().count("wd-rec-3") == 1; }, std::chrono::seconds(5)));
  EXPECT_TRUE(FdStoreStandIn::WaitUntil([&] { return store_.Stored().count("wd-seg-3") == 0; }, std::chrono::seconds(5)));
  std::map<std::string, int> stored = store_.Stored();
  EXPECT_EQ(Count(stored, "wd-rec-"), 1);
  EXPECT_EQ(Count(stored, "wd-seg-"), 2);
  EXPECT_EQ(stored.count("wd-seg-4"), 1u);
  store_.Kill(SIGKILL);
  Start();
  std::map<std::string, json> after = Models();
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after["b"]["generation"], 3);
}

TEST_F(RestartE2E, InPlaceUpgradeKeepsEveryModelAndThePid) {
  std::string tiny = Demo("tiny", "tiny"), small = Demo("small", "small");
  Start();
  ASSERT_EQ(Ctl({"load", "tiny", tiny}).code, 0);
  ASSERT_EQ(Ctl(Tp2Plan("llama", small)).code, 0);
  std::map<std::string, json> before = Models();
  WaitForRecords(2);
  pid_t pid = store_.pid();

  CommandResult up = Ctl({"upgrade", "--json"});
  ASSERT_EQ(up.code, 0) << up.err;
  json doc = json::parse(up.out);
  EXPECT_EQ(doc["models_handed_over"], 2);
  EXPECT_EQ(doc["models"].size(), 2u);
  EXPECT_EQ(store_.runs(), 1);  // not restarted by the stand-in: the same process re-executed itself
  EXPECT_TRUE(store_.Running());
  EXPECT_EQ(kill(pid, 0), 0);
  EXPECT_EQ(Models(), before);
  Verify("tiny", tiny);
  Verify("llama", small, 1);
  std::string log = store_.Stderr(0);
  EXPECT_TRUE(absl::StrContains(log, "upgrading in place")) << log;
  EXPECT_TRUE(absl::StrContains(log, "restored 'llama' generation 2 from the fd store")) << log;

  // SIGHUP does the same; the store holds each record once.
  kill(pid, SIGHUP);
  EXPECT_TRUE(FdStoreStandIn::WaitUntil(
      [&] {
        std::string l = store_.Stderr(0);
        size_t first = l.find("restored 'tiny'");
        return first != std::string::npos && l.find("restored 'tiny'", first + 1) != std::string::npos;
      },
      std::chrono::seconds(20)))
      << store_.Stderr(0);
  EXPECT_TRUE(FdStoreStandIn::WaitUntil([&] { return Ctl({"ls", "--json"}).code == 0; }, std::chrono::seconds(10)));
  EXPECT_EQ(Models(), before);
  EXPECT_EQ(Count(store_.Stored(), "wd-rec-"), 2);
}

}  // namespace
}  // namespace weightd
