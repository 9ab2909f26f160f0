// PathLock: one holder per "<path>.lock", released when the holder goes.
#include "server/path_lock.h"

#include <sys/stat.h>
#include <unistd.h>

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

// Regression (review of issue 12): a symlink at "<path>.lock" made a root
// daemon create a file wherever it pointed.
TEST(PathLock, ASymlinkAtTheLockPathIsNotFollowed) {
  TempDir dir;
  std::string target = dir.Join("elsewhere");
  ASSERT_EQ(symlink(target.c_str(), dir.Join("w.sock.lock").c_str()), 0);
  EXPECT_EQ(PathLock::Acquire(dir.Join("w.sock"), "--socket").status(),
            absl::FailedPreconditionError(dir.Join("w.sock.lock") + ": is a symbolic link; refusing to follow it"));
  EXPECT_NE(access(target.c_str(), F_OK), 0) << "the symlink's target was created";
  ASSERT_EQ(mkdir(dir.Join("d.sock.lock").c_str(), 0700), 0);
  EXPECT_EQ(PathLock::Acquire(dir.Join("d.sock"), "--socket").status(),
            absl::InvalidArgumentError("open " + dir.Join("d.sock.lock") + ": Is a directory"));
}

TEST(PathLock, UnwritableFolderIsTheOpenError) {
  EXPECT_EQ(PathLock::Acquire("/nonexistent-dir/w.sock", "--socket").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace weightd
