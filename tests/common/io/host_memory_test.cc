#include "common/io/host_memory.h"

#include <sys/stat.h>

#include "absl/strings/str_cat.h"
#include "common/io/proc_files.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {


// A fake /proc and /sys under a temporary folder.
class FakeKernel {
 public:
  FakeKernel() {
    paths_.meminfo = dir_.Join("meminfo");
    paths_.self_cgroup = dir_.Join("cgroup");
    paths_.self_mountinfo = dir_.Join("mountinfo");
    paths_.sys_root = dir_.path();
    Write("meminfo", "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\nHugePages_Free:        3\n");
  }
  const HostMemoryPaths& paths() const { return paths_; }
  std::string Sys(const std::string& rel) const { return dir_.Join("sys") + rel; }
  void Write(const std::string& rel, const std::string& text) const {
    std::string path = dir_.Join(rel);
    for (size_t slash = path.find('/', dir_.path().size() + 1); slash != std::string::npos;
         slash = path.find('/', slash + 1)) {
      mkdir(path.substr(0, slash).c_str(), 0755);
    }
    testing::WriteFile(path, text);
  }
  // Limit, usage and inactive file bytes of one cgroup folder below sys/.
  void Cgroup(int version, const std::string& rel, const std::string& limit, uint64_t usage, uint64_t inactive) const {
    std::string d = "sys" + rel;
    Write(d + (version == 2 ? "/memory.max" : "/memory.limit_in_bytes"), limit + "\n");
    Write(d + (version == 2 ? "/memory.current" : "/memory.usage_in_bytes"), std::to_string(usage) + "\n");
    Write(d + "/memory.stat", absl::StrCat("anon 5\n", version == 2 ? "inactive_file " : "total_inactive_file ",
                                           inactive, "\nactive_file 7\n"));
  }

 private:
  testing::TempDir dir_;
  HostMemoryPaths paths_;
};

constexpr char kV2Mountinfo[] =
    "22 1 0:21 / /proc rw - proc proc rw\n"
    "30 22 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";
constexpr char kV1Mountinfo[] =
    "30 22 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n"
    "31 22 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    "32 22 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n";

TEST(ProcFiles, MeminfoValuesAreBytesForKbAndCountsOtherwise) {
  auto values = ParseMeminfo("MemAvailable:   2048 kB\nHugePages_Free:  7\nbroken line\nX: y kB\n");
  EXPECT_EQ(values.size(), 2u);
  EXPECT_EQ(values["MemAvailable"], 2048u * 1024);
  EXPECT_EQ(values["HugePages_Free"], 7u);
}

TEST(ProcFiles, SmapsFieldIsBytesByMappingStart) {
  constexpr char kSmaps[] =
      "7f0000000000-7f0004000000 rw-s 00000000 00:01 12 /memfd:weightd:m:host0 (deleted)\n"
      "Size:              65536 kB\n"
      "ShmemPmdMapped:    63488 kB\n"
      "VmFlags: rd wr sh mr mw me ms hg\n"
      "7f0004000000-7f0004001000 r--p 00000000 08:01 99 /usr/lib/libc.so.6\n"
      "Size:                  4 kB\n"
      "ShmemPmdMapped:        0 kB\n"
      "55d000000000-55d000001000 rw-p 00000000 00:00 0 [heap]\n"
      "Size:                  4 kB\n";
  std::map<uint64_t, uint64_t> pmd = ParseSmapsField(kSmaps, "ShmemPmdMapped");
  EXPECT_EQ(pmd, (std::map<uint64_t, uint64_t>{{0x7f0000000000, 63488ull * 1024}, {0x7f0004000000, 0}}));
  EXPECT_EQ(ParseSmapsField(kSmaps, "Size").at(0x55d000000000), 4096u);
  EXPECT_TRUE(ParseSmapsField("ShmemPmdMapped: 4 kB\n", "ShmemPmdMapped").empty());  // no mapping line before it
}

TEST(ProcFiles, PseudoFileLargerThanItsBoundIsRefused) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("f"), std::string(5000, 'x'));
  EXPECT_THAT(ReadPseudoFile(dir.Join("f"), 4999), StatusIs(absl::StatusCode::kInvalidArgument, "holds more than 4999 bytes"));
  EXPECT_EQ(ReadPseudoFile(dir.Join("f"), 5000).value().size(), 5000u);
  EXPECT_THAT(ReadPseudoFile(dir.Join("none")), StatusIs(absl::StatusCode::kNotFound, "none: open"));
}

TEST(HostMemory, WithoutACgroupLimitMemAvailableBounds) {
  FakeKernel k;
  k.Write("cgroup", "0::/\n");
  k.Write("mountinfo", kV2Mountinfo);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(HostMemoryBudget budget, ReadHostMemoryBudget(k.paths()));
  EXPECT_EQ(budget.available, 20000000ull * 1024);
  EXPECT_EQ(budget.source, "MemAvailable");
}

TEST(HostMemory, V2LimitMinusWorkingSetBoundsAndTheTightestLevelWins) {
  FakeKernel k;
  k.Write("cgroup", "0::/kubepods/pod1/ctr\n");
  k.Write("mountinfo", kV2Mountinfo);
  k.Cgroup(2, "/fs/cgroup/kubepods/pod1/ctr", "max", 100, 0);
  // The pod: limit 1000, usage 700 of which 300 is clean page cache -> 600 left.
  k.Cgroup(2, "/fs/cgroup/kubepods/pod1", "1000", 700, 300);
  k.Cgroup(2, "/fs/cgroup/kubepods", "5000", 1000, 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(HostMemoryBudget budget, ReadHostMemoryBudget(k.paths()));
  EXPECT_EQ(budget.available, 600u);
  EXPECT_EQ(budget.source, "cgroup v2 " + k.Sys("/fs/cgroup/kubepods/pod1") + ": limit 1000, working set 400");
}

TEST(HostMemory, V1MemoryControllerIsUsedOnAHybridSystem) {
  FakeKernel k;
  k.Write("cgroup", "5:cpu:/\n4:memory:/jobs/a\n0::/\n");
  k.Write("mountinfo", kV1Mountinfo);
  k.Cgroup(1, "/fs/cgroup/memory/jobs/a", "104857600", 4096, 0);
  k.Cgroup(1, "/fs/cgroup/memory/jobs", "9223372036854771712", 1 << 20, 0);  // "no limit"
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::vector<MemoryCgroup> levels, FindMemoryCgroups(k.paths()));
  ASSERT_EQ(levels.size(), 3u);
  EXPECT_EQ(levels[0].version, 1);
  EXPECT_EQ(levels[0].dir, k.Sys("/fs/cgroup/memory/jobs/a"));
  EXPECT_EQ(levels[2].dir, k.Sys("/fs/cgroup/memory"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(HostMemoryBudget budget, ReadHostMemoryBudget(k.paths()));
  EXPECT_EQ(budget.available, 104857600u - 4096u);
}

TEST(HostMemory, AMountedSubtreeMapsTheOwnPathBelowItsRoot) {
  // A container without a cgroup namespace: /proc/self/cgroup shows the host's
  // path, and the mount shows only the container's subtree.
  FakeKernel k;
  k.Write("cgroup", "0::/docker/abc\n");
  k.Write("mountinfo", "40 22 0:26 /docker/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n");
  k.Cgroup(2, "/fs/cgroup", "2048", 1024, 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::vector<MemoryCgroup> levels, FindMemoryCgroups(k.paths()));
  ASSERT_EQ(levels.size(), 1u);
  EXPECT_EQ(levels[0].dir, k.Sys("/fs/cgroup"));
  EXPECT_EQ(ReadHostMemoryBudget(k.paths()).value().available, 1024u);
}

TEST(HostMemory, EscapedMountPointsAreDecoded) {
  FakeKernel k;
  k.Write("cgroup", "0::/x\n");
  k.Write("mountinfo", "30 22 0:26 / /sys/my\\040cgroups rw - cgroup2 cgroup2 rw\n");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::vector<MemoryCgroup> levels, FindMemoryCgroups(k.paths()));
  ASSERT_EQ(levels.size(), 2u);
  EXPECT_EQ(levels[0].dir, k.Sys("/my cgroups/x"));
}

TEST(HostMemory, UsageAboveTheLimitLeavesNothing) {
  FakeKernel k;
  k.Write("cgroup", "0::/a\n");
  k.Write("mountinfo", kV2Mountinfo);
  k.Cgroup(2, "/fs/cgroup/a", "1000", 1500, 0);
  EXPECT_EQ(ReadHostMemoryBudget(k.paths()).value().available, 0u);
}

TEST(HostMemory, UnreadableCgroupFilesAreSkippedAndMissingMeminfoIsAnError) {
  FakeKernel k;
  k.Write("cgroup", "0::/a\n");
  k.Write("mountinfo", kV2Mountinfo);
  k.Write("sys/fs/cgroup/a/memory.max", "garbage\n");
  k.Write("sys/fs/cgroup/a/memory.current", "10\n");
  EXPECT_EQ(ReadHostMemoryBudget(k.paths()).value().source, "MemAvailable");
  HostMemoryPaths no_meminfo = k.paths();
  no_meminfo.meminfo += ".absent";
  EXPECT_THAT(ReadHostMemoryBudget(no_meminfo), StatusIs(absl::StatusCode::kNotFound, "no MemAvailable line"));
}

TEST(HostMemory, ThisMachineHasABudget) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(HostMemoryBudget budget, ReadHostMemoryBudget());
  EXPECT_GT(budget.available, 0u) << budget.source;
}

}  // namespace
}  // namespace weightd
