// ModelRoots: the --model-root rule on open files (issue 12).
#include "common/io/model_roots.h"

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

TEST(PathUnder, RootItselfAndBelowButNotASiblingSharingThePrefix) {
  EXPECT_TRUE(PathUnder("/models", "/models"));
  EXPECT_TRUE(PathUnder("/models/a/b.safetensors", "/models"));
  EXPECT_FALSE(PathUnder("/models-evil/b.safetensors", "/models"));
  EXPECT_FALSE(PathUnder("/etc/passwd", "/models"));
  EXPECT_TRUE(PathUnder("/etc/passwd", "/"));
}

TEST(ModelRoots, ChecksWhereTheOpenFileLiesNotItsPath) {
  TempDir root, outside;
  WriteFile(outside.Join("secret"), "SECRET!!");
  WriteFile(root.Join("inside"), "weights");
  ASSERT_EQ(symlink(outside.Join("secret").c_str(), root.Join("out").c_str()), 0);
  ASSERT_EQ(symlink("inside", root.Join("in").c_str()), 0);
  ModelRoots roots = ModelRoots::Resolve(*Env::Default(), {root.path(), "/no/such/root"});
  EXPECT_EQ(roots.Describe(), root.path() + ", /no/such/root");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<RandomAccessFile> in, Env::Default()->OpenForRead(root.Join("in")));
  WEIGHTD_EXPECT_OK(roots.Check(*in, "in"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<RandomAccessFile> out, Env::Default()->OpenForRead(root.Join("out")));
  EXPECT_EQ(roots.Check(*out, "out"),
            absl::PermissionDeniedError("out: resolves to " + RealPath(outside.Join("secret")) +
                                        ", outside every --model-root (" + root.path() + ", /no/such/root)"));
}

TEST(ModelRoots, NoRootsHoldNothing) {
  ModelRoots none;
  EXPECT_TRUE(none.empty());
  EXPECT_FALSE(none.Contains("/"));
}

// Regression (review of issue 12): --model-root / (or a symlink to it)
// passed every file, so the containment rule was silently off.
TEST(ModelRoots, TheWholeFileSystemIsNoModelRoot) {
  testing::TempDir dir;
  ASSERT_EQ(symlink("/", dir.Join("slash").c_str()), 0);
  std::vector<std::string> warnings;
  EXPECT_EQ(ModelRoots::Validate(*Env::Default(), {"/"}, &warnings),
            absl::InvalidArgumentError("--model-root / resolves to /: the whole file system cannot be a model root"));
  EXPECT_EQ(ModelRoots::Validate(*Env::Default(), {dir.path(), dir.Join("slash")}, &warnings).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ModelRoots::Validate(*Env::Default(), {""}, &warnings),
            absl::InvalidArgumentError("--model-root must not be empty"));
  EXPECT_TRUE(warnings.empty());
}

TEST(ModelRoots, AMissingRootIsAllowedWithAWarning) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("file"), "x");
  std::vector<std::string> warnings;
  WEIGHTD_EXPECT_OK(ModelRoots::Validate(*Env::Default(), {dir.path(), dir.Join("later"), dir.Join("file")}, &warnings));
  ASSERT_EQ(warnings.size(), 2u);
  EXPECT_EQ(warnings[0].rfind("--model-root " + dir.Join("later") + " is not a directory now (", 0), 0u) << warnings[0];
  EXPECT_EQ(warnings[1], "--model-root " + dir.Join("file") +
                             " is not a directory now (not a folder): nothing under it can be loaded until it is");
}

}  // namespace
}  // namespace weightd
