// The writer path in the registry (server/registry/registry.h, server/update/update.h):
// staging, claim timeout, commit and its verification, atomic publish,
// supersession by a reload, and the refusal while a writable mapping lives.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/format/content_hash.h"
#include "tests/server/registry/registry_fixture.h"
#include "tests/testing/status_matchers.h"

namespace weightd::registry_test {
namespace {

using Code = absl::StatusCode;



const TensorRecord& Record(const ModelGeneration& m, const std::string& name) {
  for (const TensorRecord& t : m.ranks[0].tensors) {
    if (t.name == name) return t;
  }
  static TensorRecord none;
  return none;
}

// The writable bytes of tensor `name` in a staged update.
char* Staged(const StagedUpdate& update, const std::string& name) {
  for (const StagedTensor& t : update.writable) {
    if (t.record.name == name) return update.segments[t.record.segment].memory->writable() + t.record.offset;
  }
  return nullptr;
}

class UpdateTest : public RegistryTest {
 protected:
  void SetUp() override { ASSERT_TRUE(Load("m", Checkpoint("ck", 1)).ok()); }
};

TEST_F(UpdateTest, CommitPublishesTheNextGenerationAndTheOldOneDrains) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto gen1, registry_.Get("m"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"b.bias"}));
  ASSERT_EQ(grant.update_id.size(), 7u + 32u);
  EXPECT_EQ(grant.update_id.substr(0, 7), "update-");
  EXPECT_EQ(grant.update_id.find_first_not_of("0123456789abcdef", 7), std::string::npos);
  ASSERT_EQ(grant.update->segments.size(), 1u);  // the checkpoint's one host segment, copied
  EXPECT_EQ(grant.update->bytes_staged, gen1->host_bytes);
  EXPECT_EQ(grant.update->bytes_shared, 0u);
  std::memcpy(Staged(*grant.update, "b.bias"), "xyz", 3);
  // Until the commit returns, Attach returns generation 1.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto before, registry_.Get("m"));
  EXPECT_EQ(before, gen1);
  std::string expected = ContentHashHex(TensorContentHash("xyz", 3));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto commit,
                               registry_.CommitUpdate(grant.update_id, {{{"b.bias", expected}}, "step-7", false}));
  EXPECT_EQ(commit.tensors_changed, 1u);
  EXPECT_EQ(commit.model->generation, gen1->generation + 1);
  EXPECT_EQ(commit.model->version_label, "step-7");
  EXPECT_EQ(ContentHashHex(Record(*commit.model, "b.bias").content_hash), expected);
  EXPECT_EQ(Record(*commit.model, "a.weight").content_hash, Record(*gen1, "a.weight").content_hash);
  EXPECT_NE(commit.model->fingerprint, gen1->fingerprint);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto after, registry_.Get("m"));
  EXPECT_EQ(after, commit.model);
  EXPECT_EQ(gen1->state.load(), ModelState::kDraining);  // held by the lease
  const TensorRecord& b = Record(*gen1, "b.bias");
  EXPECT_EQ(std::string(gen1->host_segments[0]->data() + b.offset, 3), Tensors(1)[1].data);  // old bytes kept
  EXPECT_FALSE(registry_.IsUpdateOpen(grant.update_id));
  registry_.Release(lease.lease_id);
  EXPECT_EQ(registry_.List().size(), 1u);
}

TEST_F(UpdateTest, ACommitOfUnchangedBytesKeepsTheFingerprint) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto gen1, registry_.Get("m"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {}));
  EXPECT_EQ(grant.update->writable.size(), 3u);  // none named: every tensor
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto commit, registry_.CommitUpdate(grant.update_id, {}));
  EXPECT_EQ(commit.tensors_changed, 0u);
  EXPECT_EQ(commit.model->fingerprint, gen1->fingerprint);  // FingerprintOf agrees with the loader's
}

TEST_F(UpdateTest, AnUnclaimedUpdateExpiresAfterTheClaimTimeout) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  clock_.Advance(std::chrono::seconds(5));
  EXPECT_EQ(registry_.ExpirePending(), 0);
  clock_.Advance(std::chrono::seconds(6));
  EXPECT_EQ(registry_.ExpirePending(), 1);
  EXPECT_FALSE(registry_.IsUpdateOpen(grant.update_id));
  EXPECT_EQ(listener_.aborts(), (std::vector<std::pair<std::string, std::string>>{{"m", "claim_timeout"}}));
  EXPECT_THAT(registry_.CommitUpdate(grant.update_id, {}), StatusIs(Code::kNotFound, "unknown or ended update id"));
}

TEST_F(UpdateTest, AClaimedUpdateDoesNotExpireAndIsClaimedOnce) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  WEIGHTD_ASSERT_OK(registry_.ClaimUpdate(grant.update_id).status());
  EXPECT_THAT(registry_.ClaimUpdate(grant.update_id), StatusIs(Code::kFailedPrecondition, "update already claimed on another connection"));
  clock_.Advance(std::chrono::seconds(60));
  EXPECT_EQ(registry_.ExpirePending(), 0);
  EXPECT_TRUE(registry_.IsUpdateOpen(grant.update_id));
  WEIGHTD_ASSERT_OK(registry_.AbortUpdate(grant.update_id, "aborted_by_writer"));
  EXPECT_EQ(listener_.aborts(), (std::vector<std::pair<std::string, std::string>>{{"m", "aborted_by_writer"}}));
}

TEST_F(UpdateTest, AReloadMeanwhileSupersedesTheUpdate) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  ASSERT_TRUE(Load("m", Checkpoint("ck2", 2)).ok());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto current, registry_.Get("m"));
  EXPECT_THAT(registry_.CommitUpdate(grant.update_id, {}),
              StatusIs(Code::kFailedPrecondition,
                       absl::StrCat("model 'm' is at generation ", current->generation,
                                    " but this update began from generation ", grant.update->base->generation,
                                    "; the update is aborted")));
  EXPECT_EQ(listener_.aborts(), (std::vector<std::pair<std::string, std::string>>{{"m", "superseded"}}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto still, registry_.Get("m"));
  EXPECT_EQ(still, current);
}

TEST_F(UpdateTest, AWritableMappingLeftBehindRefusesTheCommitButKeepsTheUpdateOpen) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  const HostSegment& staged = *grant.update->segments[0].memory;
  void* map = mmap(nullptr, staged.size(), PROT_READ | PROT_WRITE, MAP_SHARED, staged.fd(), 0);
  ASSERT_NE(map, MAP_FAILED);
  EXPECT_THAT(registry_.CommitUpdate(grant.update_id, {}), StatusIs(Code::kFailedPrecondition, "still mapped writable"));
  EXPECT_TRUE(registry_.IsUpdateOpen(grant.update_id));
  ASSERT_EQ(munmap(map, staged.size()), 0);
  WEIGHTD_ASSERT_OK(registry_.CommitUpdate(grant.update_id, {}).status());
}

TEST_F(UpdateTest, TheSizeOfAStagedSegmentIsSealedBeforeItsFdLeaves) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  const HostSegment& staged = *grant.update->segments[0].memory;
  EXPECT_NE(ftruncate(staged.fd(), 0), 0);  // F_SEAL_SHRINK: a writer cannot pull pages from under the daemon
  EXPECT_EQ(errno, EPERM);
}

// Before, commit hashed tensor ranges only, so a writer could change the
// padding between tensors or the tail of the last page (which every client
// mapping that page sees) and have it published unchecked.
TEST_F(UpdateTest, AByteChangedOutsideEveryTensorFailsVerification) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto gen1, registry_.Get("m"));
  std::vector<std::pair<uint64_t, std::string>> outside;  // offset, what it is
  const HostSegment& base = *gen1->host_segments[0];
  outside.emplace_back(base.size(), "the tail of the last page");
  uint64_t a_end = Record(*gen1, "a.weight").offset + Record(*gen1, "a.weight").nbytes;
  if (Record(*gen1, "b.bias").offset > a_end) outside.emplace_back(a_end, "padding between tensors");
  for (const auto& [offset, what] : outside) {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"b.bias"}));
    std::memcpy(Staged(*grant.update, "b.bias"), "xyz", 3);
    grant.update->segments[0].memory->writable()[offset] ^= 0x40;
    EXPECT_THAT(registry_.CommitUpdate(grant.update_id, {{}, "", false}),
                StatusIs(Code::kFailedPrecondition,
                         absl::StrCat("staged segment 0: byte ", offset, " lies outside every tensor and was changed (",
                                      what, "); a writer may change tensor bytes only")));
    EXPECT_FALSE(registry_.IsUpdateOpen(grant.update_id));
    WEIGHTD_ASSERT_OK_AND_ASSIGN(auto current, registry_.Get("m"));
    EXPECT_EQ(current, gen1);
  }
  ASSERT_GE(listener_.aborts().size(), 1u);
  EXPECT_EQ(listener_.aborts().back().second, "verification_failed");
  // A commit that changes tensor bytes only still goes through.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"b.bias"}));
  std::memcpy(Staged(*grant.update, "b.bias"), "xyz", 3);
  WEIGHTD_EXPECT_OK(registry_.CommitUpdate(grant.update_id, {{}, "", false}).status());
}

TEST_F(UpdateTest, BadRequestsAreRefusedNamingWhatIsWrong) {
  EXPECT_THAT(registry_.BeginUpdate("m", {"zzz"}), StatusIs(Code::kInvalidArgument, "model 'm' has no tensor 'zzz'"));
  EXPECT_THAT(registry_.BeginUpdate("m", {"a.weight", "a.weight"}),
              StatusIs(Code::kInvalidArgument, "the update names tensor 'a.weight' twice"));
  EXPECT_THAT(registry_.BeginUpdate("m", {"a", "b", "c", "d"}),
              StatusIs(Code::kInvalidArgument, "the update names 4 tensors but model 'm' has 3"));
  EXPECT_THAT(registry_.BeginUpdate("nope", {}), StatusIs(Code::kNotFound, "no model named 'nope'"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  EXPECT_THAT(registry_.BeginUpdate("m", {}), StatusIs(Code::kAlreadyExists, "already has an open update"));
  EXPECT_THAT(registry_.CommitUpdate(grant.update_id, {{}, std::string(129, 'x')}),
              StatusIs(Code::kInvalidArgument, "version label is 129 bytes; at most 128 are allowed"));
  EXPECT_THAT(registry_.CommitUpdate(grant.update_id, {{}, "tab\there"}),
              StatusIs(Code::kInvalidArgument, "version label may hold only printable ASCII characters"));
  EXPECT_THAT(registry_.CommitUpdate(grant.update_id, {{{"b.bias", "0000000000000000"}}}),
              StatusIs(Code::kInvalidArgument, "an expected hash names tensor 'b.bias', which is not in this update"));
  EXPECT_THAT(registry_.CommitUpdate(grant.update_id, {{{"a.weight", "xyz"}}}),
              StatusIs(Code::kInvalidArgument, "must be 16 hex digits"));
  EXPECT_TRUE(registry_.IsUpdateOpen(grant.update_id));  // refusals before sealing leave it open
  WEIGHTD_ASSERT_OK(registry_.CommitUpdate(grant.update_id, {}).status());
}

TEST_F(UpdateTest, UnloadAbortsTheUpdate) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  WEIGHTD_ASSERT_OK(registry_.Unload("m", false).status());
  EXPECT_FALSE(registry_.IsUpdateOpen(grant.update_id));
  EXPECT_EQ(listener_.aborts(), (std::vector<std::pair<std::string, std::string>>{{"m", "unloaded"}}));
}

}  // namespace
}  // namespace weightd::registry_test

namespace weightd::registry_test {
namespace {

// Device-placed tensors: staged whole in host memory, uploaded by the daemon
// into fresh copies of only the arenas that hold a changed tensor.
class DeviceUpdateTest : public RegistryTest {
 protected:
  void SetUp() override {
    RegistryOptions options = Options();
    options.loader.device_backend = backend_.get();
    options.loader.max_arena_bytes = 8;  // a.weight's rank part and c.scale get an arena each
    registry_ = std::make_unique<ModelRegistry>(options, &listener_);
    LoadRequest request;
    request.name = "m";
    request.checkpoint_path = Checkpoint("ck", 1);
    request.tp_size = 2;
    request.devices = {"GPU-emulated-0", "GPU-emulated-1"};
    request.tp_rules = {{"a.weight", 0}};
    request.host_resident_patterns = {"b.bias"};
    ASSERT_TRUE(registry_->Load(request, nullptr).ok());
  }
  std::string DeviceBytes(const ModelGeneration& g, size_t rank, const std::string& name) {
    for (const TensorRecord& t : g.ranks[rank].tensors) {
      if (t.name != name) continue;
      std::string out(t.nbytes, '\0');
      EXPECT_TRUE(g.arenas[g.segments[g.ranks[rank].segments[t.segment]].owner]->CopyToHost(t.offset, out.data(), t.nbytes).ok());
      return out;
    }
    return "<missing>";
  }
  std::unique_ptr<DeviceBackend> backend_ = MakeEmulatedBackend(2);
  std::unique_ptr<ModelRegistry> registry_;
};

TEST_F(DeviceUpdateTest, ASplitTensorIsWrittenWholeAndOnlyItsArenasAreRewritten) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto gen1, registry_->Get("m"));
  ASSERT_EQ(gen1->arenas.size(), 4u);  // per rank: a.weight's part, c.scale
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_->BeginUpdate("m", {"a.weight"}));
  ASSERT_EQ(grant.update->segments.size(), 1u);  // the host staging of the device tensor
  EXPECT_EQ(grant.update->segments[0].base_id, kDeviceStaging);
  const StagedTensor& w = grant.update->writable.at(0);
  EXPECT_EQ(w.record.nbytes, 16u);  // the whole [2, 2] F32 tensor, not a rank's half
  EXPECT_EQ(w.record.shape, (std::vector<uint64_t>{2, 2}));
  char* data = grant.update->segments[0].memory->writable() + w.record.offset;
  EXPECT_EQ(std::string(data, 16), Tensors(1)[0].data);  // staged with the current bytes, gathered from both ranks
  const std::string fresh = "0123456789abcdef";
  std::memcpy(data, fresh.data(), 16);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      auto commit, registry_->CommitUpdate(grant.update_id,
                                          {{{"a.weight", ContentHashHex(TensorContentHash(fresh.data(), 16))}}, "", false}));
  const ModelGeneration& gen2 = *commit.model;
  EXPECT_EQ(DeviceBytes(gen2, 0, "a.weight"), fresh.substr(0, 8));  // split on dim 0: rank 0 holds row 0
  EXPECT_EQ(DeviceBytes(gen2, 1, "a.weight"), fresh.substr(8));
  EXPECT_EQ(DeviceBytes(*gen1, 0, "a.weight"), Tensors(1)[0].data.substr(0, 8));  // generation 1 untouched
  // Segment order: host, then rank 0's arenas (a, c), then rank 1's (a, c).
  EXPECT_NE(gen2.arenas[0], gen1->arenas[0]);
  EXPECT_EQ(gen2.arenas[1], gen1->arenas[1]);  // c.scale's arena is shared
  EXPECT_NE(gen2.arenas[2], gen1->arenas[2]);
  EXPECT_EQ(gen2.arenas[3], gen1->arenas[3]);
  EXPECT_EQ(gen2.host_segments[0], gen1->host_segments[0]);
  EXPECT_EQ(commit.tensors_changed, 1u);
}

TEST_F(DeviceUpdateTest, AReplicatedTensorReachesEveryRank) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_->BeginUpdate("m", {"c.scale"}));
  const StagedTensor& w = grant.update->writable.at(0);
  std::memcpy(grant.update->segments[0].memory->writable() + w.record.offset, "ABCDEFGH", 8);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto commit, registry_->CommitUpdate(grant.update_id, {}));
  EXPECT_EQ(DeviceBytes(*commit.model, 0, "c.scale"), "ABCDEFGH");
  EXPECT_EQ(DeviceBytes(*commit.model, 1, "c.scale"), "ABCDEFGH");
}

}  // namespace
}  // namespace weightd::registry_test

namespace weightd::registry_test {
namespace {

// Review findings: an update that ends without a commit gives its pages back
// even when the writer keeps the fds; a writer's F_SEAL_SEAL ends its update;
// an unload during a refused commit does not leave the update behind.
class UpdateEndTest : public RegistryTest {
 protected:
  void SetUp() override { ASSERT_TRUE(Load("m", Checkpoint("ck", 1)).ok()); }
};

uint64_t AllocatedBytes(int fd) {
  struct stat st;
  return fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : ~0ull;
}

TEST_F(UpdateEndTest, AnAbortedUpdateGivesItsPagesBackToAWriterThatKeepsTheFd) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  int kept = dup(grant.update->segments[0].memory->fd());  // what a hostile writer holds on to
  ASSERT_GE(kept, 0);
  EXPECT_GT(AllocatedBytes(kept), 0u);
  WEIGHTD_ASSERT_OK(registry_.AbortUpdate(grant.update_id, "aborted_by_writer"));
  EXPECT_EQ(AllocatedBytes(kept), 0u);
  close(kept);
}

TEST_F(UpdateEndTest, AWriterThatAddsFSealSealEndsItsUpdate) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  ASSERT_EQ(fcntl(grant.update->segments[0].memory->fd(), F_ADD_SEALS, F_SEAL_SEAL), 0);
  EXPECT_THAT(registry_.CommitUpdate(grant.update_id, {}),
              StatusIs(Code::kPermissionDenied, "another process holding its fd added F_SEAL_SEAL"));
  EXPECT_FALSE(registry_.IsUpdateOpen(grant.update_id));
  WEIGHTD_ASSERT_OK(registry_.BeginUpdate("m", {"a.weight"}).status());  // the name is free again
}

TEST_F(UpdateEndTest, AnUnloadWhileAWriterStillMapsTheSegmentLeavesNoUpdateBehind) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginUpdate("m", {"a.weight"}));
  const HostSegment& staged = *grant.update->segments[0].memory;
  void* map = mmap(nullptr, staged.size(), PROT_READ | PROT_WRITE, MAP_SHARED, staged.fd(), 0);
  ASSERT_NE(map, MAP_FAILED);
  WEIGHTD_ASSERT_OK(registry_.Unload("m", false).status());  // aborts the update (not committing yet)
  EXPECT_FALSE(registry_.IsUpdateOpen(grant.update_id));
  ASSERT_TRUE(Load("m", Checkpoint("ck2", 2)).ok());
  WEIGHTD_ASSERT_OK(registry_.BeginUpdate("m", {"a.weight"}).status());
  munmap(map, staged.size());
}

TEST_F(UpdateEndTest, APathWithANulByteIsRefused) {
  EXPECT_THAT(registry_.Reload("m", std::string("ck\0/x", 5), nullptr),
              StatusIs(Code::kInvalidArgument, "checkpoint path contains a NUL byte"));
}

}  // namespace
}  // namespace weightd::registry_test
