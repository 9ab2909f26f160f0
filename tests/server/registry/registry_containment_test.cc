// ModelRegistry::Load reads a file only if the file actually opened lies
// under a --model-root (issue 12): symlinks leading out of every root are
// refused before a byte of their target is read; symlinks that stay inside a
// root (the Hugging Face cache layout) keep working.
#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "server/registry/registry.h"
#include "tests/server/registry/registry_fixture.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::registry_test::MakeDir;
using ::weightd::registry_test::RealPath;
using ::weightd::registry_test::RegistryTest;
using ::weightd::registry_test::Tensors;
using ::weightd::registry_test::WriteCheckpoint;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;
using Code = absl::StatusCode;

// The first 8 bytes of a file outside the roots that is not safetensors:
// read as a little-endian header length they would be 2387281934192690515.
constexpr char kSecret[] = "SECRET!!not a checkpoint";
constexpr char kSecretAsLength[] = "2387281934192690515";

class ContainmentTest : public RegistryTest {
 protected:
  std::string Outside(const std::string& message) const {
    return absl::StrCat("resolves to ", message, ", outside every --model-root (", root_.path(), ")");
  }
  TempDir outside_;
};

// Regression (issue 12): a folder without an index accepted `*.safetensors`
// symlinks to files anywhere, and echoed a non-checkpoint's first 8 bytes.
TEST_F(ContainmentTest, FolderEntryLinkingOutsideEveryRootIsRefusedUnread) {
  WriteFile(outside_.Join("secret"), kSecret);
  WriteCheckpoint(MakeDir(root_.Join("ck")) + "/a.safetensors", Tensors(1));
  ASSERT_EQ(symlink(outside_.Join("secret").c_str(), root_.Join("ck/b.safetensors").c_str()), 0);
  absl::StatusOr<ModelRegistry::LoadResult> result = Load("m", "ck");
  EXPECT_THAT(result, StatusIs(Code::kPermissionDenied,
                               absl::StrCat("b.safetensors: ", Outside(RealPath(outside_.Join("secret"))))));
  EXPECT_FALSE(absl::StrContains(result.status().message(), kSecretAsLength)) << result.status();
  EXPECT_TRUE(registry_.List().empty());
}

// Before issue 12 a valid checkpoint outside the roots was loaded and served.
TEST_F(ContainmentTest, FolderEntryLinkingToAValidCheckpointOutsideIsRefused) {
  WriteCheckpoint(outside_.Join("o.safetensors"), Tensors(2));
  MakeDir(root_.Join("ck"));
  ASSERT_EQ(symlink(outside_.Join("o.safetensors").c_str(), root_.Join("ck/model.safetensors").c_str()), 0);
  EXPECT_THAT(Load("m", "ck"), StatusIs(Code::kPermissionDenied,
                                        absl::StrCat("model.safetensors: ", Outside(RealPath(outside_.Join("o.safetensors"))))));
  EXPECT_TRUE(registry_.List().empty());
}

TEST_F(ContainmentTest, IndexLinkingOutsideEveryRootIsRefusedUnread) {
  WriteCheckpoint(MakeDir(root_.Join("ck")) + "/a.safetensors", Tensors(1));
  WriteFile(outside_.Join("index.json"), R"({"weight_map":{"a.weight":"a.safetensors"}})");
  ASSERT_EQ(symlink(outside_.Join("index.json").c_str(), root_.Join("ck/model.safetensors.index.json").c_str()), 0);
  EXPECT_THAT(Load("m", "ck"),
              StatusIs(Code::kPermissionDenied, absl::StrCat("model.safetensors.index.json: ",
                                                             Outside(RealPath(outside_.Join("index.json"))))));
}

TEST_F(ContainmentTest, DeviceLinkIsRefusedWithoutBlocking) {
  WriteCheckpoint(MakeDir(root_.Join("ck")) + "/a.safetensors", Tensors(1));
  ASSERT_EQ(symlink("/dev/zero", root_.Join("ck/b.safetensors").c_str()), 0);
  EXPECT_THAT(Load("m", "ck"), StatusIs(Code::kInvalidArgument, "b.safetensors: not a regular file"));
}

// The Hugging Face cache: models--org--name/snapshots/<rev>/<file> are
// relative symlinks to ../../blobs/<sha>, the index included.
TEST_F(ContainmentTest, HuggingFaceCacheLayoutLoads) {
  std::string repo = MakeDir(MakeDir(root_.Join("hub")) + "/models--org--tiny");
  MakeDir(repo + "/blobs");
  std::string snapshot = MakeDir(MakeDir(repo + "/snapshots") + "/0123abcd");
  WriteCheckpoint(repo + "/blobs/1111", Tensors(1));
  WriteFile(repo + "/blobs/2222",
            R"({"metadata":{"total_size":27},"weight_map":{"a.weight":"model-00001-of-00001.safetensors",)"
            R"("b.bias":"model-00001-of-00001.safetensors","c.scale":"model-00001-of-00001.safetensors"}})");
  ASSERT_EQ(symlink("../../blobs/1111", (snapshot + "/model-00001-of-00001.safetensors").c_str()), 0);
  ASSERT_EQ(symlink("../../blobs/2222", (snapshot + "/model.safetensors.index.json").c_str()), 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto result, Load("m", "hub/models--org--tiny/snapshots/0123abcd"));
  EXPECT_EQ(result.model->tensor_count, 3u);
  EXPECT_TRUE(result.model->warnings.empty());
  ASSERT_EQ(result.model->files.size(), 1u);
  EXPECT_EQ(result.model->files[0].stamp.name, "model-00001-of-00001.safetensors");
}

// A symlink that leaves the checkpoint folder but stays inside a root loads.
TEST_F(ContainmentTest, FolderEntryLinkingElsewhereInsideARootLoads) {
  WriteCheckpoint(MakeDir(root_.Join("store")) + "/x", Tensors(3));
  MakeDir(root_.Join("ck"));
  ASSERT_EQ(symlink("../store/x", root_.Join("ck/model.safetensors").c_str()), 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto result, Load("m", "ck"));
  EXPECT_EQ(result.model->tensor_count, 3u);
}

}  // namespace
}  // namespace weightd
