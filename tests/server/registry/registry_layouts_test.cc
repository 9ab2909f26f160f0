// Runtime layouts in the registry (server/registry/registry.h,
// server/layout/layout_publish.h): staging, the one writer per slot and its
// wait, sealing and hashing at commit, the refusals a writer can fix, the
// strict attach, drop, and the drain with the generation.
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/format/content_hash.h"
#include "common/memory/device.h"
#include "tests/server/registry/registry_fixture.h"
#include "tests/testing/status_matchers.h"

namespace weightd::registry_test {
namespace {

using Code = absl::StatusCode;

LayoutRequest Request(const std::string& key, LayoutIdentity identity = {{"engine", "test"}, {"quant", "int8"}}) {
  LayoutRequest r;
  r.model = "m";
  r.key = key;
  r.identity = std::move(identity);
  // A fused [6, 2] I8 tensor, its F32 scales [6], and a transposed [2, 3] F16 view (strides 1, 2).
  r.tensors = {{"qkv.weight", DType::kI8, {6, 2}, {}, Placement::kHost},
               {"qkv.scale", DType::kF32, {6}, {}, Placement::kHost},
               {"o.weight_t", DType::kF16, {2, 3}, {1, 2}, Placement::kHost}};
  return r;
}

// The writable bytes of layout tensor `name` in the daemon's staged mapping.
char* Staged(const StagedLayout& staged, const std::string& name) {
  for (const LayoutTensor& t : staged.tensors) {
    if (t.record.name == name) return staged.segments[t.record.segment].memory->writable() + t.record.offset;
  }
  return nullptr;
}

class LayoutTest : public RegistryTest {
 protected:
  void SetUp() override { ASSERT_TRUE(Load("m", Checkpoint("ck", 1)).ok()); }

  // Begins, claims and fills a layout of Request(key) with bytes of `seed`.
  ModelRegistry::LayoutGrant Begin(const std::string& key, char seed = 7) {
    absl::StatusOr<ModelRegistry::LayoutGrant> grant = registry_.BeginLayout(Request(key));
    EXPECT_TRUE(grant.ok()) << grant.status();
    if (!grant.ok()) return {};
    EXPECT_TRUE(registry_.ClaimLayoutWriter(grant->writer_id).ok());
    for (const LayoutTensor& t : grant->staged->tensors) {
      char* at = Staged(*grant->staged, t.record.name);
      for (uint64_t i = 0; i < t.record.nbytes; ++i) at[i] = static_cast<char>(seed + i);
    }
    return *grant;
  }
};

TEST_F(LayoutTest, StagesEveryTensorAlignedInOneHostMemfd) {
  ModelRegistry::LayoutGrant grant = Begin("engine/int8/tp1");
  EXPECT_EQ(grant.writer_id.substr(0, 7), "layout-");
  EXPECT_EQ(grant.writer_id.size(), 7u + 32u);
  const StagedLayout& staged = *grant.staged;
  ASSERT_EQ(staged.segments.size(), 1u);
  ASSERT_EQ(staged.tensors.size(), 3u);
  EXPECT_EQ(staged.tensors[0].record.offset, 0u);
  EXPECT_EQ(staged.tensors[0].record.nbytes, 12u);
  EXPECT_EQ(staged.tensors[1].record.offset, 256u);
  EXPECT_EQ(staged.tensors[1].record.nbytes, 24u);
  EXPECT_EQ(staged.tensors[2].record.offset, 512u);
  EXPECT_EQ(staged.tensors[2].record.nbytes, 12u);  // (1 + 1*1 + 2*2) elements of 2 bytes
  EXPECT_EQ(staged.bytes_staged, 768u);
}

TEST_F(LayoutTest, CommitPublishesHashedBytesAndAttachReturnsThem) {
  ModelRegistry::LayoutGrant grant = Begin("engine/int8/tp1");
  std::string qkv(Staged(*grant.staged, "qkv.weight"), 12);
  std::string expected = ContentHashHex(TensorContentHash(qkv.data(), qkv.size()));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto layout, registry_.CommitLayout(grant.writer_id, {{"qkv.weight", expected}}));
  EXPECT_FALSE(registry_.IsLayoutWriterOpen(grant.writer_id));
  EXPECT_EQ(layout->key, "engine/int8/tp1");
  EXPECT_EQ(layout->generation, grant.generation);
  EXPECT_EQ(layout->host_bytes, 768u);
  EXPECT_EQ(layout->device_bytes, 0u);
  EXPECT_EQ(ContentHashHex(layout->tensors[0].record.content_hash), expected);
  EXPECT_EQ(layout->fingerprint, LayoutFingerprint(layout->tensors));
  ASSERT_EQ(layout->segments.size(), 1u);
  EXPECT_EQ(std::string(layout->host_segments[0]->data(), 12), qkv);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0, {}, {"engine/int8/tp1", {}}));
  EXPECT_EQ(lease.layout, layout);
  EXPECT_EQ(layout->leases.load(), 1);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto gen, registry_.Get("m"));
  EXPECT_EQ(gen->leases.load(), 1);  // a layout lease holds its generation
  registry_.Release(lease.lease_id);
  EXPECT_EQ(layout->leases.load(), 0);
}

TEST_F(LayoutTest, AMissingKeyIsNotFoundNamingThePublishedKeys) {
  WEIGHTD_ASSERT_OK(registry_.CommitLayout(Begin("a/1").writer_id, {}));
  WEIGHTD_ASSERT_OK(registry_.CommitLayout(Begin("b/2").writer_id, {}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto gen, registry_.Get("m"));
  absl::StatusOr<ModelRegistry::Grant> missing = registry_.Attach("m", 0, {}, {"c/3", {}});
  ASSERT_EQ(missing.status().code(), Code::kNotFound);
  EXPECT_EQ(missing.status().message(),
            absl::StrCat("model 'm' generation ", gen->generation,
                         " has no layout 'c/3' for rank 0; published for this generation and rank: 'a/1', 'b/2'"));
}

TEST_F(LayoutTest, AnIdentityMismatchNamesEveryFieldThatDiffers) {
  WEIGHTD_ASSERT_OK(registry_.CommitLayout(Begin("k").writer_id, {}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto gen, registry_.Get("m"));
  absl::StatusOr<ModelRegistry::Grant> mismatch =
      registry_.Attach("m", 0, {}, {"k", {{"engine", "test"}, {"quant", "fp8"}, {"arch", "sm90"}}});
  ASSERT_EQ(mismatch.status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(mismatch.status().message(),
            absl::StrCat("layout 'k' of rank 0 of model 'm' generation ", gen->generation,
                         " was published with another identity: arch is 'sm90' here but missing from the published "
                         "layout; quant is 'fp8' here but 'int8' in the published layout"));
  absl::StatusOr<ModelRegistry::Grant> fewer = registry_.Attach("m", 0, {}, {"k", {{"engine", "test"}}});
  ASSERT_EQ(fewer.status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(absl::EndsWith(fewer.status().message(), "quant is missing here ('int8' in the published layout)"))
      << fewer.status();
  WEIGHTD_EXPECT_OK(registry_.Attach("m", 0, {}, {"k", {{"engine", "test"}, {"quant", "int8"}}}));
}

TEST_F(LayoutTest, ASecondWriterOfTheSlotIsRefusedAndAPublishedOneToo) {
  ModelRegistry::LayoutGrant first = Begin("k");
  absl::StatusOr<ModelRegistry::LayoutGrant> second = registry_.BeginLayout(Request("k"));
  EXPECT_EQ(second.status().code(), Code::kAlreadyExists);
  WEIGHTD_ASSERT_OK(registry_.CommitLayout(first.writer_id, {}));
  absl::StatusOr<ModelRegistry::LayoutGrant> third = registry_.BeginLayout(Request("k"));
  ASSERT_EQ(third.status().code(), Code::kAlreadyExists);
  EXPECT_TRUE(absl::StrContains(third.status().message(), "is published already; attach it, or drop it first"));
}

TEST_F(LayoutTest, AWaitingWriterGetsTheLayoutTheFirstCommitted) {
  ModelRegistry::LayoutGrant first = Begin("k");
  LayoutRequest waiting = Request("k");
  waiting.wait_seconds = 30;
  absl::StatusOr<ModelRegistry::LayoutGrant> second;
  std::thread waiter([&] { second = registry_.BeginLayout(waiting); });
  usleep(50 * 1000);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto layout, registry_.CommitLayout(first.writer_id, {}));
  waiter.join();
  WEIGHTD_ASSERT_OK(second);
  EXPECT_TRUE(second->writer_id.empty());
  EXPECT_EQ(second->published, layout);
}

TEST_F(LayoutTest, AWaitingWriterTakesOverTheSlotWhenTheFirstAborts) {
  ModelRegistry::LayoutGrant first = Begin("k");
  LayoutRequest waiting = Request("k");
  waiting.wait_seconds = 30;
  absl::StatusOr<ModelRegistry::LayoutGrant> second;
  std::thread waiter([&] { second = registry_.BeginLayout(waiting); });
  usleep(50 * 1000);
  WEIGHTD_ASSERT_OK(registry_.AbortLayout(first.writer_id, "writer_disconnected"));
  waiter.join();
  WEIGHTD_ASSERT_OK(second);
  EXPECT_EQ(second->writer_id.substr(0, 7), "layout-");
  EXPECT_EQ(second->published, nullptr);
}

TEST_F(LayoutTest, AWaitThatRunsOutIsDeadlineExceeded) {
  ModelRegistry::LayoutGrant first = Begin("k");
  LayoutRequest waiting = Request("k");
  waiting.wait_seconds = 0.05;
  EXPECT_EQ(registry_.BeginLayout(waiting).status().code(), Code::kDeadlineExceeded);
}

TEST_F(LayoutTest, TooManyOpenWritersAreRefused) {
  std::vector<std::string> ids;
  for (size_t i = 0; i < kMaxOpenLayoutWriters; ++i) {
    absl::StatusOr<ModelRegistry::LayoutGrant> grant = registry_.BeginLayout(Request(absl::StrCat("k", i)));
    ASSERT_TRUE(grant.ok()) << grant.status();
    ids.push_back(grant->writer_id);
  }
  absl::StatusOr<ModelRegistry::LayoutGrant> one_more = registry_.BeginLayout(Request("one-more"));
  ASSERT_EQ(one_more.status().code(), Code::kResourceExhausted);
  EXPECT_EQ(one_more.status().message(),
            "256 layout writers are open at once, as many as weightd allows; commit or abort some first");
  WEIGHTD_ASSERT_OK(registry_.AbortLayout(ids[0], "aborted_by_writer"));
  WEIGHTD_EXPECT_OK(registry_.BeginLayout(Request("one-more")));
}

TEST_F(LayoutTest, ACommitWhileMappedWritableIsRefusedAndCanBeRetried) {
  ModelRegistry::LayoutGrant grant = Begin("k");
  const HostSegment& memory = *grant.staged->segments[0].memory;
  void* kept = mmap(nullptr, memory.size(), PROT_READ | PROT_WRITE, MAP_SHARED, memory.fd(), 0);
  ASSERT_NE(kept, MAP_FAILED);
  absl::StatusOr<std::shared_ptr<const Layout>> refused = registry_.CommitLayout(grant.writer_id, {});
  ASSERT_EQ(refused.status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "sealing staged layout segment 0")) << refused.status();
  EXPECT_TRUE(registry_.IsLayoutWriterOpen(grant.writer_id));
  ASSERT_EQ(munmap(kept, memory.size()), 0);
  WEIGHTD_EXPECT_OK(registry_.CommitLayout(grant.writer_id, {}));
}

TEST_F(LayoutTest, AfterTheCommitTheWritersFdCannotChangeServedBytes) {
  ModelRegistry::LayoutGrant grant = Begin("k");
  int fd = dup(grant.staged->segments[0].memory->fd());  // what a writer process keeps
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto layout, registry_.CommitLayout(grant.writer_id, {}));
  std::string before(layout->host_segments[0]->data(), layout->host_bytes);
  EXPECT_EQ(pwrite(fd, "X", 1, 0), -1);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
  void* cow = mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ASSERT_NE(cow, MAP_FAILED);
  static_cast<char*>(cow)[0] = 'X';  // a private copy of the page
  munmap(cow, 4096);
  close(fd);
  EXPECT_EQ(std::string(layout->host_segments[0]->data(), layout->host_bytes), before);
  EXPECT_EQ(TensorContentHash(layout->host_segments[0]->data(), 12), layout->tensors[0].record.content_hash);
}

TEST_F(LayoutTest, BytesOutsideEveryTensorMustStayZero) {
  ModelRegistry::LayoutGrant grant = Begin("k");
  grant.staged->segments[0].memory->writable()[100] = 1;  // padding after qkv.weight
  absl::StatusOr<std::shared_ptr<const Layout>> refused = registry_.CommitLayout(grant.writer_id, {});
  ASSERT_EQ(refused.status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(refused.status().message(),
            "the layout is not published: staged layout segment 0: byte 100 lies outside every tensor and is not zero "
            "(padding between tensors); a writer may write its tensors' bytes only");
  EXPECT_FALSE(registry_.IsLayoutWriterOpen(grant.writer_id));  // sealed: it cannot be fixed
  EXPECT_EQ(registry_.Attach("m", 0, {}, {"k", {}}).status().code(), Code::kNotFound);
}

TEST_F(LayoutTest, AWrongExpectedHashIsRefusedNamingTheTensor) {
  ModelRegistry::LayoutGrant grant = Begin("k");
  absl::StatusOr<std::shared_ptr<const Layout>> refused =
      registry_.CommitLayout(grant.writer_id, {{"qkv.scale", "0000000000000000"}});
  ASSERT_EQ(refused.status().code(), Code::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "layout tensor 'qkv.scale' has content hash "));
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "but the writer expected 0000000000000000"));
}

TEST_F(LayoutTest, ACommitBeforeTheClaimIsRefused) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry_.BeginLayout(Request("k")));
  EXPECT_EQ(registry_.CommitLayout(grant.writer_id, {}).status().code(), Code::kFailedPrecondition);
}

TEST_F(LayoutTest, DropRemovesTheLayoutButLeasesKeepIt) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto layout, registry_.CommitLayout(Begin("k").writer_id, {}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0, {}, {"k", {}}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(int dropped, registry_.DropLayout("m", "k", std::nullopt));
  EXPECT_EQ(dropped, 1);
  EXPECT_EQ(registry_.Attach("m", 0, {}, {"k", {}}).status().code(), Code::kNotFound);
  EXPECT_EQ(registry_.DropLayout("m", "k", std::nullopt).status().code(), Code::kNotFound);
  EXPECT_EQ(TensorContentHash(layout->host_segments[0]->data(), 12), layout->tensors[0].record.content_hash);
  registry_.Release(lease.lease_id);
}

TEST_F(LayoutTest, AReloadDrainsTheLayoutsWithTheirGeneration) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto layout, registry_.CommitLayout(Begin("k").writer_id, {}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, registry_.Attach("m", 0, {}, {"k", {}}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto gen1, registry_.Get("m"));
  ModelRegistry::LayoutGrant open = Begin("other");  // still staging when the next generation comes
  WriteCheckpoint(root_.Join("ck") + "/model.safetensors", Tensors(2));
  WEIGHTD_ASSERT_OK(registry_.Reload("m", "", nullptr));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto gen2, registry_.Get("m"));
  EXPECT_EQ(gen1->state.load(), ModelState::kDraining);
  EXPECT_TRUE(gen1->layouts->List().empty());  // nothing attaches it any more: the lease holds it
  EXPECT_EQ(TensorContentHash(lease.layout->host_segments[0]->data(), 12), layout->tensors[0].record.content_hash);
  EXPECT_TRUE(gen2->layouts->List().empty());
  EXPECT_FALSE(registry_.IsLayoutWriterOpen(open.writer_id));  // superseded
  absl::StatusOr<ModelRegistry::Grant> next = registry_.Attach("m", 0, {}, {"k", {}});
  ASSERT_EQ(next.status().code(), Code::kNotFound);
  EXPECT_EQ(next.status().message(),
            absl::StrCat("model 'm' generation ", gen2->generation,
                         " has no layout 'k' for rank 0; published for this generation and rank: none"));
  registry_.Release(lease.lease_id);
  EXPECT_EQ(registry_.List().size(), 1u);
}

TEST_F(LayoutTest, DeviceTensorsAreCopiedIntoADaemonOwnedArena) {
  std::unique_ptr<DeviceBackend> backend = MakeEmulatedBackend(2);
  RegistryOptions options = Options();
  options.loader.device_backend = backend.get();
  ModelRegistry registry(options, &listener_);
  ASSERT_TRUE(Load("m", "ck", &registry).ok());
  LayoutRequest request = Request("dev");
  request.tensors[0].placement = Placement::kDevice;
  request.tensors[1].placement = Placement::kDevice;
  EXPECT_EQ(registry.BeginLayout(request).status().message(),
            "rank 0 of model 'm' has no GPU in its plan; name the GPU of the layout's DEVICE tensors (gpu_uuid)");
  request.gpu_uuid = "GPU-emulated-1";
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry.BeginLayout(request));
  ASSERT_EQ(grant.staged->segments.size(), 2u);  // host, then the device staging
  EXPECT_EQ(grant.staged->segments[1].holds, Placement::kDevice);
  WEIGHTD_ASSERT_OK(registry.ClaimLayoutWriter(grant.writer_id));
  std::memcpy(Staged(*grant.staged, "qkv.weight"), "abcdefghijkl", 12);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto layout, registry.CommitLayout(grant.writer_id, {}));
  EXPECT_EQ(layout->gpu_uuid, "GPU-emulated-1");
  ASSERT_EQ(layout->arenas.size(), 1u);
  ASSERT_EQ(layout->segments.size(), 2u);
  EXPECT_EQ(layout->segments[1].placement, Placement::kDevice);
  EXPECT_EQ(layout->segments[1].backend, SegmentBackend::kEmulated);
  EXPECT_NE(layout->segments[1].fd, grant.staged->segments[1].memory->fd());  // not the writer's memory
  std::string read(12, '\0');
  WEIGHTD_ASSERT_OK(layout->arenas[0]->CopyToHost(layout->tensors[0].record.offset, read.data(), 12));
  EXPECT_EQ(read, "abcdefghijkl");
  EXPECT_EQ(layout->tensors[0].record.content_hash, TensorContentHash("abcdefghijkl", 12));
}

}  // namespace
}  // namespace weightd::registry_test
