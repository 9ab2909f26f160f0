// HostSegment: a memfd filled once, then sealed so nobody can change it.
#include "common/memory/host_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

constexpr uint64_t kSize = 3 * 4096 + 17;  // not a page multiple on purpose

// Byte i of the test pattern.
char Pattern(uint64_t i) { return static_cast<char>((i * 131 + 7) & 0xFF); }

// A segment of kSize bytes filled with Pattern() and sealed.
std::unique_ptr<HostSegment> SealedSegment(bool lock) {
  absl::StatusOr<std::unique_ptr<HostSegment>> segment = HostSegment::Create("test-segment", kSize);
  if (!segment.ok()) return nullptr;
  for (uint64_t i = 0; i < kSize; ++i) (*segment)->writable()[i] = Pattern(i);
  if (!(*segment)->Seal(lock).ok()) return nullptr;
  return std::move(*segment);
}

TEST(HostSegment, CreateGivesWritableMappingOfTheRequestedSize) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("fresh", kSize));
  EXPECT_EQ(segment->size(), kSize);
  ASSERT_NE(segment->writable(), nullptr);
  EXPECT_EQ(segment->data(), segment->writable());
  EXPECT_FALSE(segment->sealed());
  EXPECT_EQ(lseek(segment->fd(), 0, SEEK_END), static_cast<off_t>(kSize));
  EXPECT_EQ(fcntl(segment->fd(), F_GET_SEALS), 0);
}

TEST(HostSegment, SealedSegmentHoldsTheBytesWritten) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  EXPECT_TRUE(segment->sealed());
  EXPECT_EQ(segment->writable(), nullptr);
  ASSERT_NE(segment->data(), nullptr);
  for (uint64_t i = 0; i < kSize; ++i) ASSERT_EQ(segment->data()[i], Pattern(i)) << "byte " << i;
  // What a client sees through the fd, too.
  std::string via_fd(kSize, '\0');
  ASSERT_EQ(pread(segment->fd(), via_fd.data(), kSize, 0), static_cast<ssize_t>(kSize));
  EXPECT_EQ(via_fd, std::string(segment->data(), kSize));
}

TEST(HostSegment, SealedSegmentRefusesWrites) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  errno = 0;
  EXPECT_EQ(pwrite(segment->fd(), "x", 1, 0), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(write(segment->fd(), "x", 1), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(segment->data()[0], Pattern(0));
}

TEST(HostSegment, SealedSegmentRefusesWritableSharedMapping) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  errno = 0;
  void* map = mmap(nullptr, kSize, PROT_READ | PROT_WRITE, MAP_SHARED, segment->fd(), 0);
  EXPECT_EQ(map, MAP_FAILED);
  EXPECT_EQ(errno, EPERM);
  if (map != MAP_FAILED) munmap(map, kSize);
}

TEST(HostSegment, SealedSegmentAllowsReadOnlySharedMapping) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  void* map = mmap(nullptr, kSize, PROT_READ, MAP_SHARED, segment->fd(), 0);
  ASSERT_NE(map, MAP_FAILED) << std::strerror(errno);
  EXPECT_EQ(std::memcmp(map, segment->data(), kSize), 0);
  munmap(map, kSize);
}

TEST(HostSegment, CopyOnWriteMappingOfSealedSegmentKeepsWritesPrivate) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(char* mine, MapSegmentFd(segment->fd(), kSize, /*copy_on_write=*/true));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(char* other, MapSegmentFd(segment->fd(), kSize, /*copy_on_write=*/true));
  mine[4096 + 5] = 'W';  // copies page 1 into this mapping only
  EXPECT_EQ(mine[4096 + 5], 'W');
  EXPECT_EQ(other[4096 + 5], Pattern(4096 + 5));
  EXPECT_EQ(segment->data()[4096 + 5], Pattern(4096 + 5));
  char via_fd = 0;
  ASSERT_EQ(pread(segment->fd(), &via_fd, 1, 4096 + 5), 1);
  EXPECT_EQ(via_fd, Pattern(4096 + 5));
  EXPECT_EQ(mine[0], Pattern(0));  // untouched pages still read the segment
  munmap(mine, kSize);
  munmap(other, kSize);
}

TEST(HostSegment, SealedSegmentRefusesResize) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  errno = 0;
  EXPECT_EQ(ftruncate(segment->fd(), kSize + 4096), -1);
  EXPECT_EQ(errno, EPERM);
  errno = 0;
  EXPECT_EQ(ftruncate(segment->fd(), 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(lseek(segment->fd(), 0, SEEK_END), static_cast<off_t>(kSize));
}

TEST(HostSegment, SealedSegmentCarriesAllFourSeals) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  EXPECT_EQ(fcntl(segment->fd(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
  // F_SEAL_SEAL: nobody can add (or, by construction, remove) seals later.
  errno = 0;
  EXPECT_EQ(fcntl(segment->fd(), F_ADD_SEALS, F_SEAL_FUTURE_WRITE), -1);
  EXPECT_EQ(errno, EPERM);
}

TEST(HostSegment, SealTwiceIsFailedPrecondition) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  EXPECT_THAT(segment->Seal(false), StatusIs(absl::StatusCode::kFailedPrecondition, "already sealed"));
  EXPECT_EQ(segment->data()[kSize - 1], Pattern(kSize - 1));
}

TEST(HostSegment, ZeroSizeSegmentCreatesAndSeals) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("empty", 0));
  EXPECT_EQ(segment->size(), 0u);
  EXPECT_EQ(segment->writable(), nullptr);
  WEIGHTD_ASSERT_OK(segment->Seal(/*lock=*/true));
  EXPECT_TRUE(segment->sealed());
  EXPECT_EQ(segment->data(), nullptr);
  EXPECT_FALSE(segment->locked());
  EXPECT_EQ(segment->lock_errno(), 0);
  EXPECT_EQ(fcntl(segment->fd(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
}

TEST(HostSegment, FdIsNamedAfterTheSegment) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("llama:host", 64));
  char target[256] = {};
  std::string link = "/proc/self/fd/" + std::to_string(segment->fd());
  ssize_t n = readlink(link.c_str(), target, sizeof(target) - 1);
  ASSERT_GT(n, 0) << std::strerror(errno);
  std::string name(target, static_cast<size_t>(n));
  EXPECT_EQ(name.rfind("/memfd:weightd:", 0), 0u) << name;
  EXPECT_EQ(name.rfind("/memfd:weightd:llama:host", 0), 0u) << name;
}

TEST(HostSegment, FdIsCloseOnExec) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("cloexec", 64));
  EXPECT_EQ(fcntl(segment->fd(), F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
}

TEST(HostSegment, LockedOrReportsWhyNot) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/true);
  ASSERT_NE(segment, nullptr);
  // Exactly one of the two: mlock took, or its errno is kept.
  EXPECT_NE(segment->locked(), segment->lock_errno() != 0)
      << "locked=" << segment->locked() << " lock_errno=" << segment->lock_errno();
}

TEST(HostSegment, NoLockRequestedLeavesSegmentUnlocked) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  EXPECT_FALSE(segment->locked());
  EXPECT_EQ(segment->lock_errno(), 0);
}

TEST(HostSegment, WriteFillsThroughTheFileAndSealKeepsTheBytes) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("write", kSize));
  std::string pattern(kSize, '\0');
  for (uint64_t i = 0; i < kSize; ++i) pattern[i] = Pattern(i);
  // Two writes meeting in the middle of a page.
  WEIGHTD_ASSERT_OK(segment->Write(0, pattern.data(), 5000));
  WEIGHTD_ASSERT_OK(segment->Write(5000, pattern.data() + 5000, kSize - 5000));
  WEIGHTD_ASSERT_OK(segment->Seal(/*lock=*/false));
  EXPECT_EQ(std::string(segment->data(), kSize), pattern);
  EXPECT_EQ(fcntl(segment->fd(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
}

TEST(HostSegment, WritePastTheEndOrAfterSealIsRefused) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("bounds", kSize));
  EXPECT_THAT(segment->Write(kSize - 1, "ab", 2),
              StatusIs(absl::StatusCode::kOutOfRange, "write of 2 bytes at 12304 past a 12305-byte segment"));
  WEIGHTD_ASSERT_OK(segment->Seal(/*lock=*/false));
  EXPECT_THAT(segment->Write(0, "a", 1), StatusIs(absl::StatusCode::kFailedPrecondition, "already sealed"));
}

// Asked for pool pages, a segment gets them when the pool grants them
// (size rounded up to whole 2 MiB pages), else the choice's fall-back; it
// works the same either way.
TEST(HostSegment, HugetlbWhenThePoolGrantsItElseTheFallback) {
  const uint64_t size = kHugeSegmentMinBytes + 4096 + 3;
  const bool pool_has_room = ReadHugePageSystem().hugetlb_free_bytes >= 2 * kHugePageBytes;
  PageChoice pages{PageKind::kHugetlb, PageKind::kSmall, false, ""};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("huge", size, pages));
  if (segment->page_kind() == PageKind::kHugetlb) {
    EXPECT_EQ(segment->size(), 2 * kHugePageBytes);
    EXPECT_EQ(segment->huge_bytes(), 2 * kHugePageBytes);
  } else {
    EXPECT_FALSE(pool_has_room) << "the pool had room but the segment did not get it";
    EXPECT_EQ(segment->page_kind(), PageKind::kSmall);
    EXPECT_EQ(segment->size(), size);
    EXPECT_EQ(segment->huge_bytes(), 0u);
  }
  WEIGHTD_ASSERT_OK(segment->Write(size - 3, "xyz", 3));
  WEIGHTD_ASSERT_OK(segment->Seal(/*lock=*/false));
  EXPECT_EQ(std::string(segment->data() + size - 3, 3), "xyz");
}

// A THP segment is filled through its mapping: populated, then written in
// place. Whether the pages come out huge is the kernel's (shmem_enabled);
// the bytes are the same either way.
TEST(HostSegment, ThpSegmentIsPopulatedAndFilledThroughItsMapping) {
  const uint64_t size = 2 * kHugePageBytes + 4096 + 5;
  PageChoice pages{PageKind::kShmemThp, PageKind::kShmemThp, true, ""};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("thp", size, pages));
  EXPECT_EQ(segment->page_kind(), PageKind::kShmemThp);
  EXPECT_EQ(segment->size(), size);  // THP does not round the memfd
  absl::StatusOr<uint64_t> populated = segment->Populate(kHugePageBytes - 1, kHugePageBytes + 2);
  if (!absl::IsUnimplemented(populated.status())) {  // kernels before 5.14 lack it
    WEIGHTD_ASSERT_OK(populated.status());
    EXPECT_EQ(*populated, 2 * kHugePageBytes + 8192);  // the whole 2 MiB pages it touched, clamped to the end
  }
  for (uint64_t i = 0; i < size; ++i) segment->writable()[i] = Pattern(i);
  segment->AvoidHugePages();  // the stall fall-back: later pages small; the bytes stay
  WEIGHTD_ASSERT_OK(segment->Write(size - 2, "ok", 2));
  WEIGHTD_ASSERT_OK(segment->Seal(/*lock=*/false));
  std::string expected(size, '\0');
  for (uint64_t i = 0; i < size; ++i) expected[i] = Pattern(i);
  expected.replace(size - 2, 2, "ok");
  EXPECT_EQ(std::string(segment->data(), size), expected);
  EXPECT_EQ(segment->huge_bytes(), 0u);  // nobody measured it (the loader does, from smaps)
}

TEST(HostSegment, PopulatePastTheEndOrAfterSealIsRefused) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("populate", kSize));
  EXPECT_THAT(segment->Populate(kSize - 1, 2).status(),
              StatusIs(absl::StatusCode::kOutOfRange, "populate of 2 bytes at 12304 past a 12305-byte segment"));
  WEIGHTD_ASSERT_OK(segment->Seal(/*lock=*/false));
  EXPECT_THAT(segment->Populate(0, 1).status(), StatusIs(absl::StatusCode::kFailedPrecondition, "already sealed"));
}

// Pinning after the seal, as the registry's pinning thread does: it takes
// or keeps its errno, once, and the bytes stay.
TEST(HostSegment, PinAfterSealLocksOnceOrReportsWhyNot) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/false);
  ASSERT_NE(segment, nullptr);
  EXPECT_FALSE(segment->locked());
  bool pinned = segment->Pin();
  EXPECT_EQ(pinned, segment->locked());
  EXPECT_NE(segment->locked(), segment->lock_errno() != 0);
  EXPECT_EQ(segment->Pin(), pinned);  // idempotent
  for (uint64_t i = 0; i < kSize; ++i) ASSERT_EQ(segment->data()[i], Pattern(i)) << i;
}

// Shutdown drops the page tables while the daemon still answers: the bytes
// stay in the memfd and fault back in, and a later Pin() locks again.
TEST(HostSegment, DropPageTablesKeepsTheBytesAndUnlocks) {
  std::unique_ptr<HostSegment> segment = SealedSegment(/*lock=*/true);
  ASSERT_NE(segment, nullptr);
  const bool pinned = segment->locked();
  EXPECT_EQ(segment->DropPageTables(), kSize);
  EXPECT_FALSE(segment->locked());
  for (uint64_t i = 0; i < kSize; ++i) ASSERT_EQ(segment->data()[i], Pattern(i)) << i;
  EXPECT_EQ(segment->DropPageTables(), kSize);  // again: nothing mapped in but the reads above, no harm
  EXPECT_EQ(segment->Pin(), pinned);            // locks again where it could before
  EXPECT_EQ(segment->locked(), pinned);
  for (uint64_t i = 0; i < kSize; ++i) ASSERT_EQ(segment->data()[i], Pattern(i)) << i;
}

TEST(HostSegment, DropPageTablesBeforeSealDoesNothing) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("early", kSize));
  segment->writable()[5] = 'x';
  EXPECT_EQ(segment->DropPageTables(), 0u);
  EXPECT_EQ(segment->writable()[5], 'x');
}

TEST(HostSegment, PinBeforeSealDoesNothing) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("early", kSize));
  EXPECT_FALSE(segment->Pin());
  EXPECT_FALSE(segment->locked());
  EXPECT_EQ(segment->lock_errno(), 0);
}

}  // namespace
}  // namespace weightd
