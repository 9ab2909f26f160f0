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

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? buf : "";
}

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

}  // namespace
}  // namespace weightd
