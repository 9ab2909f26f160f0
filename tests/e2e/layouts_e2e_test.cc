// Runtime layouts end to end (issue 25; docs/api.md "Runtime layouts"): a
// real daemon, writers through the C++ client (in this process, or in
// tests/e2e/layout_writer_helper.cc's process), readers through weightctl
// in their own processes.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <set>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/format/content_hash.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/e2e/layout_e2e_data.h"
#include "tests/testing/process.h"
#include "weightd/client.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::DaemonProcess;
using testing::LayoutE2EBytes;
using testing::LayoutE2ETensors;

constexpr char kKey[] = "e2e/int8-fused/v1";

std::string ExpectedHash(const std::string& name, uint32_t rank, uint64_t nbytes) {
  std::string bytes = LayoutE2EBytes(name, rank, nbytes);
  return ContentHashHex(TensorContentHash(bytes.data(), bytes.size()));
}

// Entries of /proc/PID/fd, and those of them that are memfds named weightd:layout-*.
int FdCount(pid_t pid) {
  int n = 0;
  DIR* d = opendir(absl::StrCat("/proc/", pid, "/fd").c_str());
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}
int LayoutMemfds(pid_t pid) {
  int n = 0;
  std::string dir = absl::StrCat("/proc/", pid, "/fd");
  DIR* d = opendir(dir.c_str());
  while (dirent* e = readdir(d)) {
    char target[256] = {};
    if (readlink((dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1) > 0 &&
        absl::StartsWith(target, "/memfd:weightd:layout-")) {
      ++n;
    }
  }
  closedir(d);
  return n;
}

// The exact tensor table a weightctl attach of rank `rank` must show.
json ExpectedTensors(const std::string& qkv_placement, uint32_t rank) {
  return json::array({{{"name", "qkv_proj.weight"},
                       {"dtype", "I8"},
                       {"shape", {12, 8}},
                       {"strides", json::array()},
                       {"placement", qkv_placement},
                       {"nbytes", 96},
                       {"content_hash", ExpectedHash("qkv_proj.weight", rank, 96)}},
                      {{"name", "qkv_proj.scale"},
                       {"dtype", "F32"},
                       {"shape", {12}},
                       {"strides", json::array()},
                       {"placement", "host"},
                       {"nbytes", 48},
                       {"content_hash", ExpectedHash("qkv_proj.scale", rank, 48)}},
                      {{"name", "o_proj.weight.t"},
                       {"dtype", "BF16"},
                       {"shape", {8, 6}},
                       {"strides", {1, 8}},
                       {"placement", "host"},
                       {"nbytes", 96},
                       {"content_hash", ExpectedHash("o_proj.weight.t", rank, 96)}}});
}


// Rewrites a safetensors file with every byte of its data section inverted
// (same header), so that a reload makes a new generation.
void InvertTensorBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  for (size_t i = 8 + header; i < bytes.size(); ++i) bytes[i] = static_cast<char>(~bytes[i]);
  std::ofstream(path + ".tmp", std::ios::binary) << bytes;
  ASSERT_EQ(rename((path + ".tmp").c_str(), path.c_str()), 0);
}

class LayoutsE2E : public ::testing::Test {
 protected:
  LayoutsE2E() : d_({"--device-backend", "emulated"}) {}

  // Loads the tiny demo as "tiny", its device tensors on GPU-emulated-0.
  void SetUp() override {
    ASSERT_EQ(testing::RunCommand({testing::WeightctlBinary(), "make-demo", d_.models_dir() + "/tiny"}).code, 0);
    CommandResult load = d_.Ctl({"load", "tiny", "tiny", "--devices", "GPU-emulated-0"});
    ASSERT_EQ(load.code, 0) << load.err;
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(d_.socket());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
  }

  LayoutOptions Options(Location qkv = Location::kHost, uint32_t rank = 0) {
    LayoutOptions o;
    o.model = "tiny";
    o.key = kKey;
    o.rank = rank;
    o.identity = {{"engine", "e2e"}, {"quant", "int8"}};
    o.tensors = LayoutE2ETensors(qkv);
    return o;
  }

  // Fills every tensor of `w` with its LayoutE2EBytes.
  static void Fill(LayoutWriter& w) {
    for (const WritableTensor& t : w.tensors()) {
      std::string bytes = LayoutE2EBytes(t.info.name, w.rank(), t.info.nbytes);
      std::memcpy(t.data, bytes.data(), bytes.size());
    }
  }

  // Publishes Options(qkv) from this process.
  void Publish(Location qkv = Location::kHost) {
    absl::StatusOr<LayoutWriter> w = client_->BeginLayout(Options(qkv));
    ASSERT_TRUE(w.ok()) << w.status();
    Fill(*w);
    absl::StatusOr<LayoutCommitInfo> committed = w->Commit();
    ASSERT_TRUE(committed.ok()) << committed.status();
  }

  // weightctl attach tiny --layout kKey --verify-layout --json in its own process.
  json AttachVerified(uint32_t rank = 0) {
    CommandResult r = d_.Ctl({"attach", "tiny", "--rank", std::to_string(rank), "--layout", kKey, "--identity",
                              "engine=e2e", "--identity", "quant=int8", "--verify-layout", "--json"});
    EXPECT_EQ(r.code, 0) << r.err;
    return r.code == 0 ? json::parse(r.out) : json();
  }

  DaemonProcess d_;
  std::unique_ptr<Client> client_;
};

TEST_F(LayoutsE2E, PublishedHostAndDeviceTensorsAreServedToAnotherProcess) {
  absl::StatusOr<LayoutWriter> w = client_->BeginLayout(Options(Location::kDevice));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_FALSE(w->published_by_other());
  ASSERT_EQ(w->tensors().size(), 3u);
  EXPECT_EQ(w->tensors()[0].info.location, Location::kDevice);
  EXPECT_EQ(w->tensors()[2].info.strides, (std::vector<uint64_t>{1, 8}));
  EXPECT_EQ(w->tensors()[2].info.nbytes, 96u);
  // Host segment: scale at 0 (48 B), o_proj at 256 (96 B) -> 512; device staging: 256.
  EXPECT_EQ(w->bytes_staged(), 768u);
  Fill(*w);
  absl::StatusOr<LayoutCommitInfo> committed =
      w->Commit({{"qkv_proj.weight", ExpectedHash("qkv_proj.weight", 0, 96)}});
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->layout.key, kKey);
  EXPECT_EQ(committed->layout.tensor_count, 3u);
  EXPECT_EQ(committed->layout.host_bytes, 512u);
  EXPECT_EQ(committed->layout.fingerprint.size(), 32u);
  for (const WritableTensor& t : w->tensors()) EXPECT_EQ(t.data, nullptr) << t.info.name;

  json attached = AttachVerified();
  EXPECT_EQ(attached["verified"], true);
  EXPECT_EQ(attached["layout"], kKey);
  EXPECT_EQ(attached["identity"], json({{"engine", "e2e"}, {"quant", "int8"}}));
  EXPECT_EQ(attached["fingerprint"], committed->layout.fingerprint);
  EXPECT_EQ(attached["layout_tensors"], ExpectedTensors("device", 0));

  CommandResult layouts = d_.Ctl({"layouts", "tiny", "--json"});
  ASSERT_EQ(layouts.code, 0) << layouts.err;
  json l = json::parse(layouts.out)["layouts"];
  ASSERT_EQ(l.size(), 1u);
  EXPECT_EQ(l[0]["key"], kKey);
  EXPECT_EQ(l[0]["rank"], 0);
  EXPECT_EQ(l[0]["generation"], 1);
  EXPECT_EQ(l[0]["tensors"], 3);
  EXPECT_EQ(l[0]["host_bytes"], 512);
  EXPECT_EQ(l[0]["device_bytes"], json({{"GPU-emulated-0", committed->layout.device_bytes.at("GPU-emulated-0")}}));
  // (no "leases" check here: weightctl's lease ends when the daemon sees its connection close, asynchronously)
  EXPECT_EQ(l[0]["fingerprint"], committed->layout.fingerprint);
  EXPECT_EQ(l[0]["identity"], json({{"engine", "e2e"}, {"quant", "int8"}}));

  CommandResult text = d_.Ctl({"layouts", "tiny"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_TRUE(absl::StartsWith(text.out, "KEY ")) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, absl::StrCat("\n", kKey, " "))) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, " 512 B GPU-emulated-0=")) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, " engine=e2e,quant=int8\n")) << text.out;
  CommandResult missing_model = d_.Ctl({"layouts", "nope"});
  EXPECT_EQ(missing_model.code, 2);
  EXPECT_EQ(missing_model.err, "weightctl: no model named 'nope'\n");

  // And in this process, byte for byte (the device tensor copied back).
  AttachOptions options;
  options.layout = kKey;
  absl::StatusOr<MappedModel> m = client_->Attach("tiny", 0, options);
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->tensors().size(), 3u);
  for (const TensorView& v : m->tensors()) {
    std::string got(v.nbytes, '\0');
    ASSERT_TRUE(m->CopyToHost(v, 0, got.data(), got.size()).ok());
    EXPECT_EQ(got, LayoutE2EBytes(v.info->name, 0, v.nbytes)) << v.info->name;
  }
  EXPECT_EQ(m->tensors()[0].gpu_uuid, "GPU-emulated-0");
  EXPECT_EQ(m->manifest().layout, kKey);
}

TEST_F(LayoutsE2E, AMissingKeyNamesThePublishedOnesAndAnIdentityMismatchNamesEveryField) {
  Publish();
  CommandResult missing = d_.Ctl({"attach", "tiny", "--layout", "e2e/other"});
  EXPECT_EQ(missing.code, 2);
  EXPECT_EQ(missing.err,
            "weightctl: model 'tiny' generation 1 has no layout 'e2e/other' for rank 0; published for this "
            "generation and rank: 'e2e/int8-fused/v1'\n");
  CommandResult other_rank = d_.Ctl({"attach", "tiny", "--layout", kKey, "--rank", "1"});
  EXPECT_EQ(other_rank.code, 2);
  EXPECT_EQ(other_rank.err, "weightctl: rank 1 is out of range: model 'tiny' has 1 rank(s)\n");

  CommandResult mismatch = d_.Ctl({"attach", "tiny", "--layout", kKey, "--identity", "engine=vllm", "--identity",
                                   "arch=sm90"});
  EXPECT_EQ(mismatch.code, 2);
  EXPECT_EQ(mismatch.err,
            "weightctl: layout 'e2e/int8-fused/v1' of rank 0 of model 'tiny' generation 1 was published with another "
            "identity: arch is 'sm90' here but missing from the published layout; engine is 'vllm' here but 'e2e' "
            "in the published layout; quant is missing here ('int8' in the published layout)\n");

  AttachOptions options;
  options.layout = kKey;
  options.identity = {{"engine", "e2e"}, {"quant", "int4"}};
  absl::StatusOr<MappedModel> m = client_->Attach("tiny", 0, options);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(m.status().message(),
            "layout 'e2e/int8-fused/v1' of rank 0 of model 'tiny' generation 1 was published with another identity: "
            "quant is 'int4' here but 'int8' in the published layout");
}

TEST_F(LayoutsE2E, ASecondWriterIsRefusedOrWaitsForTheFirst) {
  absl::StatusOr<LayoutWriter> first = client_->BeginLayout(Options());
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<LayoutWriter> second = client_->BeginLayout(Options());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(second.status().message(),
            "layout 'e2e/int8-fused/v1' of rank 0 of model 'tiny' generation 1 is being published by another writer");

  // Waiting: the first aborts, the waiter gets the grant (whether it began
  // waiting before the abort or after it).
  absl::StatusOr<LayoutWriter> waiter = absl::UnknownError("not run");
  std::thread t([&] {
    LayoutOptions o = Options();
    o.wait_seconds = 60;
    waiter = client_->BeginLayout(o);
  });
  EXPECT_TRUE(first->Abort().ok());
  t.join();
  ASSERT_TRUE(waiter.ok()) << waiter.status();
  EXPECT_FALSE(waiter->published_by_other());
  EXPECT_EQ(waiter->tensors().size(), 3u);

  // Waiting again: this time the writer commits, the waiter is told it is published.
  absl::StatusOr<LayoutWriter> late = absl::UnknownError("not run");
  std::thread t2([&] {
    LayoutOptions o = Options();
    o.wait_seconds = 60;
    late = client_->BeginLayout(o);
  });
  Fill(*waiter);
  ASSERT_TRUE(waiter->Commit().ok());
  t2.join();
  ASSERT_TRUE(late.ok()) << late.status();
  EXPECT_TRUE(late->published_by_other());
  EXPECT_TRUE(late->tensors().empty());
  EXPECT_EQ(late->Commit().status().code(), absl::StatusCode::kFailedPrecondition);

  // Published: without waiting, ALREADY_EXISTS.
  absl::StatusOr<LayoutWriter> again = client_->BeginLayout(Options());
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(again.status().message(),
            "layout 'e2e/int8-fused/v1' of rank 0 of model 'tiny' generation 1 is published already; attach it, or "
            "drop it first");
}

TEST_F(LayoutsE2E, AWriterKilledMidPublishLeavesNothingPublishedAndNothingLeaked) {
  const int fds_before = FdCount(d_.pid());
  ASSERT_EQ(LayoutMemfds(d_.pid()), 0);
  testing::TempDir dir;
  testing::Process writer({LAYOUT_WRITER_HELPER, d_.socket(), "tiny", kKey, "0", "hold", "device"}, dir.path());
  ASSERT_TRUE(testing::WaitFor([&] { return absl::StrContains(writer.Stdout(), "staged"); }, std::chrono::seconds(20)))
      << writer.Stdout();
  EXPECT_EQ(LayoutMemfds(d_.pid()), 2);  // host and device staging
  writer.Signal(SIGKILL);
  EXPECT_EQ(writer.Wait(), 128 + SIGKILL);
  // At most as many fds as before (a gRPC connection of the load may close meanwhile, never one more).
  EXPECT_TRUE(testing::WaitFor([&] { return LayoutMemfds(d_.pid()) == 0 && FdCount(d_.pid()) <= fds_before; },
                               std::chrono::seconds(20)))
      << LayoutMemfds(d_.pid()) << " layout memfds, " << FdCount(d_.pid()) << " fds (" << fds_before << " before)";
  absl::StatusOr<std::vector<ModelSummary>> models = client_->List();
  ASSERT_TRUE(models.ok());
  ASSERT_EQ(models->size(), 1u);
  EXPECT_TRUE((*models)[0].layouts.empty());
  CommandResult missing = d_.Ctl({"attach", "tiny", "--layout", kKey});
  EXPECT_EQ(missing.code, 2);
  EXPECT_TRUE(absl::StrContains(missing.err, "published for this generation and rank: none")) << missing.err;
  // The slot is free again.
  Publish(Location::kDevice);
  EXPECT_EQ(AttachVerified()["layout_tensors"], ExpectedTensors("device", 0));
}

TEST_F(LayoutsE2E, NoFdOrMappingTheWriterKeptCanChangeServedBytes) {
  absl::StatusOr<LayoutWriter> w = client_->BeginLayout(Options());
  ASSERT_TRUE(w.ok()) << w.status();
  Fill(*w);
  std::vector<int> kept;
  for (int fd : w->staged_fds()) kept.push_back(dup(fd));
  ASSERT_EQ(kept.size(), 1u);  // every tensor is on the host: one staged memfd
  ASSERT_TRUE(w->Commit().ok());
  EXPECT_TRUE(w->staged_fds().empty());  // closed: the daemon holds the sealed memfd
  const json before = AttachVerified()["layout_tensors"];
  ASSERT_EQ(before, ExpectedTensors("host", 0));

  for (int fd : kept) {
    char junk[64];
    std::memset(junk, 0x5a, sizeof junk);
    errno = 0;
    EXPECT_EQ(pwrite(fd, junk, sizeof junk, 0), -1);
    EXPECT_EQ(errno, EPERM);
    errno = 0;
    EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
    EXPECT_EQ(errno, EPERM);
    EXPECT_EQ(ftruncate(fd, 0), -1);
    EXPECT_EQ(errno, EPERM);
    // A private mapping may be written: the writes are this process's copy.
    void* priv = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    ASSERT_NE(priv, MAP_FAILED);
    std::memset(priv, 0x5a, 4096);
    munmap(priv, 4096);
    close(fd);
  }
  EXPECT_EQ(AttachVerified()["layout_tensors"], before);
}

TEST_F(LayoutsE2E, ACommitWhileAWritableMappingLivesIsRefusedUntilItIsUnmapped) {
  absl::StatusOr<LayoutWriter> w = client_->BeginLayout(Options());
  ASSERT_TRUE(w.ok()) << w.status();
  Fill(*w);
  int fd = dup(w->staged_fds()[0]);
  void* held = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(held, MAP_FAILED);
  absl::StatusOr<LayoutCommitInfo> refused = w->Commit();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused.status().message(),
            "sealing staged layout segment 0: the memfd is still mapped writable by a process (F_SEAL_WRITE refused "
            "with EBUSY): unmap it first");
  // The publish is still open and the writer's tensors are mapped again.
  ASSERT_NE(w->tensors()[0].data, nullptr);
  EXPECT_EQ(std::string(w->tensors()[0].data, 96), LayoutE2EBytes("qkv_proj.weight", 0, 96));
  munmap(held, 4096);
  close(fd);
  absl::StatusOr<LayoutCommitInfo> committed = w->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(AttachVerified()["layout_tensors"], ExpectedTensors("host", 0));
}

// Cancels `watch` unless destroyed within 60 s, so that an event that never
// comes fails the test (Next() answers CANCELLED) instead of hanging it.
class CancelIfStuck {
 public:
  explicit CancelIfStuck(ModelWatch& watch)
      : thread_([this, &watch] {
          if (!done_.WaitForNotificationWithTimeout(absl::Seconds(60))) watch.Cancel();
        }) {}
  ~CancelIfStuck() {
    done_.Notify();
    thread_.join();
  }

 private:
  absl::Notification done_;
  std::thread thread_;
};

TEST_F(LayoutsE2E, DropAReloadAndAnUnloadAreAnnouncedOnTheWatch) {
  absl::StatusOr<ModelWatch> watch = client_->Watch("tiny");
  ASSERT_TRUE(watch.ok()) << watch.status();
  CancelIfStuck guard(*watch);
  absl::StatusOr<WatchEvent> e = watch->Next();
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->kind, "CURRENT");

  Publish();
  e = watch->Next();
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->kind, "LAYOUT_PUBLISHED");
  EXPECT_EQ(e->layout, kKey);
  EXPECT_EQ(e->rank, 0u);
  EXPECT_EQ(e->generation, 1u);

  CommandResult drop = d_.Ctl({"drop-layout", "tiny", kKey, "--rank", "0"});
  EXPECT_EQ(drop.code, 0) << drop.err;
  EXPECT_EQ(drop.out, "dropped 1 layout(s) 'e2e/int8-fused/v1' of 'tiny' rank 0\n");
  e = watch->Next();
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->kind, "LAYOUT_DROPPED");
  EXPECT_EQ(e->layout, kKey);
  CommandResult gone = d_.Ctl({"attach", "tiny", "--layout", kKey});
  EXPECT_EQ(gone.code, 2);
  EXPECT_EQ(gone.err,
            "weightctl: model 'tiny' generation 1 has no layout 'e2e/int8-fused/v1' for rank 0; published for this "
            "generation and rank: none\n");
  CommandResult drop_again = d_.Ctl({"drop-layout", "tiny", kKey});
  EXPECT_EQ(drop_again.code, 2);
  EXPECT_EQ(drop_again.err,
            "weightctl: model 'tiny' generation 1 has no layout 'e2e/int8-fused/v1'; it has: none\n");

  // A reload drains the layout with its generation; a lease on it keeps working.
  Publish();
  e = watch->Next();
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->kind, "LAYOUT_PUBLISHED");
  AttachOptions options;
  options.layout = kKey;
  absl::StatusOr<MappedModel> held = client_->Attach("tiny", 0, options);
  ASSERT_TRUE(held.ok()) << held.status();
  InvertTensorBytes(d_.models_dir() + "/tiny/model-00002-of-00002.safetensors");  // a reload of the same bytes reuses
  CommandResult reload = d_.Ctl({"reload", "tiny"});
  ASSERT_EQ(reload.code, 0) << reload.err;
  std::vector<std::string> kinds;
  while (kinds.size() < 3) {
    e = watch->Next();
    ASSERT_TRUE(e.ok());
    kinds.push_back(e->kind + (e->layout.empty() ? "" : " " + e->layout) + " " + std::to_string(e->generation));
  }
  EXPECT_EQ(kinds, (std::vector<std::string>{"PUBLISHED 2", "LAYOUT_DRAINING e2e/int8-fused/v1 1", "DRAINING 1"}));
  for (const TensorView& v : held->tensors()) {
    std::string got(v.nbytes, '\0');
    ASSERT_TRUE(held->CopyToHost(v, 0, got.data(), got.size()).ok());
    EXPECT_EQ(got, LayoutE2EBytes(v.info->name, 0, v.nbytes)) << v.info->name;
  }
  CommandResult on_new = d_.Ctl({"attach", "tiny", "--layout", kKey});
  EXPECT_EQ(on_new.code, 2);
  EXPECT_EQ(on_new.err,
            "weightctl: model 'tiny' generation 2 has no layout 'e2e/int8-fused/v1' for rank 0; published for this "
            "generation and rank: none\n");

  // Published again on generation 2, dropped by the unload.
  Publish();
  held = absl::UnknownError("released");
  CommandResult unload = d_.Ctl({"unload", "tiny"});
  ASSERT_EQ(unload.code, 0) << unload.err;
  kinds.clear();
  while (true) {
    e = watch->Next();
    ASSERT_TRUE(e.ok());
    kinds.push_back(e->kind + (e->layout.empty() ? "" : " " + e->layout) + " " + std::to_string(e->generation));
    if (e->kind == "UNLOADED") break;
  }
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "LAYOUT_PUBLISHED e2e/int8-fused/v1 2"), kinds.end());
  EXPECT_NE(std::find(kinds.begin(), kinds.end(), "LAYOUT_DROPPED e2e/int8-fused/v1 2"), kinds.end());
}

TEST_F(LayoutsE2E, MalformedRequestsAreRefusedNamingTheField) {
  LayoutOptions o = Options();
  o.tensors[1].dtype = "Q7";
  EXPECT_EQ(client_->BeginLayout(o).status(),
            absl::InvalidArgumentError("layout tensor 'qkv_proj.scale' has dtype 'Q7', which is no safetensors dtype"));
  o = Options();
  o.key = "bad key";
  EXPECT_EQ(client_->BeginLayout(o).status(),
            absl::InvalidArgumentError("layout key 'bad key' must be 1..256 bytes of [A-Za-z0-9._:/+=-]"));
  o = Options();
  o.tensors[2].shape = {uint64_t{1} << 40, 2};
  o.tensors[2].strides = {uint64_t{1} << 40, 1};
  EXPECT_EQ(client_->BeginLayout(o).status(),
            absl::InvalidArgumentError("layout tensor 'o_proj.weight.t': more than 1099511627776 bytes"));
  o = Options();
  o.tensors[0].shape.assign(17, 1);
  EXPECT_EQ(client_->BeginLayout(o).status(),
            absl::InvalidArgumentError("layout tensor 'qkv_proj.weight' has more than 16 dims"));
  o = Options();
  o.identity["bad key"] = "x";
  EXPECT_EQ(client_->BeginLayout(o).status(),
            absl::InvalidArgumentError("layout identity field 'bad key' must be 1..128 bytes of [A-Za-z0-9._-]"));
  // Nothing was staged by any of them.
  EXPECT_EQ(LayoutMemfds(d_.pid()), 0);
}

// TP=2 on the emulated backend: each rank's writer process publishes its
// shard of the fused qkv on its rank's GPU; a reader process per rank gets
// exactly that rank's bytes.
TEST(LayoutsTp2E2E, EachRankPublishesItsShardOnItsGpuAndEachReaderGetsItsBytes) {
  DaemonProcess d({"--device-backend", "emulated"});
  ASSERT_EQ(testing::RunCommand({testing::WeightctlBinary(), "make-demo", d.models_dir() + "/tiny"}).code, 0);
  CommandResult load = d.Ctl(testing::Tp2Plan("tp", "tiny"));
  ASSERT_EQ(load.code, 0) << load.err;
  testing::TempDir dir;
  for (uint32_t rank : {0u, 1u}) {
    testing::Process writer({LAYOUT_WRITER_HELPER, d.socket(), "tp", kKey, std::to_string(rank), "publish", "device"},
                            dir.path());
    EXPECT_EQ(writer.Wait(), 0) << writer.Stdout() << writer.Stderr();
    EXPECT_TRUE(absl::StartsWith(writer.Stdout(), "committed ")) << writer.Stdout();
  }
  for (uint32_t rank : {0u, 1u}) {
    CommandResult r = d.Ctl({"attach", "tp", "--rank", std::to_string(rank), "--layout", kKey, "--identity",
                             "engine=e2e", "--verify-layout", "--json"});
    ASSERT_EQ(r.code, 0) << r.err;
    json doc = json::parse(r.out);
    EXPECT_EQ(doc["verified"], true);
    EXPECT_EQ(doc["rank"], rank);
    EXPECT_EQ(doc["layout_tensors"], ExpectedTensors("device", rank));
  }
  CommandResult layouts = d.Ctl({"layouts", "tp", "--json"});
  ASSERT_EQ(layouts.code, 0) << layouts.err;
  json l = json::parse(layouts.out)["layouts"];
  ASSERT_EQ(l.size(), 2u);
  std::set<std::string> gpus;
  for (const json& one : l) {
    ASSERT_EQ(one["device_bytes"].size(), 1u);
    gpus.insert(one["device_bytes"].begin().key());
  }
  EXPECT_EQ(gpus, (std::set<std::string>{"GPU-emulated-0", "GPU-emulated-1"}));
}

}  // namespace
}  // namespace weightd
