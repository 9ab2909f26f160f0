// PathLock: one holder per "<path>.lock", released when the holder goes.
#include "server/path_lock.h"

#include "gtest/gtest.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::TempDir;

TEST(PathLock, SecondHolderIsRefusedNamingPathLockAndFlag) {
  TempDir dir;
  std::string path = dir.Join("w.fd.sock");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PathLock first, PathLock::Acquire(path, "--fd-socket"));
  EXPECT_EQ(first.path(), path);
  absl::StatusOr<PathLock> second = PathLock::Acquire(path, "--fd-socket");
  EXPECT_EQ(second.status(),
            absl::FailedPreconditionError("another weightd is serving " + path + " (it holds " + path +
                                          ".lock); stop it first or use another --fd-socket"));
}

TEST(PathLock, ReleasedWhenTheHolderIsDestroyed) {
  TempDir dir;
  std::string path = dir.Join("w.sock");
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(PathLock first, PathLock::Acquire(path, "--socket"));
  }
  EXPECT_TRUE(PathLock::Acquire(path, "--socket").ok());
}

TEST(PathLock, UnwritableFolderIsTheOpenError) {
  EXPECT_EQ(PathLock::Acquire("/nonexistent-dir/w.sock", "--socket").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace weightd
