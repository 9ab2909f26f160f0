// The page-size choice of a load: every branch forced through a
// HugePageSystem of the test's own, whatever this machine allows.
#include "common/memory/huge_pages.h"

#include <string>

#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"

namespace weightd {
namespace {

using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;

constexpr uint64_t kMiB = 1 << 20;

TEST(ParseShmemEnabled, TakesTheBracketedWord) {
  EXPECT_EQ(ParseShmemEnabled("always within_size [advise] never deny force\n"), "advise");
  EXPECT_EQ(ParseShmemEnabled("always within_size advise [never] deny force\n"), "never");
  EXPECT_EQ(ParseShmemEnabled("[always] within_size advise never deny force"), "always");
  EXPECT_EQ(ParseShmemEnabled("always advise never"), "");
  EXPECT_EQ(ParseShmemEnabled(""), "");
}

TEST(ReadHugePageSystem, ReadsThePoolAndTheShmemSetting) {
  TempDir dir;
  WriteFile(dir.Join("meminfo"), "MemTotal: 100 kB\nHugePages_Total:      10\nHugePages_Free:       7\n"
                                 "Hugepagesize:       2048 kB\n");
  WriteFile(dir.Join("shmem_enabled"), "always within_size [advise] never deny force\n");
  HugePageSystem system = ReadHugePageSystem(dir.Join("meminfo"), dir.Join("shmem_enabled"));
  EXPECT_EQ(system.hugetlb_free_bytes, 14 * kMiB);
  EXPECT_EQ(system.shmem_thp, "advise");
}

// A default pool of 1 GiB pages is not what segments use: no hugetlb bytes.
TEST(ReadHugePageSystem, IgnoresAPoolOfOtherPageSizes) {
  TempDir dir;
  WriteFile(dir.Join("meminfo"), "HugePages_Free:       7\nHugepagesize:    1048576 kB\n");
  HugePageSystem system = ReadHugePageSystem(dir.Join("meminfo"), dir.Join("absent"));
  EXPECT_EQ(system.hugetlb_free_bytes, 0u);
  EXPECT_EQ(system.shmem_thp, "");
}

TEST(ChoosePages, PoolWithRoomForEverySegmentGivesHugetlb) {
  PageChoice choice = ChoosePages({100 * kMiB, "advise"}, 100 * kMiB, true);
  EXPECT_EQ(choice.kind, PageKind::kHugetlb);
  EXPECT_EQ(choice.fallback, PageKind::kShmemThp);  // a segment the pool then refuses
  EXPECT_TRUE(choice.advise);
  EXPECT_EQ(choice.reason, "hugetlb pool has 100 MiB free of the 100 MiB needed");
}

TEST(ChoosePages, PoolTooSmallFallsToThpWithAdvice) {
  PageChoice choice = ChoosePages({98 * kMiB, "advise"}, 100 * kMiB, true);
  EXPECT_EQ(choice.kind, PageKind::kShmemThp);
  EXPECT_TRUE(choice.advise);
  EXPECT_EQ(choice.reason, "hugetlb pool has 98 MiB free of the 100 MiB needed; shmem_enabled is advise");
}

TEST(ChoosePages, ThpWithoutAdviceWhenTheKernelGivesThemAnyway) {
  for (const char* word : {"within_size", "always", "force"}) {
    PageChoice choice = ChoosePages({0, word}, 100 * kMiB, true);
    EXPECT_EQ(choice.kind, PageKind::kShmemThp) << word;
    EXPECT_FALSE(choice.advise) << word;
  }
}

TEST(ChoosePages, NeitherAllowedGivesSmallPagesAndSaysHowToAllow) {
  for (const char* word : {"never", "deny", ""}) {
    PageChoice choice = ChoosePages({0, word}, 100 * kMiB, true);
    EXPECT_EQ(choice.kind, PageKind::kSmall) << word;
    EXPECT_EQ(choice.fallback, PageKind::kSmall) << word;
  }
  EXPECT_EQ(ChoosePages({0, "never"}, 100 * kMiB, true).reason,
            "hugetlb pool has 0 MiB free of the 100 MiB needed; shmem_enabled is never (allow huge pages: sysctl "
            "vm.nr_hugepages, or shmem_enabled advise)");
  EXPECT_EQ(ChoosePages({0, ""}, 0, true).reason,
            "hugetlb pool has 0 MiB free of the 0 MiB needed; shmem_enabled is unreadable (allow huge pages: sysctl "
            "vm.nr_hugepages, or shmem_enabled advise)");
}

// No segment big enough for the pool: nothing is asked of it, even when it is free.
TEST(ChoosePages, NothingNeededFromThePoolIsNotHugetlb) {
  EXPECT_EQ(ChoosePages({100 * kMiB, "never"}, 0, true).kind, PageKind::kSmall);
}

TEST(ChoosePages, TurnedOffAlwaysGivesSmallPages) {
  PageChoice choice = ChoosePages({100 * kMiB, "always"}, 10 * kMiB, false);
  EXPECT_EQ(choice.kind, PageKind::kSmall);
  EXPECT_EQ(choice.fallback, PageKind::kSmall);
  EXPECT_EQ(choice.reason, "huge pages are turned off (--huge-pages false)");
}

}  // namespace
}  // namespace weightd
