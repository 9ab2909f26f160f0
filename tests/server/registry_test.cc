// ModelRegistry: path resolution, load/reuse, generations and leases, with
// checkpoints generated into temporary model roots.
#include "server/registry.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <climits>
#include <thread>
#include <utility>

#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;
using ::weightd::testing::FileImage;
using ::weightd::testing::SafetensorsBuilder;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;
using Code = absl::StatusCode;

class RecordingListener : public RegistryListener {
 public:
  void OnModelServing(const std::string& name, bool serving) override {
    std::lock_guard<std::mutex> lock(mu_);
    serving_.emplace_back(name, serving);
  }
  void OnLoadFailed(const absl::Status& status) override {
    std::lock_guard<std::mutex> lock(mu_);
    failures_.push_back(status);
  }
  std::vector<std::pair<std::string, bool>> serving() {
    std::lock_guard<std::mutex> lock(mu_);
    return serving_;
  }
  size_t failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_.size();
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<std::string, bool>> serving_;
  std::vector<absl::Status> failures_;
};

struct Tensor {
  std::string name, dtype;
  std::vector<uint64_t> shape;
  std::string data;
};

// Three tensors of 16, 3 and 8 bytes whose bytes derive from `seed`.
std::vector<Tensor> Tensors(char seed) {
  auto bytes = [&](size_t n, int salt) {
    std::string s(n, '\0');
    for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(seed + salt * 17 + i * 3);
    return s;
  };
  return {{"a.weight", "F32", {2, 2}, bytes(16, 1)}, {"b.bias", "U8", {3}, bytes(3, 2)},
          {"c.scale", "F16", {4}, bytes(8, 3)}};
}

void WriteCheckpoint(const std::string& path, const std::vector<Tensor>& tensors) {
  SafetensorsBuilder builder;
  for (const Tensor& t : tensors) builder.Add(t.name, t.dtype, t.shape, t.data);
  WriteFile(path, builder.Build());
}

std::string MakeDir(const std::string& path) {
  mkdir(path.c_str(), 0755);
  return path;
}

std::string RealPath(const std::string& path) {
  char buf[PATH_MAX];
  return realpath(path.c_str(), buf) ? buf : "";
}

class RegistryTest : public ::testing::Test {
 protected:
  RegistryOptions Options(std::chrono::milliseconds claim_timeout = std::chrono::seconds(10)) {
    RegistryOptions options;
    options.model_roots = {root_.path()};
    options.loader.threads = 2;
    options.loader.mlock = false;
    options.claim_timeout = claim_timeout;
    return options;
  }
  absl::StatusOr<ModelRegistry::LoadResult> Load(const std::string& name, const std::string& path,
                                                 ModelRegistry* registry = nullptr) {
    LoadRequest request;
    request.name = name;
    request.checkpoint_path = path;
    return (registry ? registry : &registry_)->Load(request, nullptr);
  }
  // root/<name>/model.safetensors from Tensors(seed).
  std::string Checkpoint(const std::string& name, char seed) {
    WriteCheckpoint(MakeDir(root_.Join(name)) + "/model.safetensors", Tensors(seed));
    return name;
  }

  TempDir root_;
  RecordingListener listener_;
  ModelRegistry registry_{Options(), &listener_};
};

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

TEST_F(RegistryTest, MissingPathIsNotFound) {
  EXPECT_THAT(Load("m", "no-such-model"), StatusIs(Code::kNotFound, "no-such-model"));
  EXPECT_THAT(Load("m", ""), StatusIs(Code::kInvalidArgument, "checkpoint path is empty"));
}

TEST_F(RegistryTest, NoRootsConfiguredRefusesEveryPath) {
  ModelRegistry registry(RegistryOptions{}, nullptr);
  EXPECT_THAT(Load("m", Checkpoint("ck", 1), &registry), StatusIs(Code::kPermissionDenied, "no --model-root"));
}

TEST_F(RegistryTest, MalformedCheckpointIsInvalidArgumentAndLeavesNothing) {
  WriteFile(root_.Join("broken-shard.safetensors"), FileImage("{\"a\": {\"dtype\": ", ""));
  EXPECT_THAT(Load("m", "broken-shard.safetensors"), StatusIs(Code::kInvalidArgument, "broken-shard.safetensors"));
  EXPECT_TRUE(registry_.List().empty());
  EXPECT_EQ(listener_.failures(), 1u);
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

TEST_F(RegistryTest, LeaseLifecycleAttachClaimRelease) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::Grant grant, registry_.Attach("m", 0));
  EXPECT_EQ(grant.lease_id.size(), 32u);
  EXPECT_EQ(grant.lease_id.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_EQ(grant.model, loaded.model);
  EXPECT_EQ(grant.rank, 0u);
  EXPECT_EQ(loaded.model->leases.load(), 1);
  EXPECT_TRUE(registry_.IsLeaseLive(grant.lease_id));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::Grant claimed, registry_.Claim(grant.lease_id));
  EXPECT_EQ(claimed.model, loaded.model);
  EXPECT_THAT(registry_.Claim(grant.lease_id), StatusIs(Code::kFailedPrecondition, "already claimed"));
  registry_.Release(grant.lease_id);
  EXPECT_FALSE(registry_.IsLeaseLive(grant.lease_id));
  EXPECT_EQ(loaded.model->leases.load(), 0);
  EXPECT_THAT(registry_.Claim(grant.lease_id), StatusIs(Code::kNotFound, "unknown or expired"));
  EXPECT_THAT(registry_.Detach(grant.lease_id), StatusIs(Code::kNotFound, "unknown or expired"));
  EXPECT_THAT(registry_.Claim("0123456789abcdef0123456789abcdef"), StatusIs(Code::kNotFound, "lease"));
}

TEST_F(RegistryTest, UnloadWithLeasesDrainsUntilLastRelease) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto pending, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto active, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry_.Claim(active.lease_id));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_.Unload("m", /*force=*/false));
  EXPECT_FALSE(unloaded.freed);
  EXPECT_EQ(loaded.model->state.load(), ModelState::kDraining);
  ASSERT_EQ(registry_.List().size(), 1u);
  EXPECT_EQ(registry_.List()[0]->state.load(), ModelState::kDraining);
  EXPECT_THAT(registry_.Attach("m", 0), StatusIs(Code::kNotFound, "'m'"));
  registry_.Release(pending.lease_id);
  EXPECT_EQ(registry_.List().size(), 1u);
  WEIGHTD_EXPECT_OK(registry_.Detach(active.lease_id));
  EXPECT_TRUE(registry_.List().empty());
  EXPECT_THAT(listener_.serving(), ElementsAre(Pair("m", true), Pair("m", false)));
  EXPECT_THAT(registry_.Unload("m", false), StatusIs(Code::kNotFound, "no model named 'm'"));
}

TEST_F(RegistryTest, UnloadWithoutLeasesFreesAtOnce) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_.Unload("m", false));
  EXPECT_TRUE(unloaded.freed);
  EXPECT_TRUE(registry_.List().empty());
}

TEST_F(RegistryTest, ForceUnloadRevokesLeases) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("ck", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto pending, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto active, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry_.Claim(active.lease_id));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_.Unload("m", /*force=*/true));
  EXPECT_TRUE(unloaded.freed);
  EXPECT_FALSE(registry_.IsLeaseLive(pending.lease_id));
  EXPECT_FALSE(registry_.IsLeaseLive(active.lease_id));
  EXPECT_EQ(unloaded.model->leases.load(), 0);
  EXPECT_TRUE(registry_.List().empty());
}

TEST_F(RegistryTest, ExpirePendingDropsOnlyUnclaimedLeases) {
  ModelRegistry registry(Options(std::chrono::milliseconds(50)), nullptr);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, Load("m", Checkpoint("ck", 1), &registry));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto pending, registry.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto active, registry.Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry.Claim(active.lease_id));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(registry.ExpirePending(), 1);
  EXPECT_FALSE(registry.IsLeaseLive(pending.lease_id));
  EXPECT_TRUE(registry.IsLeaseLive(active.lease_id));
  EXPECT_EQ(loaded.model->leases.load(), 1);
  EXPECT_EQ(registry.ExpirePending(), 0);
  EXPECT_THAT(registry.Claim(pending.lease_id), StatusIs(Code::kNotFound, "expired"));
}

TEST_F(RegistryTest, NewCheckpointUnderLeasedNameDrainsOldGeneration) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto first, Load("m", Checkpoint("ck1", 1)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto second, Load("m", Checkpoint("ck2", 2)));
  EXPECT_FALSE(second.reused);
  std::vector<std::shared_ptr<ModelGeneration>> listed = registry_.List();
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0]->generation, 2u);
  EXPECT_EQ(listed[0]->state.load(), ModelState::kReady);
  EXPECT_EQ(listed[0]->fingerprint, second.model->fingerprint);
  EXPECT_EQ(listed[1]->generation, 1u);
  EXPECT_EQ(listed[1]->state.load(), ModelState::kDraining);
  EXPECT_EQ(listed[1]->fingerprint, first.model->fingerprint);
  EXPECT_NE(listed[0]->fingerprint, listed[1]->fingerprint);
  registry_.Release(lease.lease_id);
  ASSERT_EQ(registry_.List().size(), 1u);
  EXPECT_EQ(registry_.List()[0]->generation, 2u);
  EXPECT_THAT(listener_.serving(), ElementsAre(Pair("m", true), Pair("m", true)));
}

TEST_F(RegistryTest, RankOutOfRangeIsInvalidArgument) {
  WEIGHTD_ASSERT_OK(Load("m", Checkpoint("ck", 1)));
  EXPECT_THAT(registry_.Attach("m", 1), StatusIs(Code::kInvalidArgument, "rank 1 is out of range"));
}

TEST_F(RegistryTest, TensorParallelOrDevicePlacementWithoutBackendIsRefused) {
  LoadRequest request;
  request.name = "m";
  request.checkpoint_path = Checkpoint("ck", 1);
  request.tp_size = 2;
  EXPECT_THAT(registry_.Load(request, nullptr), StatusIs(Code::kInvalidArgument, "tp_size 2 needs one device per rank"));
  request.tp_size = 1;
  request.devices = {"GPU-00000000-0000-0000-0000-000000000000"};
  EXPECT_THAT(registry_.Load(request, nullptr), StatusIs(Code::kInvalidArgument, "this daemon has no device backend"));
  EXPECT_TRUE(registry_.List().empty());
  EXPECT_EQ(listener_.failures(), 2u);
}

}  // namespace
}  // namespace weightd
