// Attach's reply bodies (server/api/attach_encoding.h): encoded once per
// generation and rank, shared by every reply, and gone once the generation
// is freed.
#include "server/api/attach_encoding.h"

#include <memory>
#include <string>

#include "gtest/gtest.h"
#include "weightd/v1/weightd.pb.h"

namespace weightd {
namespace {

// `ranks` ranks of one host tensor "<prefix><rank>" each, in one segment.
// Made as the registry makes generations (unique_ptr, then shared), so a
// freed generation's memory goes back at once and its address may be reused.
std::shared_ptr<ModelGeneration> Model(uint64_t generation, uint32_t ranks, const std::string& prefix = "t") {
  auto m = std::make_unique<ModelGeneration>();
  m->request.name = "m";
  m->generation = generation;
  m->segments.push_back({Placement::kHost, 4096, SegmentBackend::kMemfd, "", -1, ""});
  m->ranks.resize(ranks);
  for (uint32_t r = 0; r < ranks; ++r) {
    m->ranks[r].segments = {0};
    TensorRecord t;
    t.name = prefix + std::to_string(r);
    t.shape = t.full_shape = {4};
    t.nbytes = 16;
    t.offset = 64 * r;
    m->ranks[r].tensors.push_back(t);
  }
  return std::shared_ptr<ModelGeneration>(std::move(m));
}

TEST(AttachEncodingCache, EachEncodingIsBuiltOnceAndShared) {
  AttachEncodingCache cache;
  auto m = Model(1, 2);
  std::shared_ptr<const std::string> r0 = cache.Entries(m, 0);
  std::shared_ptr<const std::string> r1 = cache.Entries(m, 1);
  EXPECT_EQ(cache.Entries(m, 0), r0);  // the same bytes, not a copy
  EXPECT_NE(r0, r1);
  v1::AttachResponse body;
  ASSERT_TRUE(body.ParseFromString(*r1));
  ASSERT_EQ(body.tensors_size(), 1);
  EXPECT_EQ(body.tensors(0).name(), "t1");
  EXPECT_EQ(body.segments_size(), 1);

  std::shared_ptr<const std::string> packed = cache.Packed(m, 0);
  ASSERT_NE(packed, nullptr);
  EXPECT_EQ(cache.Packed(m, 0), packed);
  ASSERT_TRUE(body.ParseFromString(*packed));
  EXPECT_EQ(body.tensors_size(), 0);
  EXPECT_FALSE(body.packed_tensors().empty());
  EXPECT_EQ(cache.size(), 1u);
}

TEST(AttachEncodingCache, AFreedGenerationsEncodingsGoAtTheNextLookupOrDropFreed) {
  AttachEncodingCache cache;
  auto kept = Model(1, 1);
  cache.Entries(kept, 0);
  std::weak_ptr<const std::string> gone_bytes;
  {
    auto gone = Model(2, 1);
    gone_bytes = cache.Entries(gone, 0);
    EXPECT_EQ(cache.size(), 2u);
  }
  EXPECT_FALSE(gone_bytes.expired());  // held until dropped
  EXPECT_EQ(cache.DropFreed(), 1u);
  EXPECT_TRUE(gone_bytes.expired());
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.DropFreed(), 0u);

  // A generation freed and another made right after (often at the same
  // address), with no DropFreed between: the lookup sees the old entry is
  // stale and encodes the new generation's own tensors.
  for (int i = 0; i < 20; ++i) {
    std::string before_name = "old" + std::to_string(i) + "_", after_name = "new" + std::to_string(i) + "_";
    { cache.Entries(Model(10 + i, 1, before_name), 0); }
    auto next = Model(100 + i, 1, after_name);
    v1::AttachResponse body;
    ASSERT_TRUE(body.ParseFromString(*cache.Entries(next, 0)));
    ASSERT_EQ(body.tensors_size(), 1);
    EXPECT_EQ(body.tensors(0).name(), after_name + "0");
    v1::AttachResponse packed;
    ASSERT_TRUE(packed.ParseFromString(*cache.Packed(next, 0)));
    EXPECT_FALSE(packed.packed_tensors().empty());
  }
  EXPECT_EQ(cache.size(), 2u);  // `kept`, and the last `next`, freed but not yet dropped
  EXPECT_EQ(cache.DropFreed(), 1u);
  EXPECT_EQ(cache.size(), 1u);
}

}  // namespace
}  // namespace weightd
