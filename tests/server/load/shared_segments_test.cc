// One copy across names, subsets and TP plans (server/load/shared_segments.h):
// a load shares every served segment whose contents equal one of its plan's,
// reads only tensors with a fresh destination, and keeps content hashes.
#include "server/load/shared_segments.h"

#include <string>

#include "common/format/catalog.h"
#include "gtest/gtest.h"
#include "server/load/loader.h"
#include "server/load/plan.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/counting_backend.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::CountingBackend;

std::string Bytes(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 13 + seed);
  return s;
}

class SharedSegmentsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Two files: a "table" file (host tables and one device tensor) and a
    // layer file whose rows tensor a TP rule may split.
    testing::WriteFile(dir_.Join("a.safetensors"), testing::SafetensorsBuilder()
                                                       .Add("engram.table", "U8", {4096}, Bytes(4096, 1))
                                                       .Add("engram.scale", "U8", {64}, Bytes(64, 2))
                                                       .Add("engram.gate", "U8", {8, 4}, Bytes(32, 3))
                                                       .Build());
    testing::WriteFile(dir_.Join("b.safetensors"), testing::SafetensorsBuilder()
                                                       .Add("layer.rows", "U8", {8, 6}, Bytes(48, 4))
                                                       .Add("layer.norm", "U8", {16}, Bytes(16, 5))
                                                       .Build());
    testing::WriteFile(dir_.Join("model.safetensors.index.json"),
                       R"({"weight_map": {"engram.table": "a.safetensors", "engram.scale": "a.safetensors",
                           "engram.gate": "a.safetensors", "layer.rows": "b.safetensors",
                           "layer.norm": "b.safetensors"}})");
    options_.device_backend = &backend_;
    options_.mlock = false;
  }
  LoadRequest Request(const std::string& name, std::vector<TpRule> rules = {{"rows", 0}}) {
    LoadRequest r;
    r.name = name;
    r.checkpoint_path = dir_.path();
    r.tp_size = 2;
    r.devices = {"GPU-emulated-0", "GPU-emulated-1"};
    r.tp_rules = std::move(rules);
    r.host_resident_patterns = {"engram.table", "engram.scale"};
    return r;
  }
  std::unique_ptr<ModelGeneration> Load(const LoadRequest& request, const SharedSegments* shared) {
    absl::StatusOr<Catalog> catalog = BuildCatalog(dir_.path());
    EXPECT_TRUE(catalog.ok()) << catalog.status();
    EXPECT_TRUE(SelectTensors(request, *catalog).ok());
    absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = LoadGeneration(*catalog, request, options_, nullptr, shared);
    EXPECT_TRUE(gen.ok()) << gen.status();
    return gen.ok() ? std::move(*gen) : nullptr;
  }
  testing::TempDir dir_;
  CountingBackend backend_;
  LoaderOptions options_;
};

TEST_F(SharedSegmentsTest, ASecondNameWithTheSamePlanReadsNothingAndSharesEverySegment) {
  auto first = Load(Request("a"), nullptr);
  ASSERT_NE(first, nullptr);
  const int arenas = backend_.live();
  SharedSegments shared;
  shared.Add(*first);
  EXPECT_EQ(shared.host_count(), 1u);
  EXPECT_EQ(shared.arena_count(), 4u);  // two files x two ranks
  auto second = Load(Request("b"), &shared);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->bytes_read, 0u);
  EXPECT_EQ(backend_.live(), arenas);  // no new arena
  ASSERT_EQ(second->host_segments.size(), 1u);
  EXPECT_EQ(second->host_segments[0].get(), first->host_segments[0].get());
  for (size_t i = 0; i < first->arenas.size(); ++i) EXPECT_EQ(second->arenas[i].get(), first->arenas[i].get());
  EXPECT_EQ(second->fingerprint, first->fingerprint);
  uint64_t all_segments = 0;
  for (const SegmentRecord& s : second->segments) all_segments += s.size;
  EXPECT_EQ(second->bytes_reused, all_segments);
  // The segments outlive the first name.
  first.reset();
  EXPECT_EQ(std::string(second->host_segments[0]->data() + second->ranks[0].tensors[0].offset, 4096), Bytes(4096, 1));
}

TEST_F(SharedSegmentsTest, AnotherTpPlanReadsOnlyTheArenasWhoseLayoutChanged) {
  auto first = Load(Request("a"), nullptr);
  ASSERT_NE(first, nullptr);
  SharedSegments shared;
  shared.Add(*first);
  // layer.rows replicated instead of split: b.safetensors's arenas change,
  // a.safetensors's (host tables, the gate tensor) do not.
  auto other = Load(Request("replicated", {}), &shared);
  ASSERT_NE(other, nullptr);
  EXPECT_EQ(other->bytes_read, 48u + 16u);  // the two tensors of b.safetensors, once each
  EXPECT_EQ(other->host_segments[0].get(), first->host_segments[0].get());
  const TensorRecord& gate = other->ranks[1].tensors[2];
  ASSERT_EQ(gate.name, "engram.gate");
  const TensorRecord& first_gate = first->ranks[1].tensors[2];
  EXPECT_EQ(other->arenas[other->segments[other->ranks[1].segments[gate.segment]].owner].get(),
            first->arenas[first->segments[first->ranks[1].segments[first_gate.segment]].owner].get());
  // The re-read tensor landed whole on both ranks, hashed as the first load did.
  const TensorRecord& rows = other->ranks[1].tensors[3];
  ASSERT_EQ(rows.name, "layer.rows");
  EXPECT_EQ(rows.nbytes, 48u);
  std::string out(48, '\0');
  ASSERT_TRUE(other->arenas[other->segments[other->ranks[1].segments[rows.segment]].owner]
                  ->CopyToHost(rows.offset, out.data(), 48)
                  .ok());
  EXPECT_EQ(out, Bytes(48, 4));
  EXPECT_EQ(rows.content_hash, first->ranks[0].tensors[3].content_hash);
  EXPECT_EQ(other->fingerprint, first->fingerprint);  // same tensors, same bytes
}

TEST_F(SharedSegmentsTest, ASubsetSharesTheSegmentsItsTensorsLayOutAlike) {
  auto first = Load(Request("a"), nullptr);
  ASSERT_NE(first, nullptr);
  SharedSegments shared;
  shared.Add(*first);
  LoadRequest draft = Request("draft");
  draft.exclude_patterns = {"engram."};
  auto subset = Load(draft, &shared);
  ASSERT_NE(subset, nullptr);
  EXPECT_EQ(subset->tensor_count, 2u);
  EXPECT_EQ(subset->host_segments.size(), 0u);
  EXPECT_EQ(subset->bytes_read, 0u);  // b.safetensors's arenas are the same
  EXPECT_EQ(subset->checkpoint_bytes, 48u + 16u);
  EXPECT_NE(subset->fingerprint, first->fingerprint);  // it covers the subset only
}

TEST_F(SharedSegmentsTest, AFileChangedOnDiskIsReadAgain) {
  auto first = Load(Request("a"), nullptr);
  ASSERT_NE(first, nullptr);
  SharedSegments shared;
  shared.Add(*first);
  // The same layout with other bytes: a new identity (inode, mtime), read again.
  testing::WriteFile(dir_.Join("a.safetensors.new"), testing::SafetensorsBuilder()
                                                         .Add("engram.table", "U8", {4096}, Bytes(4096, 9))
                                                         .Add("engram.scale", "U8", {64}, Bytes(64, 2))
                                                         .Add("engram.gate", "U8", {8, 4}, Bytes(32, 3))
                                                         .Build());
  ASSERT_EQ(rename(dir_.Join("a.safetensors.new").c_str(), dir_.Join("a.safetensors").c_str()), 0);
  auto second = Load(Request("b"), &shared);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->bytes_read, 4096u + 64u + 32u);
  EXPECT_NE(second->host_segments[0].get(), first->host_segments[0].get());
  EXPECT_EQ(std::string(second->host_segments[0]->data() + second->ranks[0].tensors[0].offset, 4096), Bytes(4096, 9));
}

TEST_F(SharedSegmentsTest, AWritersBytesAreNeverSharedAsTheFiles) {
  auto first = Load(Request("a"), nullptr);
  ASSERT_NE(first, nullptr);
  first->files[0].stamp = FileStamp{};  // what a commit that rewrote a.safetensors's segment leaves
  SharedSegments shared;
  shared.Add(*first);
  EXPECT_EQ(shared.host_count(), 0u);
  EXPECT_EQ(shared.arena_count(), 2u);  // b.safetensors's, on two ranks
}

TEST_F(SharedSegmentsTest, BytesNotReadFromTheFilesHereAreNeverShared) {
  auto first = Load(Request("a"), nullptr);
  ASSERT_NE(first, nullptr);
  EXPECT_TRUE(first->from_files);
  // A peer's bytes (checked against the seed's hashes) or an unauthenticated
  // restored record's (checked against its own) are not the files'.
  first->from_files = false;
  SharedSegments shared;
  shared.Add(*first);
  EXPECT_EQ(shared.host_count(), 0u);
  EXPECT_EQ(shared.arena_count(), 0u);
  auto second = Load(Request("b"), &shared);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->bytes_read, second->checkpoint_bytes);
}

TEST_F(SharedSegmentsTest, TheIndexHoldsNoSegmentAlive) {
  auto first = Load(Request("a"), nullptr);
  ASSERT_NE(first, nullptr);
  SharedSegments shared;
  shared.Add(*first);
  const int arenas = backend_.live();
  first.reset();  // unloaded while a load runs: its memory goes now
  EXPECT_EQ(backend_.live(), arenas - 4);
  auto second = Load(Request("b"), &shared);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->bytes_read, second->checkpoint_bytes);  // nothing left to share
}

TEST(SegmentKey, CoversIdentityGpuAndEveryTensorField) {
  FileStamp stamp{"a.safetensors", FileIdentity{1, 2, 3, 4, 5}, 6};
  std::vector<SegmentContent> t = {{"x", 0, 16, -1, 0}, {"y", 64, 8, -1, 0}};
  std::string key = SegmentKey(stamp, "", -1, t);
  EXPECT_EQ(key, SegmentKey(stamp, "", -1, {t[1], t[0]}));  // order-free
  FileStamp renamed = stamp;
  renamed.name = "other-folder/a.safetensors";
  EXPECT_EQ(key, SegmentKey(renamed, "", -1, t));  // the name is not the bytes
  FileStamp touched = stamp;
  touched.identity.mtime_ns = 7;
  EXPECT_NE(key, SegmentKey(touched, "", -1, t));
  FileStamp header = stamp;
  header.header_hash = 8;
  EXPECT_NE(key, SegmentKey(header, "", -1, t));
  EXPECT_NE(key, SegmentKey(stamp, "GPU-0", -1, t));
  EXPECT_NE(key, SegmentKey(stamp, "", 0, t));  // bound to NUMA node 0: not an unbound segment
  for (auto change : std::vector<void (*)(SegmentContent&)>{
           [](SegmentContent& c) { c.name = "z"; }, [](SegmentContent& c) { c.offset = 128; },
           [](SegmentContent& c) { c.nbytes = 8; }, [](SegmentContent& c) { c.split_dim = 0; },
           [](SegmentContent& c) { c.split_start = 1; }}) {
    std::vector<SegmentContent> changed = t;
    change(changed[0]);
    EXPECT_NE(key, SegmentKey(stamp, "", -1, changed));
  }
  // A name holding the separators cannot fake two tensors.
  EXPECT_NE(SegmentKey(stamp, "", -1, {{"x:0:16:-1:0|1:y", 0, 8, -1, 0}}),
            SegmentKey(stamp, "", -1, {{"x", 0, 16, -1, 0}, {"y", 0, 8, -1, 0}}));
}

TEST(SelectTensors, IncludeThenExcludeAndNoneLeftIsAnError) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("m.safetensors"), testing::SafetensorsBuilder()
                                                    .Add("model.embed", "U8", {4}, "abcd")
                                                    .Add("model.engram.table", "U8", {2}, "ef")
                                                    .Add("mtp.head", "U8", {2}, "gh")
                                                    .Build());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog all, BuildCatalog(dir.Join("m.safetensors")));
  LoadRequest r;
  r.include_patterns = {"model."};
  r.exclude_patterns = {".engram."};
  Catalog c = all;
  ASSERT_TRUE(SelectTensors(r, c).ok());
  ASSERT_EQ(c.tensors.size(), 1u);
  EXPECT_EQ(c.tensors[0].name, "model.embed");
  EXPECT_EQ(c.total_bytes(), 4u);
  EXPECT_NE(c.Find("model.embed"), nullptr);
  EXPECT_EQ(c.Find("mtp.head"), nullptr);
  EXPECT_EQ(c.files.size(), 1u);
  r.include_patterns = {"nothing-matches"};
  Catalog none = all;
  absl::Status st = SelectTensors(r, none);
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument,
                           "the subset selects none of the 3 tensors of " + dir.Join("m.safetensors") +
                               " (include 'nothing-matches'; exclude '.engram.')"));
  EXPECT_TRUE(st.GetPayload(kInvalidLoadRequestPayload).has_value());
  LoadRequest everything;
  Catalog same = all;
  ASSERT_TRUE(SelectTensors(everything, same).ok());
  EXPECT_EQ(same.tensors.size(), 3u);
}

TEST(CheckLoadPatterns, BoundsEveryListAndRefusesEmptySubsetPatterns) {
  LoadRequest r;
  r.host_resident_patterns = {""};  // matches every tensor: allowed, as before
  EXPECT_TRUE(CheckLoadPatterns(r).ok());
  r.include_patterns = {"a", ""};
  EXPECT_THAT(CheckLoadPatterns(r), StatusIs(absl::StatusCode::kInvalidArgument, "--include pattern 2 is empty"));
  r.include_patterns = {};
  r.exclude_patterns = {std::string(kMaxPatternBytes + 1, 'x')};
  EXPECT_THAT(CheckLoadPatterns(r),
              StatusIs(absl::StatusCode::kInvalidArgument, "--exclude pattern 1 is 1025 bytes; at most 1024 are allowed"));
  r.exclude_patterns = {};
  r.host_resident_patterns.assign(kMaxLoadPatterns + 1, "p");
  EXPECT_THAT(CheckLoadPatterns(r), StatusIs(absl::StatusCode::kInvalidArgument,
                                             "--host-resident was given 1025 patterns; at most 1024 are allowed"));
  r.host_resident_patterns = {};
  r.tp_rules = {{"", 0}};
  EXPECT_THAT(CheckLoadPatterns(r), StatusIs(absl::StatusCode::kInvalidArgument, "--tp-rule pattern 1 is empty"));
}

}  // namespace
}  // namespace weightd
