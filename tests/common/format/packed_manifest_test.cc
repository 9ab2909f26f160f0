// The packed tensor table: round trip, the exact byte layout of docs/api.md,
// and every truncation and single-byte corruption of a table parsing to
// DATA_LOSS or to records that stay inside the buffer.
#include "common/format/packed_manifest.h"

#include <cstring>
#include <random>

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

const std::vector<uint64_t> kShapeA = {4, 8};
const std::vector<uint64_t> kFullA = {8, 8};
const std::vector<uint64_t> kShapeB = {3};

std::string TwoTensorTable() {
  PackedManifestWriter w;
  w.Add({"model.a", "BF16", kShapeA, kFullA, kPackedPlacementDevice, 1, 4096, 64, 0, 4, 0x0123456789abcdefull});
  w.Add({"b", "F32", kShapeB, kShapeB, kPackedPlacementHost, 0, 0, 12, -1, 0, 7});
  absl::StatusOr<std::string> bytes = w.Finish();
  EXPECT_TRUE(bytes.ok()) << bytes.status();
  return *bytes;
}

uint32_t U32At(const std::string& b, size_t at) {
  uint32_t v;
  std::memcpy(&v, b.data() + at, 4);  // the test host is little-endian (x86-64, arm64)
  return v;
}

TEST(PackedManifest, RoundTripsEveryField) {
  std::string bytes = TwoTensorTable();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PackedManifest m, PackedManifest::Parse(bytes));
  ASSERT_EQ(m.size(), 2u);
  PackedTensor a = m.Tensor(0);
  EXPECT_EQ(a.name, "model.a");
  EXPECT_EQ(a.dtype, "BF16");
  ASSERT_EQ(a.ndim, 2u);
  EXPECT_EQ(a.Dim(0), 4u);
  EXPECT_EQ(a.Dim(1), 8u);
  ASSERT_EQ(a.full_ndim, 2u);
  EXPECT_EQ(a.FullDim(0), 8u);
  EXPECT_EQ(a.FullDim(1), 8u);
  EXPECT_EQ(a.placement, kPackedPlacementDevice);
  EXPECT_EQ(a.segment, 1u);
  EXPECT_EQ(a.offset, 4096u);
  EXPECT_EQ(a.nbytes, 64u);
  EXPECT_EQ(a.split_dim, 0);
  EXPECT_EQ(a.split_start, 4u);
  EXPECT_EQ(a.content_hash, 0x0123456789abcdefull);
  PackedTensor b = m.Tensor(1);
  EXPECT_EQ(b.name, "b");
  EXPECT_EQ(b.dtype, "F32");
  ASSERT_EQ(b.ndim, 1u);
  EXPECT_EQ(b.Dim(0), 3u);
  EXPECT_EQ(b.full_ndim, 1u);
  EXPECT_EQ(b.placement, kPackedPlacementHost);
  EXPECT_EQ(b.split_dim, -1);
  EXPECT_EQ(b.content_hash, 7u);
}

// The layout docs/api.md documents, byte for byte.
TEST(PackedManifest, MatchesTheDocumentedLayout) {
  std::string b = TwoTensorTable();
  // header 32 + 2 records of 64 + 6 dims of 8 + dtypes (1+4 + 1+3) + names 8
  ASSERT_EQ(b.size(), 32u + 128 + 48 + 9 + 8);
  EXPECT_EQ(b.substr(0, 4), "WDPM");
  EXPECT_EQ(b[4], 1);  // version 1, u16
  EXPECT_EQ(b[5], 0);
  EXPECT_EQ(b[6], 64);  // record_bytes
  EXPECT_EQ(U32At(b, 8), 2u);   // tensors
  EXPECT_EQ(U32At(b, 12), 2u);  // dtypes
  EXPECT_EQ(U32At(b, 16), 9u);  // dtype bytes
  EXPECT_EQ(U32At(b, 20), 6u);  // dims
  EXPECT_EQ(U32At(b, 24), 8u);  // name bytes
  EXPECT_EQ(U32At(b, 28), 0u);
  const size_t r1 = 32 + 64;  // the second record
  EXPECT_EQ(U32At(b, r1 + 8), 12u);        // nbytes
  EXPECT_EQ(U32At(b, r1 + 24), 7u);        // content hash, low half
  EXPECT_EQ(U32At(b, r1 + 32), 7u);        // name offset: after "model.a"
  EXPECT_EQ(U32At(b, r1 + 36), 1u);        // name length
  EXPECT_EQ(U32At(b, r1 + 44), 4u);        // dims start: after a's 2 + 2
  EXPECT_EQ(U32At(b, r1 + 56), 0xffffffffu);  // split_dim -1
  EXPECT_EQ(b[r1 + 60], 1);                // dtype index 1: "F32"
  EXPECT_EQ(b[r1 + 62], 1);                // placement host
  EXPECT_EQ(b.substr(32 + 128 + 48, 9), std::string("\x04" "BF16" "\x03" "F32"));
  EXPECT_EQ(b.substr(b.size() - 8), "model.ab");
}

TEST(PackedManifest, EmptyTableIsTheHeaderAlone) {
  absl::StatusOr<std::string> bytes = PackedManifestWriter().Finish();
  WEIGHTD_ASSERT_OK(bytes);
  EXPECT_EQ(bytes->size(), kPackedManifestHeaderBytes);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PackedManifest m, PackedManifest::Parse(*bytes));
  EXPECT_EQ(m.size(), 0u);
}

TEST(PackedManifest, EveryTruncationIsDataLoss) {
  std::string bytes = TwoTensorTable();
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::string cut = bytes.substr(0, n);  // its own allocation: ASan sees a read past it
    EXPECT_EQ(PackedManifest::Parse(cut).status().code(), absl::StatusCode::kDataLoss) << n << " bytes";
  }
  EXPECT_EQ(PackedManifest::Parse(bytes + "x").status().code(), absl::StatusCode::kDataLoss);
}

TEST(PackedManifest, NamesTheBrokenRule) {
  std::string b = TwoTensorTable();
  std::string bad = b;
  bad[0] = 'X';
  EXPECT_THAT(PackedManifest::Parse(bad), StatusIs(absl::StatusCode::kDataLoss, "bad magic"));
  bad = b;
  bad[4] = 2;
  EXPECT_THAT(PackedManifest::Parse(bad), StatusIs(absl::StatusCode::kDataLoss, "version 2"));
  bad = b;
  bad[6] = 63;
  EXPECT_THAT(PackedManifest::Parse(bad), StatusIs(absl::StatusCode::kDataLoss, "record_bytes 63"));
  bad = b;
  bad[32 + 64 + 36] = 9;  // second name 9 bytes long
  EXPECT_THAT(PackedManifest::Parse(bad), StatusIs(absl::StatusCode::kDataLoss, "tensor record 1: name runs past"));
  bad = b;
  bad[32 + 48] = 5;  // first tensor: 5 dims
  EXPECT_THAT(PackedManifest::Parse(bad), StatusIs(absl::StatusCode::kDataLoss, "tensor record 0: dims run past"));
  bad = b;
  bad[32 + 60] = 2;
  EXPECT_THAT(PackedManifest::Parse(bad), StatusIs(absl::StatusCode::kDataLoss, "dtype index past"));
  bad = b;
  bad[32 + 62] = 3;
  EXPECT_THAT(PackedManifest::Parse(bad), StatusIs(absl::StatusCode::kDataLoss, "placement 3"));
  bad = b;
  bad[32 + 128 + 48] = 0;  // first dtype entry empty
  EXPECT_THAT(PackedManifest::Parse(bad), StatusIs(absl::StatusCode::kDataLoss, "dtype table entry 0 is empty"));
  bad = b;
  bad[32 + 128 + 48] = 9;  // first dtype entry longer than the table
  EXPECT_THAT(PackedManifest::Parse(bad), StatusIs(absl::StatusCode::kDataLoss, "runs past the table"));
}

// Record sizes above 64 are read as 64 and the rest skipped (a later
// version may append fields to a record).
TEST(PackedManifest, ReadsLongerRecords) {
  std::string b = TwoTensorTable();
  std::string wide = b.substr(0, 32);
  wide[6] = 80;
  for (int i = 0; i < 2; ++i) wide += b.substr(32 + 64 * i, 64) + std::string(16, '\x7f');
  wide += b.substr(32 + 128);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(PackedManifest m, PackedManifest::Parse(wide));
  EXPECT_EQ(m.Tensor(1).name, "b");
  EXPECT_EQ(m.Tensor(0).FullDim(1), 8u);
}

// Every single-byte change and many random multi-byte ones either parse to
// records whose names and dims lie in the buffer, or fail with DATA_LOSS.
TEST(PackedManifest, CorruptBytesNeverReadOutside) {
  std::string b = TwoTensorTable();
  auto check = [&](const std::string& bad) {
    absl::StatusOr<PackedManifest> m = PackedManifest::Parse(bad);
    if (!m.ok()) {
      EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss);
      return;
    }
    const char* lo = bad.data();
    const char* hi = bad.data() + bad.size();
    for (uint32_t i = 0; i < m->size(); ++i) {
      PackedTensor t = m->Tensor(i);
      EXPECT_TRUE(t.name.data() >= lo && t.name.data() + t.name.size() <= hi);
      EXPECT_TRUE(t.dtype.data() >= lo && t.dtype.data() + t.dtype.size() <= hi);
      EXPECT_TRUE(t.dims >= lo && t.dims + 8ull * (t.ndim + t.full_ndim) <= hi);
    }
  };
  for (size_t at = 0; at < b.size(); ++at) {
    for (int v : {0x00, 0x01, 0x7f, 0x80, 0xff}) {
      std::string bad = b;
      bad[at] = static_cast<char>(v);
      check(bad);
    }
  }
  std::mt19937 rng(14);
  for (int round = 0; round < 20000; ++round) {
    std::string bad = b;
    for (int k = 0; k < 4; ++k) bad[rng() % bad.size()] = static_cast<char>(rng());
    check(bad);
  }
}

TEST(PackedManifest, RefusesWhatDoesNotFit) {
  PackedManifestWriter w;
  w.Add({"x", std::string(256, 'D'), kShapeB, kShapeB});
  EXPECT_THAT(w.Finish(), StatusIs(absl::StatusCode::kInvalidArgument, "dtype names of 1-255 bytes"));
}

}  // namespace
}  // namespace weightd
