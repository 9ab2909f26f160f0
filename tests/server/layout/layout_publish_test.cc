// What BeginLayout accepts (server/layout/layout_publish.h): the bounds on
// keys, identities, tensor counts, dims and sizes, each refused with the
// rule and the field named.
#include "server/layout/layout_publish.h"

#include <string>

#include "gtest/gtest.h"

namespace weightd {
namespace {

LayoutTensorSpec Spec(std::string name, DType dtype, std::vector<uint64_t> shape, std::vector<uint64_t> strides = {}) {
  LayoutTensorSpec s;
  s.name = std::move(name);
  s.dtype = dtype;
  s.shape = std::move(shape);
  s.strides = std::move(strides);
  return s;
}

LayoutRequest Request() {
  LayoutRequest r;
  r.model = "m";
  r.key = "vllm/fp8-marlin/tp2";
  r.identity = {{"engine", "vllm"}};
  r.tensors.push_back(Spec("w", DType::kBF16, {4, 8}));
  return r;
}

TEST(LayoutTensorBytes, ContiguousIsElementsTimesWidth) {
  EXPECT_EQ(*LayoutTensorBytes(Spec("w", DType::kBF16, {4, 8})), 64u);
  EXPECT_EQ(*LayoutTensorBytes(Spec("s", DType::kF32, {})), 4u);  // a scalar
  EXPECT_EQ(*LayoutTensorBytes(Spec("e", DType::kF32, {3, 0, 5})), 0u);
  EXPECT_EQ(*LayoutTensorBytes(Spec("p", DType::kF4, {3, 2})), 3u);  // 6 x 4 bits
}

TEST(LayoutTensorBytes, StridesCoverTheSpanTheyReach) {
  // A [4, 8] view of a transposed [8, 4] matrix: strides (1, 4) reach
  // element 3 * 1 + 7 * 4 = 31, so 32 elements.
  EXPECT_EQ(*LayoutTensorBytes(Spec("t", DType::kI8, {4, 8}, {1, 4})), 32u);
  // Rows padded to 16 elements: 3 rows of 10 reach 2 * 16 + 9 = 41 -> 42 elements.
  EXPECT_EQ(*LayoutTensorBytes(Spec("p", DType::kF16, {3, 10}, {16, 1})), 84u);
  // A broadcast (stride 0) row: one row's worth.
  EXPECT_EQ(*LayoutTensorBytes(Spec("b", DType::kF32, {5, 4}, {0, 1})), 16u);
}

TEST(LayoutTensorBytes, RefusesWhatItCannotSize) {
  EXPECT_EQ(LayoutTensorBytes(Spec("w", DType::kF32, std::vector<uint64_t>(17, 1))).status().message(),
            "layout tensor 'w': 17 dims; at most 16");
  EXPECT_EQ(LayoutTensorBytes(Spec("w", DType::kF32, {2, 3}, {1})).status().message(),
            "layout tensor 'w': 1 strides for 2 dims");
  EXPECT_EQ(LayoutTensorBytes(Spec("w", DType::kF4, {2, 4}, {4, 1})).status().message(),
            "layout tensor 'w': strides on packed dtype F4 (4 bits)");
  EXPECT_EQ(LayoutTensorBytes(Spec("w", DType::kF4, {3})).status().message(),
            "layout tensor 'w': 3 elements of F4 (4 bits) do not fill whole bytes (safetensors packs sub-byte "
            "dtypes)");
  const std::string too_big = "layout tensor 'w': more than 1099511627776 bytes";
  EXPECT_EQ(LayoutTensorBytes(Spec("w", DType::kU8, {uint64_t{1} << 41})).status().message(), too_big);
  // shape * shape overflows 64 bits
  EXPECT_EQ(LayoutTensorBytes(Spec("w", DType::kU8, {uint64_t{1} << 32, uint64_t{1} << 32})).status().message(),
            too_big);
  // (shape - 1) * stride overflows 64 bits, though the shape alone is small
  EXPECT_EQ(LayoutTensorBytes(Spec("w", DType::kF32, {3, 2}, {uint64_t{1} << 63, 1})).status().message(), too_big);
  // the sum of the reaches passes the bound
  EXPECT_EQ(LayoutTensorBytes(Spec("w", DType::kU8, {2, 2}, {uint64_t{1} << 42, 1})).status().message(), too_big);
  // 1 TiB exactly is the largest tensor; one element more is refused.
  EXPECT_EQ(*LayoutTensorBytes(Spec("w", DType::kF32, {uint64_t{1} << 38})), uint64_t{1} << 40);
  EXPECT_EQ(LayoutTensorBytes(Spec("w", DType::kF32, {(uint64_t{1} << 38) + 1})).status().message(), too_big);
  EXPECT_TRUE(absl::IsInvalidArgument(LayoutTensorBytes(Spec("w", DType::kU8, {uint64_t{1} << 41})).status()));
}

TEST(ValidateLayoutRequest, AcceptsAWellFormedRequest) { EXPECT_TRUE(ValidateLayoutRequest(Request()).ok()); }

TEST(ValidateLayoutRequest, KeysAreBoundedAndSpelledSafely) {
  LayoutRequest r = Request();
  r.key = "";
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "layout key '' must be 1..256 bytes of [A-Za-z0-9._:/+=-]");
  r.key = "has space";
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "layout key 'has space' must be 1..256 bytes of [A-Za-z0-9._:/+=-]");
  r.key = std::string(256, 'k');
  EXPECT_TRUE(ValidateLayoutRequest(r).ok());
  r.key = std::string(257, 'k');
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateLayoutRequest(r)));
  r.key = "a+b=c:d/e.f_g-h";
  EXPECT_TRUE(ValidateLayoutRequest(r).ok());
}

TEST(ValidateLayoutRequest, IdentitiesAreBounded) {
  LayoutRequest r = Request();
  for (int i = 0; i < 65; ++i) r.identity["k" + std::to_string(i)] = "v";
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "the layout identity has 66 fields; at most 64");
  r = Request();
  r.identity = {{"bad key", "v"}};
  EXPECT_EQ(ValidateLayoutRequest(r).message(),
            "layout identity field 'bad key' must be 1..128 bytes of [A-Za-z0-9._-]");
  r.identity = {{std::string(129, 'k'), "v"}};
  EXPECT_TRUE(absl::IsInvalidArgument(ValidateLayoutRequest(r)));
  r.identity = {{"engine", std::string(1025, 'v')}};
  EXPECT_EQ(ValidateLayoutRequest(r).message(),
            "layout identity field 'engine' must have a value of at most 1024 bytes of printable ASCII");
  r.identity = {{"engine", "tab\there"}};
  EXPECT_EQ(ValidateLayoutRequest(r).message(),
            "layout identity field 'engine' must have a value of at most 1024 bytes of printable ASCII");
  r.identity = {{"engine", std::string(1024, 'v')}};
  EXPECT_TRUE(ValidateLayoutRequest(r).ok());
}

TEST(ValidateLayoutRequest, TensorsAreCountedNamedAndSized) {
  LayoutRequest r = Request();
  r.tensors.clear();
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "a layout holds 1..1048576 tensors; this one declares 0");
  r.tensors.assign(kMaxLayoutTensors + 1, Spec("x", DType::kU8, {1}));
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "a layout holds 1..1048576 tensors; this one declares 1048577");
  r = Request();
  r.tensors.push_back(Spec("w", DType::kU8, {1}));
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "layout tensor 'w' appears twice");
  r = Request();
  r.tensors.push_back(Spec("", DType::kU8, {1}));
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "layout tensor 1 has an empty name");
  r = Request();
  r.tensors.push_back(Spec(std::string(1025, 'n'), DType::kU8, {1}));
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "layout tensor 1 has a name of 1025 bytes; at most 1024");
  r = Request();
  r.tensors.push_back(Spec("x", DType::kF32, {2, 2}, {2}));
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "layout tensor 'x': 1 strides for 2 dims");
  // Each tensor fits, all of them do not.
  r = Request();
  r.tensors = {Spec("a", DType::kU8, {uint64_t{1} << 39}), Spec("b", DType::kU8, {uint64_t{1} << 39}),
               Spec("c", DType::kU8, {1})};
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "the layout's tensors exceed 1099511627776 bytes");
}

TEST(ValidateLayoutRequest, WaitSecondsAreBounded) {
  LayoutRequest r = Request();
  r.wait_seconds = 3601;
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "wait_seconds must be within [0, 3600]");
  r.wait_seconds = -1;
  EXPECT_EQ(ValidateLayoutRequest(r).message(), "wait_seconds must be within [0, 3600]");
  r.wait_seconds = 3600;
  EXPECT_TRUE(ValidateLayoutRequest(r).ok());
}

}  // namespace
}  // namespace weightd
