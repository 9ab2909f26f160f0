// End-to-end (issue 12): a real weightd and real weightctl processes. A
// checkpoint file that is a symlink out of every --model-root is refused with
// exit status 2 and one line naming the file and the rule; the Hugging Face
// cache layout (relative symlinks into ../../blobs) loads and inspects.
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"

namespace weightd {
namespace {

using testing::CommandResult;
using testing::DaemonProcess;
using testing::SafetensorsBuilder;
using testing::WriteFile;

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? buf : "";
}

std::string Roots(const DaemonProcess& d) {
  std::string roots = d.models_dir();
  if (auto shared = testing::SharedDir()) absl::StrAppend(&roots, ", ", *shared);
  return roots;
}

TEST(ContainmentE2E, LinkOutOfEveryRootIsRefusedWithOneLineAndStatus2) {
  DaemonProcess d;
  WriteFile(d.dir().Join("secret"), "SECRET!!not a checkpoint");  // beside models/, outside every root
  ASSERT_EQ(mkdir((d.models_dir() + "/leak").c_str(), 0755), 0);
  ASSERT_EQ(symlink(d.dir().Join("secret").c_str(), (d.models_dir() + "/leak/a.safetensors").c_str()), 0);
  CommandResult r = d.Ctl({"load", "leak", "leak"});
  EXPECT_EQ(r.code, 2);
  EXPECT_EQ(r.err, absl::StrCat("weightctl: a.safetensors: resolves to ", RealPath(d.dir().Join("secret")),
                                ", outside every --model-root (", Roots(d), ")\n"));
  CommandResult ls = d.Ctl({"ls"});
  EXPECT_EQ(ls.code, 0) << ls.err;
  EXPECT_EQ(ls.out.find("leak"), std::string::npos) << ls.out;
}

TEST(ContainmentE2E, HuggingFaceCacheLayoutLoadsAndInspects) {
  DaemonProcess d;
  std::string repo = d.models_dir() + "/models--org--tiny";
  for (const std::string& dir : {repo, repo + "/blobs", repo + "/snapshots", repo + "/snapshots/abc123"}) {
    ASSERT_EQ(mkdir(dir.c_str(), 0755), 0) << dir;
  }
  WriteFile(repo + "/blobs/aaaa", SafetensorsBuilder().Add("w", "U8", {4}, "wxyz").Build());
  WriteFile(repo + "/blobs/bbbb", R"({"weight_map":{"w":"model-00001-of-00001.safetensors"}})");
  ASSERT_EQ(symlink("../../blobs/aaaa", (repo + "/snapshots/abc123/model-00001-of-00001.safetensors").c_str()), 0);
  ASSERT_EQ(symlink("../../blobs/bbbb", (repo + "/snapshots/abc123/model.safetensors.index.json").c_str()), 0);
  CommandResult load = d.Ctl({"load", "tiny", "models--org--tiny/snapshots/abc123"});
  EXPECT_EQ(load.code, 0) << load.err;
  CommandResult inspect = testing::RunCommand({testing::WeightctlBinary(), "inspect", repo + "/snapshots/abc123"});
  EXPECT_EQ(inspect.code, 0) << inspect.err;
}

}  // namespace
}  // namespace weightd
