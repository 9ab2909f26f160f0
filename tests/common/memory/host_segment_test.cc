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

// Locking ranges while filling keeps a read-only mapping alive across the
// seal; F_SEAL_WRITE must still take, and the lock must cover everything.
TEST(HostSegment, LockWhileFillingThenSealLocksOrReportsWhyNot) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment, HostSegment::Create("lock-fill", kSize));
  std::string pattern(kSize, '\0');
  for (uint64_t i = 0; i < kSize; ++i) pattern[i] = Pattern(i);
  for (uint64_t at = 0; at < kSize; at += 3000) {
    uint64_t n = std::min<uint64_t>(3000, kSize - at);
    WEIGHTD_ASSERT_OK(segment->Write(at, pattern.data() + at, n));
    segment->Lock(at, n);
  }
  WEIGHTD_ASSERT_OK(segment->Seal(/*lock=*/true));
  EXPECT_EQ(fcntl(segment->fd(), F_GET_SEALS), F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
  EXPECT_EQ(std::string(segment->data(), kSize), pattern);
  EXPECT_NE(segment->locked(), segment->lock_errno() != 0);
}

// Without a huge page pool (or with one) the segment works the same; with
// huge pages its size is rounded up to whole 2 MiB pages.
TEST(HostSegment, HugePagesWhenPoolAllowsFallsBackCleanly) {
  const uint64_t size = kHugeSegmentMinBytes + 4096 + 3;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> segment,
                               HostSegment::Create("huge", size, HugePages::kWhenPoolAllows));
  EXPECT_EQ(segment->size(), segment->huge_pages() ? (size + (2u << 20) - 1) / (2u << 20) * (2u << 20) : size);
  WEIGHTD_ASSERT_OK(segment->Write(size - 3, "xyz", 3));
  WEIGHTD_ASSERT_OK(segment->Seal(/*lock=*/false));
  EXPECT_EQ(std::string(segment->data() + size - 3, 3), "xyz");
}

}  // namespace
}  // namespace weightd
