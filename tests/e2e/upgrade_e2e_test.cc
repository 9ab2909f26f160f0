// In-place upgrades to a binary that cannot run, outside any service manager
// (where a daemon that exits loses every model): the daemon refuses what it
// can tell before it stops (a script, a truncated ELF, another machine's
// ELF) and keeps serving; when the exec fails all the same (the new file
// still open for writing: ETXTBSY) it comes back on its running image with
// every model and weightctl says the upgrade failed. Before, each of these
// stopped the daemon, failed execve and exited: every model was lost and
// weightctl waited out its timeout.
#include <elf.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/base/scoped_fd.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "tests/testing/shared_inputs.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A daemon started from its own copy of the weightd binary (<tmp>/bin/weightd),
// so a test can replace the file an upgrade executes.
class UpgradeE2E : public ::testing::Test {
 protected:
  void SetUp() override {
    mkdir(dir_.Join("bin").c_str(), 0755);
    mkdir(dir_.Join("models").c_str(), 0755);
    binary_ = dir_.Join("bin/weightd");
    image_ = ReadAll(testing::WeightdBinary());
    ASSERT_GT(image_.size(), 1u << 20);
    Replace(image_);
    socket_ = dir_.Join("w.sock");
    daemon_ = std::make_unique<testing::Process>(
        std::vector<std::string>{binary_, "--socket", socket_, "--model-root", dir_.Join("models"),
                                 "--metrics-address", "", "--device-backend", "emulated", "--mlock", "false"},
        dir_.path());
    ASSERT_TRUE(testing::WaitFor([&] { return Ctl({"ls"}).code == 0; }, std::chrono::seconds(20))) << daemon_->Stderr();
    ASSERT_EQ(Ctl({"make-demo", dir_.Join("models/tiny"), "--preset", "tiny"}).code, 0);
    CommandResult load = Ctl({"load", "tiny", dir_.Join("models/tiny")});
    ASSERT_EQ(load.code, 0) << load.err;
    before_ = Models();
    ASSERT_EQ(before_.size(), 1u);
  }

  // Puts `bytes` at the binary's path as a new file (rename over it, as a
  // package manager does: the running image keeps its own inode).
  void Replace(const std::string& bytes, mode_t mode = 0755) {
    std::string tmp = binary_ + ".new";
    testing::WriteFile(tmp, bytes);
    ASSERT_EQ(chmod(tmp.c_str(), mode), 0);
    ASSERT_EQ(rename(tmp.c_str(), binary_.c_str()), 0);
  }

  CommandResult Ctl(const std::vector<std::string>& args) const {
    std::vector<std::string> argv = {testing::WeightctlBinary(), "--socket", socket_};
    argv.insert(argv.end(), args.begin(), args.end());
    return testing::RunCommand(argv);
  }
  // name -> {generation, state, fingerprint}, and the daemon instance.
  std::map<std::string, json> Models() {
    CommandResult r = Ctl({"ls", "--json"});
    EXPECT_EQ(r.code, 0) << r.err;
    std::map<std::string, json> out;
    json doc = json::parse(r.out);
    for (const json& m : doc["models"]) {
      out[m["name"]] = {{"generation", m["generation"]}, {"state", m["state"]}, {"fingerprint", m["fingerprint"]}};
    }
    return out;
  }
  void ExpectRefused(const std::string& why) {
    CommandResult up = Ctl({"upgrade", "--timeout", "10"});
    EXPECT_EQ(up.code, 2) << up.out << up.err;
    EXPECT_EQ(up.err, absl::StrCat("weightctl: cannot upgrade in place: ", binary_, " ", why, "\n"));
    EXPECT_TRUE(daemon_->Running());
    EXPECT_EQ(Models(), before_);
    EXPECT_FALSE(absl::StrContains(daemon_->Stderr(), "upgrading in place: stopping")) << daemon_->Stderr();
  }

  testing::TempDir dir_;
  std::string binary_, socket_, image_;
  std::unique_ptr<testing::Process> daemon_;
  std::map<std::string, json> before_;
};

TEST_F(UpgradeE2E, AScriptWithoutAnInterpreterIsRefusedAndTheDaemonKeepsServing) {
  Replace("echo this is not weightd\n");
  ExpectRefused("is not an ELF executable (execve(2) would fail with ENOEXEC)");
}

TEST_F(UpgradeE2E, ATruncatedElfIsRefusedAndTheDaemonKeepsServing) {
  // Cut inside the last loaded segment (the debug sections after it do not
  // stop an exec): the copy a failed download or a full disk leaves.
  Elf64_Ehdr header;
  memcpy(&header, image_.data(), sizeof header);
  uint64_t loaded_end = 0;
  for (int i = 0; i < header.e_phnum; ++i) {
    Elf64_Phdr ph;
    memcpy(&ph, image_.data() + header.e_phoff + i * sizeof ph, sizeof ph);
    if (ph.p_type == PT_LOAD) loaded_end = std::max<uint64_t>(loaded_end, ph.p_offset + ph.p_filesz);
  }
  ASSERT_GT(loaded_end, 4096u);
  size_t cut = static_cast<size_t>(loaded_end - 1);
  Replace(image_.substr(0, cut));
  CommandResult up = Ctl({"upgrade", "--timeout", "10"});
  EXPECT_EQ(up.code, 2) << up.out << up.err;
  EXPECT_TRUE(absl::StrContains(up.err, absl::StrCat("cannot upgrade in place: ", binary_, " is truncated: a segment ends at byte ")))
      << up.err;
  EXPECT_TRUE(absl::StrContains(up.err, absl::StrCat(" of a ", cut, "-byte file"))) << up.err;
  EXPECT_TRUE(daemon_->Running());
  EXPECT_EQ(Models(), before_);
}

TEST_F(UpgradeE2E, AnElfForAnotherMachineIsRefused) {
  std::string foreign = image_;
  Elf64_Ehdr header;
  memcpy(&header, foreign.data(), sizeof header);
  uint16_t other = header.e_machine == EM_AARCH64 ? EM_X86_64 : EM_AARCH64;
  memcpy(foreign.data() + offsetof(Elf64_Ehdr, e_machine), &other, sizeof other);
  Replace(foreign);
  ExpectRefused(absl::StrCat("is an ELF file for another machine (class 2, byte order 1, e_machine ", other,
                             "; this one runs e_machine ", header.e_machine, ")"));
}

TEST_F(UpgradeE2E, ANonExecutableFileIsRefused) {
  Replace(image_, 0644);
  ExpectRefused("is not executable");
}

TEST_F(UpgradeE2E, AnExecThatFailsAnywayComesBackOnTheRunningImageWithEveryModel) {
  Replace(image_);
  ScopedFd writer(open(binary_.c_str(), O_WRONLY | O_CLOEXEC));  // execve now fails with ETXTBSY
  ASSERT_TRUE(writer.valid());
  pid_t pid = daemon_->pid();
  CommandResult up = Ctl({"upgrade", "--timeout", "20"});
  EXPECT_EQ(up.code, 1) << up.out << up.err;
  EXPECT_EQ(up.err, absl::StrCat("weightctl: the upgrade to ", binary_, " failed (execve ", binary_,
                                 ": Text file busy); the daemon is serving again on its running binary\n"));
  EXPECT_TRUE(daemon_->Running());
  EXPECT_EQ(daemon_->pid(), pid);
  EXPECT_EQ(Models(), before_);
  CommandResult verify = Ctl({"attach", "tiny", "--verify", dir_.Join("models/tiny"), "--json"});
  ASSERT_EQ(verify.code, 0) << verify.err;
  EXPECT_EQ(json::parse(verify.out)["verified"], true);
  std::string log = daemon_->Stderr();
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("in-place upgrade failed: execve ", binary_,
                                                  ": Text file busy; executing the running image")))
      << log;
  EXPECT_TRUE(absl::StrContains(log, "started again on the running binary: the in-place upgrade failed")) << log;

  // Once the file is complete, the same upgrade goes through; `ls --json`
  // names the new image's instance, the one `upgrade --json` reported.
  writer.Reset();
  std::string instance = json::parse(Ctl({"ls", "--json"}).out)["daemon_instance"];
  EXPECT_EQ(instance.size(), 16u) << instance;
  CommandResult again = Ctl({"upgrade", "--json"});
  ASSERT_EQ(again.code, 0) << again.err;
  json upgraded = json::parse(again.out);
  EXPECT_EQ(upgraded["models"].size(), 1u);
  EXPECT_NE(upgraded["daemon_instance"], instance);
  EXPECT_EQ(json::parse(Ctl({"ls", "--json"}).out)["daemon_instance"], upgraded["daemon_instance"]);
  EXPECT_EQ(Models(), before_);
}

}  // namespace
}  // namespace weightd
