// PosixEnv's open files (issue 12): only regular files are opened for
// reading, and an open file tells where it lies and stays the file opened
// whatever its path names later.
#include "common/io/env.h"

#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <cstdlib>

#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;

using ::weightd::testing::RealPath;

class PosixEnvTest : public ::testing::Test {
 protected:
  absl::Status OpenStatus(const std::string& path) { return Env::Default()->OpenForRead(path).status(); }
  TempDir dir_;
};

TEST_F(PosixEnvTest, RefusesAFifoWithoutBlockingNamingItsKind) {
  ASSERT_EQ(mkfifo(dir_.Join("f").c_str(), 0644), 0);
  EXPECT_EQ(OpenStatus(dir_.Join("f")), absl::InvalidArgumentError(dir_.Join("f") + ": not a regular file (FIFO)"));
}

TEST_F(PosixEnvTest, RefusesDirectoriesAndDevicesNamingTheirKind) {
  EXPECT_EQ(OpenStatus(dir_.path()), absl::InvalidArgumentError(dir_.path() + ": not a regular file (directory)"));
  ASSERT_EQ(symlink("/dev/zero", dir_.Join("z").c_str()), 0);
  EXPECT_EQ(OpenStatus(dir_.Join("z")), absl::InvalidArgumentError(dir_.Join("z") + ": not a regular file (character device)"));
}

TEST_F(PosixEnvTest, ResolvedPathIsWhereTheOpenedFileLies) {
  ASSERT_EQ(mkdir(dir_.Join("blobs").c_str(), 0755), 0);
  WriteFile(dir_.Join("blobs/1111"), "data");
  ASSERT_EQ(symlink("blobs/1111", dir_.Join("link").c_str()), 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<RandomAccessFile> file, Env::Default()->OpenForRead(dir_.Join("link")));
  EXPECT_EQ(file->path(), dir_.Join("link"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string resolved, file->ResolvedPath());
  EXPECT_EQ(resolved, RealPath(dir_.Join("blobs/1111")));
  ASSERT_EQ(rename(dir_.Join("blobs/1111").c_str(), dir_.Join("moved").c_str()), 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(resolved, file->ResolvedPath());
  EXPECT_EQ(resolved, RealPath(dir_.Join("moved")));
  ASSERT_EQ(unlink(dir_.Join("moved").c_str()), 0);
  EXPECT_THAT(file->ResolvedPath(), StatusIs(absl::StatusCode::kFailedPrecondition, " (moved or deleted meanwhile)"));
}

// The file opened is read, not whatever its path names later.
TEST_F(PosixEnvTest, OpenFileIsReadAfterItsPathIsReplaced) {
  WriteFile(dir_.Join("a"), "original");
  WriteFile(dir_.Join("b"), "replaced");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<RandomAccessFile> file, Env::Default()->OpenForRead(dir_.Join("a")));
  ASSERT_EQ(rename(dir_.Join("b").c_str(), dir_.Join("a").c_str()), 0);
  std::string got(8, '\0');
  WEIGHTD_ASSERT_OK(file->ReadAt(0, 8, got.data()));
  EXPECT_EQ(got, "original");
}

TEST_F(PosixEnvTest, CurrentSizeSeesATruncationSinceOpen) {
  WriteFile(dir_.Join("a"), "0123456789");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<RandomAccessFile> file, Env::Default()->OpenForRead(dir_.Join("a")));
  ASSERT_EQ(truncate(dir_.Join("a").c_str(), 4), 0);
  EXPECT_EQ(file->size(), 10u);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(uint64_t now, file->CurrentSize());
  EXPECT_EQ(now, 4u);
}

}  // namespace
}  // namespace weightd
