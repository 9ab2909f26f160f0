// GetManifest paging: the tensor-count and encoded-byte caps of one page.
#include "server/api/manifest_pages.h"

#include <string>

#include "gtest/gtest.h"

namespace weightd {
namespace {

// One rank of `count` host tensors named `<name_bytes of 'n'><i>`, one segment.
std::unique_ptr<ModelGeneration> Model(size_t count, size_t name_bytes) {
  auto m = std::make_unique<ModelGeneration>();
  m->request.name = "m";
  m->generation = 3;
  m->fingerprint = std::string(32, 'f');
  m->segments.push_back({Placement::kHost, 4 * count, SegmentBackend::kMemfd, "", -1, ""});
  m->ranks.resize(1);
  m->ranks[0].segments = {0};
  for (size_t i = 0; i < count; ++i) {
    TensorRecord t;
    t.name = std::string(name_bytes, 'n') + std::to_string(i);
    t.shape = t.full_shape = {1};
    t.offset = 4 * i;
    t.nbytes = 4;
    m->ranks[0].tensors.push_back(t);
  }
  return m;
}

// Pages as GetManifest cuts them: the tensor count of each.
std::vector<int> PageSizes(const ModelGeneration& m, uint32_t requested, size_t* max_bytes) {
  std::vector<int> sizes;
  size_t next = 0;
  *max_bytes = 0;
  do {
    v1::ManifestPage page;
    next = FillManifestPage(m, 0, next, ManifestPageTensors(requested), &page);
    sizes.push_back(page.tensors_size());
    *max_bytes = std::max(*max_bytes, page.ByteSizeLong());
    EXPECT_EQ(page.segments_size(), sizes.size() == 1 ? 1 : 0);
    EXPECT_EQ(page.total_tensors(), m.ranks[0].tensors.size());
  } while (next < m.ranks[0].tensors.size());
  return sizes;
}

TEST(ManifestPages, ZeroMeansTheDefaultAndHugeRequestsAreClamped) {
  EXPECT_EQ(ManifestPageTensors(0), 4096u);
  EXPECT_EQ(ManifestPageTensors(1), 1u);
  EXPECT_EQ(ManifestPageTensors(4096), 4096u);
  EXPECT_EQ(ManifestPageTensors(4097), 4096u);
  EXPECT_EQ(ManifestPageTensors(UINT32_MAX), 4096u);  // issue 12: page_size 2^32-1
}

TEST(ManifestPages, ShortNamesAreCutByCount) {
  auto m = Model(40000, 8);
  size_t max_bytes = 0;
  std::vector<int> expected(9, 4096);
  expected.push_back(3136);
  EXPECT_EQ(PageSizes(*m, UINT32_MAX, &max_bytes), expected);
  EXPECT_LE(max_bytes, kMaxManifestPageBytes);
  EXPECT_EQ(PageSizes(*m, 1000, &max_bytes), std::vector<int>(40, 1000));
}

TEST(ManifestPages, LongNamesAreCutByEncodedBytes) {
  auto m = Model(25, 100'000);  // entries of about 100 KB: 10 fit in 1 MiB
  size_t max_bytes = 0;
  std::vector<int> sizes = PageSizes(*m, 0, &max_bytes);
  EXPECT_EQ(sizes, (std::vector<int>{10, 10, 5}));
  EXPECT_LE(max_bytes, kMaxManifestPageBytes);
  EXPECT_GT(max_bytes, kMaxManifestPageBytes - 110'000);  // full: one more entry would not fit
}

TEST(ManifestPages, AnEntryLargerThanAPageGoesAloneOnItsPage) {
  auto m = Model(3, 2 << 20);
  size_t max_bytes = 0;
  EXPECT_EQ(PageSizes(*m, 0, &max_bytes), (std::vector<int>{1, 1, 1}));
  EXPECT_GT(max_bytes, kMaxManifestPageBytes);
}

}  // namespace
}  // namespace weightd
