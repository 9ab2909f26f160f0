// ModelRegistry loading: path resolution under model roots, name
// validation, catalog errors, reuse and generations, with checkpoints
// generated into temporary model roots. Leases: registry_lease_test.cc.
#include "server/registry/registry.h"

#include <fcntl.h>
#include <sys/stat.h>

#include "gtest/gtest.h"
#include "tests/server/registry/registry_fixture.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;
using ::weightd::testing::FileImage;
using ::weightd::registry_test::MakeDir;
using ::weightd::registry_test::RealPath;
using ::weightd::registry_test::RegistryTest;
using ::weightd::registry_test::Tensor;
using ::weightd::registry_test::Tensors;
using ::weightd::registry_test::WriteCheckpoint;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;
using Code = absl::StatusCode;

TEST_F(RegistryTest, LoadRecordsAlignedTensorsWithContentHashes) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto result, Load("tiny", Checkpoint("ck", 1)));
  const ModelGeneration& model = *result.model;
  EXPECT_FALSE(result.reused);
  EXPECT_EQ(model.generation, 1u);
  EXPECT_EQ(model.state.load(), ModelState::kReady);
  EXPECT_EQ(model.request.checkpoint_path, RealPath(root_.Join("ck")));
  EXPECT_EQ(model.tensor_count, 3u);
  EXPECT_EQ(model.host_bytes, 136u);  // 16 @0, 3 @64, 8 @128
  ASSERT_EQ(model.ranks.size(), 1u);
  ASSERT_EQ(model.ranks[0].tensors.size(), 3u);
  const std::vector<Tensor> expected = Tensors(1);
  const uint64_t offsets[] = {0, 64, 128};
  const char* data = model.host_segments.at(0)->data();
  for (size_t i = 0; i < 3; ++i) {
    const TensorRecord& r = model.ranks[0].tensors[i];
    EXPECT_EQ(r.name, expected[i].name);
    EXPECT_EQ(DTypeName(r.dtype), expected[i].dtype);
    EXPECT_EQ(r.shape, expected[i].shape);
    EXPECT_EQ(r.placement, Placement::kHost);
    EXPECT_EQ(r.offset, offsets[i]);
    EXPECT_EQ(r.nbytes, expected[i].data.size());
    EXPECT_EQ(r.content_hash, TensorContentHash(expected[i].data.data(), expected[i].data.size()));
    EXPECT_EQ(std::string(data + r.offset, r.nbytes), expected[i].data);
  }
  EXPECT_EQ(model.fingerprint.size(), 32u);
  EXPECT_EQ(model.fingerprint.find_first_not_of("0123456789abcdef"), std::string::npos) << model.fingerprint;
  EXPECT_THAT(listener_.serving(), ElementsAre(Pair("tiny", true)));
}

TEST_F(RegistryTest, FingerprintFollowsContentNotFiles) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto one_file, Load("one", Checkpoint("ck", 1)));
  std::vector<Tensor> t = Tensors(1);
  MakeDir(root_.Join("split"));
  WriteCheckpoint(root_.Join("split/x-00001.safetensors"), {t[0]});
  WriteCheckpoint(root_.Join("split/x-00002.safetensors"), {t[2], t[1]});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto two_files, Load("two", "split"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto other_values, Load("other", Checkpoint("ck2", 2)));
  EXPECT_EQ(two_files.model->fingerprint, one_file.model->fingerprint);
  EXPECT_NE(other_values.model->fingerprint, one_file.model->fingerprint);
}

TEST_F(RegistryTest, RelativePathResolvesUnderSecondRoot) {
  TempDir second;
  WriteCheckpoint(MakeDir(second.Join("ck")) + "/model.safetensors", Tensors(1));
  RegistryOptions options = Options();
  options.model_roots.push_back(second.path());
  ModelRegistry registry(options, nullptr);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto result, Load("m", "ck", &registry));
  EXPECT_EQ(result.model->request.checkpoint_path, RealPath(second.Join("ck")));
}

TEST_F(RegistryTest, PathOutsideRootsIsPermissionDenied) {
  TempDir outside;
  WriteCheckpoint(outside.Join("model.safetensors"), Tensors(1));
  EXPECT_THAT(Load("m", outside.path()), StatusIs(Code::kPermissionDenied, "outside every --model-root"));
  ASSERT_EQ(symlink(outside.path().c_str(), root_.Join("escape").c_str()), 0);
  EXPECT_THAT(Load("m", "escape"), StatusIs(Code::kPermissionDenied, "escape"));
  EXPECT_THAT(Load("m", root_.Join("escape/model.safetensors")), StatusIs(Code::kPermissionDenied, "outside"));
  EXPECT_TRUE(registry_.List().empty());
}

TEST_F(RegistryTest, SiblingFolderSharingRootPrefixIsPermissionDenied) {
  TempDir parent;
  RegistryOptions options = Options();
  options.model_roots = {MakeDir(parent.Join("models"))};
  ModelRegistry registry(options, nullptr);
  WriteCheckpoint(MakeDir(parent.Join("models-evil")) + "/model.safetensors", Tensors(1));
  EXPECT_THAT(Load("m", parent.Join("models-evil"), &registry), StatusIs(Code::kPermissionDenied, "models-evil"));
  EXPECT_THAT(Load("m", "../models-evil", &registry), StatusIs(Code::kPermissionDenied, "models-evil"));
  EXPECT_TRUE(registry.List().empty());
}

TEST_F(RegistryTest, SymlinkInsideRootIsAllowed) {
  Checkpoint("ck", 1);
  ASSERT_EQ(symlink(root_.Join("ck").c_str(), root_.Join("alias").c_str()), 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto result, Load("m", "alias"));
  EXPECT_EQ(result.model->request.checkpoint_path, RealPath(root_.Join("ck")));
}

TEST_F(RegistryTest, MissingOrEmptyPathOrNoRootsIsRefused) {
  EXPECT_THAT(Load("m", "no-such-model"), StatusIs(Code::kNotFound, "no-such-model"));
  EXPECT_THAT(Load("m", ""), StatusIs(Code::kInvalidArgument, "checkpoint path is empty"));
  ModelRegistry no_roots(RegistryOptions{}, nullptr);
  EXPECT_THAT(Load("m", Checkpoint("ck", 1), &no_roots), StatusIs(Code::kPermissionDenied, "no --model-root"));
}

TEST_F(RegistryTest, MalformedCheckpointIsInvalidArgumentAndLeavesNothing) {
  WriteFile(root_.Join("broken-shard.safetensors"), FileImage("{\"a\": {\"dtype\": ", ""));
  EXPECT_THAT(Load("m", "broken-shard.safetensors"), StatusIs(Code::kInvalidArgument, "broken-shard.safetensors"));
  EXPECT_TRUE(registry_.List().empty());
  EXPECT_EQ(listener_.failures().size(), 1u);
  EXPECT_TRUE(listener_.serving().empty());
}

TEST_F(RegistryTest, FailedReloadKeepsServingGeneration) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto good, Load("m", Checkpoint("ck", 1)));
  WriteFile(root_.Join("broken.safetensors"), FileImage("not json", ""));
  EXPECT_THAT(Load("m", "broken.safetensors"), StatusIs(Code::kInvalidArgument, "broken.safetensors"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto current, registry_.Get("m"));
  EXPECT_EQ(current, good.model);
  EXPECT_EQ(registry_.List().size(), 1u);
}

TEST(ModelName, ValidatesLengthAndCharacters) {
  WEIGHTD_EXPECT_OK(ValidateModelName("Llama-3.1_8B"));
  WEIGHTD_EXPECT_OK(ValidateModelName(std::string(128, 'a')));
  EXPECT_THAT(ValidateModelName(""), StatusIs(Code::kInvalidArgument, "1 to 128 characters, got 0"));
  EXPECT_THAT(ValidateModelName(std::string(129, 'a')), StatusIs(Code::kInvalidArgument, "got 129"));
  EXPECT_THAT(ValidateModelName("org/model"), StatusIs(Code::kInvalidArgument, "'org/model'"));
  EXPECT_THAT(ValidateModelName("a b"), StatusIs(Code::kInvalidArgument, "only letters"));
}

TEST_F(RegistryTest, InvalidNameIsRefusedBeforeLoading) {
  EXPECT_THAT(Load("org/model", Checkpoint("ck", 1)), StatusIs(Code::kInvalidArgument, "org/model"));
  EXPECT_THAT(Load("", "ck"), StatusIs(Code::kInvalidArgument, "model name"));
  EXPECT_TRUE(registry_.List().empty());
}

TEST_F(RegistryTest, SameNameAndUnchangedFilesReuseGeneration) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto first, Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto second, Load("m", "ck"));
  EXPECT_TRUE(second.reused);
  EXPECT_EQ(second.model, first.model);
  EXPECT_EQ(second.model->generation, 1u);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto other_name, Load("n", "ck"));
  EXPECT_FALSE(other_name.reused);
  EXPECT_EQ(other_name.model->generation, 2u);
}

TEST_F(RegistryTest, RewrittenCheckpointLoadsNewGeneration) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto first, Load("m", Checkpoint("ck", 1)));
  const std::string file = root_.Join("ck/model.safetensors");
  WriteCheckpoint(file, Tensors(9));
  struct stat st {};
  ASSERT_EQ(stat(file.c_str(), &st), 0);
  timespec times[2] = {st.st_atim, st.st_mtim};
  times[1].tv_sec += 5;
  ASSERT_EQ(utimensat(AT_FDCWD, file.c_str(), times, 0), 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto second, Load("m", "ck"));
  EXPECT_FALSE(second.reused);
  EXPECT_EQ(second.model->generation, 2u);
  EXPECT_NE(second.model->fingerprint, first.model->fingerprint);
  ASSERT_EQ(registry_.List().size(), 1u);  // the unleased old generation is freed
  EXPECT_EQ(registry_.List()[0], second.model);
}

}  // namespace
}  // namespace weightd
