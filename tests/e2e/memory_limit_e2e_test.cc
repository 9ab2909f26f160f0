// Memory admission under a real cgroup limit: a weightd moved into a memory
// cgroup this test creates refuses a load above the cgroup's limit (instead
// of being OOM-killed with every model it holds) and still takes one that
// fits. Skips with the reason where this machine does not let the test
// create a memory cgroup (no root, read-only cgroupfs, controller not
// delegated); it changes no machine setting, only a cgroup of its own.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/io/host_memory.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"

namespace weightd {
namespace {

constexpr uint64_t kLimitBytes = 96ull << 20;

bool WriteText(const std::string& path, const std::string& text) {
  int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  return ok;
}

// A child memory cgroup of this process's own, removed on destruction once
// its processes are gone. `skip` says why none could be made.
class TestCgroup {
 public:
  TestCgroup() {
    absl::StatusOr<std::vector<MemoryCgroup>> levels = FindMemoryCgroups();
    if (!levels.ok() || levels->empty()) {
      skip_ = "no memory cgroup is visible to this process";
      return;
    }
    version_ = (*levels)[0].version;
    dir_ = absl::StrCat((*levels)[0].dir, "/weightd-test-", getpid());
    if (mkdir(dir_.c_str(), 0755) != 0) {
      skip_ = absl::StrCat("cannot create a memory cgroup at ", dir_, ": ", strerror(errno));
      dir_.clear();
      return;
    }
    std::string limit = dir_ + (version_ == 2 ? "/memory.max" : "/memory.limit_in_bytes");
    if (!WriteText(limit, std::to_string(kLimitBytes))) {
      skip_ = absl::StrCat("cannot set ", limit, " (memory controller not delegated here?): ", strerror(errno));
    }
  }
  ~TestCgroup() {
    if (dir_.empty()) return;
    for (int i = 0; i < 100 && rmdir(dir_.c_str()) != 0 && errno == EBUSY; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  const std::string& skip() const { return skip_; }
  int version() const { return version_; }
  bool Adopt(pid_t pid) const { return WriteText(dir_ + "/cgroup.procs", std::to_string(pid)); }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_, skip_;
  int version_ = 0;
};

std::string OneTensor(uint64_t bytes) {
  return testing::SafetensorsBuilder().Add("table", "U8", {bytes}, std::string(bytes, '\x5a')).Build();
}

TEST(MemoryLimit, ALoadAboveTheCgroupLimitIsRefusedAndTheDaemonLives) {
  TestCgroup cgroup;
  if (!cgroup.skip().empty()) GTEST_SKIP() << cgroup.skip();
  testing::DaemonProcess d;
  ASSERT_TRUE(cgroup.Adopt(d.pid())) << "cannot move weightd into " << cgroup.dir() << ": " << strerror(errno);
  testing::WriteFile(d.models_dir() + "/big.safetensors", OneTensor(128ull << 20));
  testing::WriteFile(d.models_dir() + "/small.safetensors", OneTensor(16ull << 20));

  testing::CommandResult big = d.Ctl({"load", "big", d.models_dir() + "/big.safetensors"});
  EXPECT_EQ(big.code, 2) << big.err;
  EXPECT_NE(big.err.find("the host-resident tensors need 134217728 bytes of host memory but only "), std::string::npos)
      << big.err;
  EXPECT_NE(big.err.find(absl::StrCat("by cgroup v", cgroup.version(), " ", cgroup.dir(), ": limit ", kLimitBytes)),
            std::string::npos)
      << big.err;

  ASSERT_TRUE(d.process().Running()) << "weightd died (OOM-killed?): " << d.process().Stderr();
  testing::CommandResult small = d.Ctl({"load", "small", d.models_dir() + "/small.safetensors"});
  EXPECT_EQ(small.code, 0) << small.err;
  EXPECT_EQ(d.Ctl({"attach", "small", "--verify", d.models_dir() + "/small.safetensors"}).code, 0);
  EXPECT_EQ(d.Stop(), 0);
}

}  // namespace
}  // namespace weightd
