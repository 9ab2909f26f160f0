// Generations that share segments, end to end through weightd and weightctl:
// a reload after one file of a sharded checkpoint changed reads only that
// file, shares the other's memfd, and serves the new bytes.
#include <dirent.h>
#include <signal.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iterator>
#include <thread>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "common/format/content_hash.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "weightd/client.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::DaemonProcess;

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The inodes of the daemon's open weightd memfds.
std::set<std::string> MemfdInodes(pid_t pid) {
  std::set<std::string> out;
  std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(dir.c_str());
  while (dirent* e = readdir(d)) {
    std::string path = dir + "/" + e->d_name;
    char target[256] = {};
    struct stat st;
    if (readlink(path.c_str(), target, sizeof(target) - 1) > 0 && absl::StartsWith(target, "/memfd:weightd:") &&
        stat(path.c_str(), &st) == 0) {
      out.insert(std::to_string(st.st_ino));
    }
  }
  closedir(d);
  return out;
}

// Rewrites a safetensors file with every byte of its data section inverted
// (same header), through a new file renamed over it. Returns the data
// section's length: the tensor bytes a reload must read.
uint64_t InvertTensorBytes(const std::string& path) {
  std::string bytes = ReadAll(path);
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  for (size_t i = 8 + header; i < bytes.size(); ++i) bytes[i] = static_cast<char>(~bytes[i]);
  std::ofstream(path + ".tmp", std::ios::binary) << bytes;
  EXPECT_EQ(rename((path + ".tmp").c_str(), path.c_str()), 0);
  return bytes.size() - 8 - header;
}

TEST(GenerationsE2E, ReloadAfterOneFileChangedReadsOnlyThatFile) {
  DaemonProcess d;
  std::string dir = d.models_dir() + "/tiny";
  ASSERT_EQ(testing::RunCommand({testing::WeightctlBinary(), "make-demo", dir}).code, 0);
  CommandResult load = d.Ctl({"load", "tiny", "tiny", "--json"});
  ASSERT_EQ(load.code, 0) << load.err;
  json first = json::parse(load.out);
  std::set<std::string> before = MemfdInodes(d.pid());
  ASSERT_EQ(before.size(), 2u);  // one host segment per file

  uint64_t changed = InvertTensorBytes(dir + "/model-00002-of-00002.safetensors");
  CommandResult reload = d.Ctl({"reload", "tiny", "--json"});
  ASSERT_EQ(reload.code, 0) << reload.err;
  json second = json::parse(reload.out);
  EXPECT_EQ(second["generation"], first["generation"].get<int>() + 1);
  EXPECT_EQ(second["bytes_read"], changed);
  EXPECT_EQ(second["bytes_reused"], first["bytes"].get<uint64_t>() - changed);
  EXPECT_NE(second["fingerprint"], first["fingerprint"]);

  // The first file's memfd is the same object; the second's is new, and the
  // old one went with generation 1 (no lease held it; freed off the reply's
  // path, by the daemon's release thread, so give it a moment).
  std::set<std::string> after = MemfdInodes(d.pid());
  for (int i = 0; i < 500 && after.size() != 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    after = MemfdInodes(d.pid());
  }
  ASSERT_EQ(after.size(), 2u);
  std::vector<std::string> kept;
  std::set_intersection(before.begin(), before.end(), after.begin(), after.end(), std::back_inserter(kept));
  EXPECT_EQ(kept.size(), 1u);

  CommandResult verify = d.Ctl({"attach", "tiny", "--verify", dir});
  EXPECT_EQ(verify.code, 0) << verify.out << verify.err;

  // Text output says what was read and reused.
  uint64_t first_file = InvertTensorBytes(dir + "/model-00001-of-00002.safetensors");
  CommandResult text = d.Ctl({"reload", "tiny"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_TRUE(absl::StrContains(text.out, absl::StrCat("(", first_file, " bytes) from storage, reused "))) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, absl::StrCat("(", changed, " bytes) of unchanged files"))) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, "reloaded 'tiny' generation 3")) << text.out;
}

TEST(GenerationsE2E, ReloadOfAnUnknownNameIsNotFound) {
  DaemonProcess d;
  CommandResult reload = d.Ctl({"reload", "nope"});
  EXPECT_EQ(reload.code, 2);
  EXPECT_TRUE(absl::StrContains(reload.err, "no model named 'nope'")) << reload.err;
}


// ------------------------------------------------------------ the writer path

// The inode of the mapping holding `address` in this process (/proc/self/maps).
std::string InodeOfMapping(const void* address) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  uintptr_t a = reinterpret_cast<uintptr_t>(address);
  while (std::getline(maps, line)) {
    unsigned long start = 0, end = 0;
    char perms[8], offset[32], dev[32];
    unsigned long inode = 0;
    if (sscanf(line.c_str(), "%lx-%lx %7s %31s %31s %lu", &start, &end, perms, offset, dev, &inode) == 6 &&
        a >= start && a < end) {
      return std::to_string(inode);
    }
  }
  return "";
}

template <typename F>
bool WaitUntil(F condition, double seconds) {
  auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (condition()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return condition();
}

json Models(const DaemonProcess& d) {
  CommandResult r = d.Ctl({"ls", "--json"});
  EXPECT_EQ(r.code, 0) << r.err;
  return json::parse(r.out)["models"];
}

std::string Bytes(const MappedModel& m, const std::string& name) {
  const TensorView* v = m.Find(name);
  return v == nullptr ? "<missing>" : std::string(static_cast<const char*>(v->data), v->nbytes);
}

class WriterE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = d_.models_dir() + "/tiny";
    ASSERT_EQ(testing::RunCommand({testing::WeightctlBinary(), "make-demo", dir_}).code, 0);
    CommandResult load = d_.Ctl({"load", "tiny", "tiny"});
    ASSERT_EQ(load.code, 0) << load.err;
    baseline_memfds_ = MemfdInodes(d_.pid()).size();
  }
  std::unique_ptr<Client> Connect() {
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(d_.socket());
    EXPECT_TRUE(c.ok()) << c.status();
    return std::move(*c);
  }
  DaemonProcess d_;
  std::string dir_;
  size_t baseline_memfds_ = 0;
};

// The end-to-end case: a reader keeps generation 1 while another
// process writes 10% of the tensors and commits; a new attach sees exactly
// those changed, every other tensor byte-identical and on generation 1's
// pages; the watch stream saw it; generation 1 goes when the reader leaves.
TEST_F(WriterE2E, ReaderKeepsItsGenerationWhileAWriterPublishesTheNext) {
  testing::Process watch(d_.CtlArgv({"watch", "tiny", "--json"}), d_.dir().path());
  // The watch has subscribed once it printed CURRENT (generation 1); a
  // commit before that would reach it as CURRENT of generation 2, never as
  // PUBLISHED (under load the watch process can start after the commit).
  ASSERT_TRUE(WaitUntil([&] { return absl::StrContains(watch.Stdout(), "\"CURRENT\""); }, 10)) << watch.Stdout();
  std::unique_ptr<Client> client = Connect();
  absl::StatusOr<MappedModel> reader = client->Attach("tiny", 0);
  ASSERT_TRUE(reader.ok()) << reader.status();
  const auto& infos = reader->manifest().tensors;
  ASSERT_EQ(infos.size(), 21u);
  // 10% of the tensors: the first two in layout order, with new bytes.
  testing::SafetensorsBuilder update;
  std::vector<std::string> written = {infos[0].name, infos[1].name};
  std::map<std::string, std::string> before, fresh;
  for (const auto& info : infos) before[info.name] = Bytes(*reader, info.name);
  for (size_t i = 0; i < 2; ++i) {
    fresh[infos[i].name] = testing::Bytes(infos[i].nbytes, 1000 + i);
    update.Add(infos[i].name, infos[i].dtype, infos[i].full_shape, fresh[infos[i].name]);
  }
  std::string update_dir = d_.dir().Join("update");
  mkdir(update_dir.c_str(), 0755);
  testing::WriteFile(update_dir + "/model.safetensors", update.Build());

  CommandResult commit = d_.Ctl({"update", "tiny", "--from", update_dir, "--version-label", "step-1200", "--json"});
  ASSERT_EQ(commit.code, 0) << commit.err;
  json c = json::parse(commit.out);
  EXPECT_EQ(c["generation"], reader->manifest().generation + 1);
  EXPECT_EQ(c["version_label"], "step-1200");
  EXPECT_EQ(c["tensors_changed"], 2);

  // The reader still sees generation 1's bytes, all of them.
  for (const auto& info : infos) EXPECT_EQ(Bytes(*reader, info.name), before[info.name]) << info.name;
  // A new attach sees generation 2: the written tensors changed, the rest identical and shared.
  absl::StatusOr<MappedModel> next = client->Attach("tiny", 0);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->manifest().generation, reader->manifest().generation + 1);
  int shared = 0;
  for (const auto& info : infos) {
    bool is_written = fresh.count(info.name) != 0;
    EXPECT_EQ(Bytes(*next, info.name), is_written ? fresh[info.name] : before[info.name]) << info.name;
    std::string old_inode = InodeOfMapping(reader->Find(info.name)->data);
    std::string new_inode = InodeOfMapping(next->Find(info.name)->data);
    if (is_written) {
      EXPECT_NE(new_inode, old_inode) << info.name;
    } else if (new_inode == old_inode) {
      ++shared;
    }
    EXPECT_EQ(next->Find(info.name)->info->content_hash,
              ContentHashHex(TensorContentHash(static_cast<const char*>(next->Find(info.name)->data), info.nbytes)));
  }
  // Exactly the tensors outside the staged segment (the written tensors'
  // segment: tiny's first file) are on generation 1's very pages.
  int outside = 0;
  for (const auto& info : infos) outside += info.segment != infos[0].segment;
  EXPECT_EQ(infos[1].segment, infos[0].segment);
  EXPECT_GT(outside, 0);
  EXPECT_EQ(shared, outside);
  json models = Models(d_);
  ASSERT_EQ(models.size(), 2u);  // generation 2 READY, generation 1 DRAINING under the reader
  EXPECT_EQ(models[0]["version_label"], "step-1200");
  EXPECT_EQ(models[1]["state"], "DRAINING");

  // The watch stream delivered the publication with its label.
  EXPECT_TRUE(WaitUntil([&] { return absl::StrContains(watch.Stdout(), "\"PUBLISHED\""); }, 5)) << watch.Stdout();
  EXPECT_TRUE(absl::StrContains(watch.Stdout(), "step-1200")) << watch.Stdout();

  // Generation 1 is freed when its reader leaves.
  *reader = std::move(*next);
  EXPECT_TRUE(WaitUntil([&] { return Models(d_).size() == 1; }, 5));
  EXPECT_TRUE(WaitUntil([&] { return absl::StrContains(watch.Stdout(), "\"FREED\""); }, 5)) << watch.Stdout();
  watch.Signal(SIGTERM);
  watch.Wait();
}

TEST_F(WriterE2E, AWriterKilledMidUpdateLeavesTheGenerationServedAndNothingBehind) {
  json before = Models(d_)[0];
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // the writer: stage, scribble over a tensor, then wait to be killed
    close(ready[0]);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Connect(d_.socket());
    if (!c.ok()) _exit(1);
    absl::StatusOr<Updater> u = (*c)->BeginUpdate("tiny");
    if (!u.ok()) _exit(2);
    for (const WritableTensor& t : u->tensors()) memset(t.data, 0x5a, t.info.nbytes);
    (void)!write(ready[1], "x", 1);
    pause();
    _exit(0);
  }
  close(ready[1]);
  char byte = 0;
  ASSERT_EQ(read(ready[0], &byte, 1), 1);
  close(ready[0]);
  EXPECT_GT(MemfdInodes(d_.pid()).size(), baseline_memfds_);  // the staged copies
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  // The daemon notices the closed fd-socket connection and frees what was staged.
  EXPECT_TRUE(WaitUntil([&] { return MemfdInodes(d_.pid()).size() == baseline_memfds_; }, 5));
  json after = Models(d_);
  ASSERT_EQ(after.size(), 1u);
  EXPECT_EQ(after[0]["generation"], before["generation"]);
  EXPECT_EQ(after[0]["fingerprint"], before["fingerprint"]);
  EXPECT_EQ(d_.Ctl({"attach", "tiny", "--verify", dir_}).code, 0);
  EXPECT_TRUE(WaitUntil([&] { return absl::StrContains(d_.process().Stderr(), "aborted: writer_disconnected"); }, 5));
  // The name is free for the next writer.
  std::unique_ptr<Client> client = Connect();
  absl::StatusOr<Updater> next = client->BeginUpdate("tiny", {});
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_TRUE(next->Abort().ok());
}

TEST_F(WriterE2E, AWrongExpectedHashRefusesTheCommitNamingTheTensor) {
  std::unique_ptr<Client> client = Connect();
  absl::StatusOr<MappedModel> model = client->Attach("tiny", 0);
  ASSERT_TRUE(model.ok());
  std::string name = model->manifest().tensors[3].name;
  absl::StatusOr<Updater> u = client->BeginUpdate("tiny", {name});
  ASSERT_TRUE(u.ok()) << u.status();
  WritableTensor* w = u->Find(name);
  ASSERT_NE(w, nullptr);
  memset(w->data, 7, w->info.nbytes);
  absl::StatusOr<CommitInfo> commit = u->Commit({{name, "0123456789abcdef"}}, "bad");
  ASSERT_EQ(commit.status().code(), absl::StatusCode::kFailedPrecondition);
  std::string actual = ContentHashHex(TensorContentHash(std::string(w->info.nbytes, 7).data(), w->info.nbytes));
  EXPECT_EQ(commit.status().message(), absl::StrCat("tensor '", name, "' has content hash ", actual,
                                                     " but the writer expected 0123456789abcdef; the update is aborted"));
  json models = Models(d_);
  ASSERT_EQ(models.size(), 1u);
  EXPECT_EQ(models[0]["generation"], model->manifest().generation);
  EXPECT_TRUE(WaitUntil([&] { return MemfdInodes(d_.pid()).size() == baseline_memfds_; }, 5));
}

TEST_F(WriterE2E, OneWriterPerModelAndUnloadAbortsTheUpdate) {
  std::unique_ptr<Client> client = Connect();
  absl::StatusOr<Updater> first = client->BeginUpdate("tiny", {});
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<Updater> second = client->BeginUpdate("tiny", {});
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(second.status().message(), "model 'tiny' already has an open update (one writer per model at a time)");
  ASSERT_EQ(d_.Ctl({"unload", "tiny"}).code, 0);
  absl::StatusOr<CommitInfo> commit = first->Commit();
  EXPECT_EQ(commit.status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(Models(d_).empty());
  EXPECT_TRUE(WaitUntil([&] { return MemfdInodes(d_.pid()).empty(); }, 5));
}

TEST_F(WriterE2E, ABytesChangedOutsideTheNamedTensorsRefusesTheCommit) {
  std::unique_ptr<Client> client = Connect();
  absl::StatusOr<MappedModel> model = client->Attach("tiny", 0);
  ASSERT_TRUE(model.ok());
  const auto& infos = model->manifest().tensors;
  // Two tensors of the same host segment; the update names only the first.
  const TensorInfo* a = &infos[0];
  const TensorInfo* b = nullptr;
  for (const auto& t : infos) {
    if (&t != a && t.segment == a->segment && t.nbytes > 0) b = &t;
  }
  ASSERT_NE(b, nullptr);
  absl::StatusOr<Updater> u = client->BeginUpdate("tiny", {a->name});
  ASSERT_TRUE(u.ok()) << u.status();
  WritableTensor* w = u->Find(a->name);
  char* segment_base = w->data - w->info.offset;  // the writer's mapping of the whole staged segment
  segment_base[b->offset] ^= 0x1;
  absl::StatusOr<CommitInfo> commit = u->Commit();
  ASSERT_EQ(commit.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(commit.status().message(), absl::StrCat("tensor '", b->name, "' changed but is not in this update")))
      << commit.status();
  EXPECT_EQ(Models(d_)[0]["generation"], model->manifest().generation);
}

TEST_F(WriterE2E, AReloadAfterAnUpdateReadsTheFilesTheWriterChanged) {
  std::unique_ptr<Client> client = Connect();
  absl::StatusOr<MappedModel> model = client->Attach("tiny", 0);
  ASSERT_TRUE(model.ok());
  const std::string name = model->manifest().tensors[0].name;
  const std::string fingerprint = model->manifest().fingerprint;
  {
    absl::StatusOr<Updater> u = client->BeginUpdate("tiny", {name});
    ASSERT_TRUE(u.ok());
    memset(u->Find(name)->data, 1, u->Find(name)->info.nbytes);
    ASSERT_TRUE(u->Commit().ok());
  }
  // While the lease holds generation 1 (DRAINING), its segments still hold
  // the file's bytes: a reload shares them (server/load/shared_segments.h)
  // and reads nothing.
  CommandResult held = d_.Ctl({"reload", "tiny", "--json"});
  ASSERT_EQ(held.code, 0) << held.err;
  json h = json::parse(held.out);
  EXPECT_EQ(h["bytes_read"].get<uint64_t>(), 0u) << h.dump();
  EXPECT_EQ(h["fingerprint"], fingerprint);
  EXPECT_EQ(d_.Ctl({"attach", "tiny", "--verify", dir_}).code, 0);
  // Once it is gone, the disk is the only source of the file's bytes. An
  // update again, then a reload: the updated file is read (its segment holds
  // the writer's bytes, never shared as the file's) and the other shared.
  model = absl::CancelledError("detached");
  ASSERT_TRUE(testing::WaitFor([&] { return Models(d_).size() == 1; }, std::chrono::seconds(10))) << Models(d_).dump();
  {
    absl::StatusOr<Updater> u = client->BeginUpdate("tiny", {name});
    ASSERT_TRUE(u.ok()) << u.status();
    memset(u->Find(name)->data, 2, u->Find(name)->info.nbytes);
    ASSERT_TRUE(u->Commit().ok());
  }
  ASSERT_TRUE(testing::WaitFor([&] { return Models(d_).size() == 1; }, std::chrono::seconds(10))) << Models(d_).dump();
  CommandResult reload = d_.Ctl({"reload", "tiny", "--json"});
  ASSERT_EQ(reload.code, 0) << reload.err;
  json r = json::parse(reload.out);
  EXPECT_GT(r["bytes_read"].get<uint64_t>(), 0u);
  EXPECT_GT(r["bytes_reused"].get<uint64_t>(), 0u);
  EXPECT_EQ(r["fingerprint"], fingerprint);  // the checkpoint's bytes again
  EXPECT_EQ(d_.Ctl({"attach", "tiny", "--verify", dir_}).code, 0);
}
}  // namespace
}  // namespace weightd
