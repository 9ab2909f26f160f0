// One test per safetensors rule (common/format/safetensors.h), on files built here,
// so a bare clone without ../shared still checks every rule.
#include "common/format/safetensors.h"

#include <string>

#include "common/format/format_error.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::FileImage;
using ::weightd::testing::SafetensorsBuilder;

absl::StatusOr<SafetensorsHeader> Parse(const std::string& image) { return ParseFileImage(image, "x.safetensors"); }

std::string OneTensor(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return "{\"a\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}}";
}

TEST(Safetensors, ParsesTensorsDtypeShapeAndOffsets) {
  std::string image = SafetensorsBuilder()
                          .Add("w", "F32", {2, 3}, std::string(24, '\1'))
                          .Add("b", "F16", {4}, std::string(8, '\2'))
                          .Metadata("format", "pt")
                          .Build();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SafetensorsHeader h, Parse(image));
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "w");
  EXPECT_EQ(h.tensors[0].dtype, DType::kF32);
  EXPECT_EQ(h.tensors[0].shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(h.tensors[0].begin, 0u);
  EXPECT_EQ(h.tensors[0].end, 24u);
  EXPECT_EQ(h.tensors[1].name, "b");
  EXPECT_EQ(h.tensors[1].begin, 24u);
  EXPECT_EQ(h.tensors[1].end, 32u);
  EXPECT_EQ(h.data_start % 8, 0u);
  EXPECT_EQ(h.data_length, 32u);
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(Safetensors, RefusesFileShorterThanLengthPrefix) {
  EXPECT_THAT(Parse(std::string(7, '\0')),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "x.safetensors: file is 7 bytes, shorter than the 8-byte header length prefix"));
  EXPECT_THAT(Parse(""), StatusIs(absl::StatusCode::kInvalidArgument, "file is 0 bytes"));
}

TEST(Safetensors, RefusesHeaderLengthPastEndOfFile) {
  std::string image = FileImage("{}", "");
  image[0] = static_cast<char>(0x88);  // N = 0x1388 = 5000
  image[1] = 0x13;
  EXPECT_THAT(Parse(image), StatusIs(absl::StatusCode::kInvalidArgument,
                                     "x.safetensors: header length 5000 exceeds file size 10"));
}

TEST(Safetensors, RefusesHeaderLengthAboveLimit) {
  std::string image = FileImage("{}", "");
  uint64_t n = kMaxHeaderBytes + 1;
  for (int i = 0; i < 8; ++i) image[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  EXPECT_THAT(Parse(image), StatusIs(absl::StatusCode::kInvalidArgument,
                                     "header length 100000001 exceeds the 100000000-byte limit"));
}

TEST(Safetensors, RecognisesGitLfsPointer) {
  std::string lfs = "version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 1234\n";
  EXPECT_THAT(Parse(lfs), StatusIs(absl::StatusCode::kInvalidArgument,
                                   "x.safetensors: git-LFS pointer, not a safetensors file"));
}

// Regression: a valid file whose header is 640 bytes starts 80 02 00 .., the
// same two bytes as a protocol-2 pickle; it must parse, not be sniffed.
TEST(Safetensors, HeaderOf640BytesIsNotMistakenForPickle) {
  std::string header = "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
  header.append(640 - header.size(), ' ');
  std::string image = FileImage(header, "z");
  ASSERT_EQ(static_cast<unsigned char>(image[0]), 0x80);
  ASSERT_EQ(image[1], 0x02);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SafetensorsHeader h, Parse(image));
  EXPECT_EQ(h.header_length, 640u);
  EXPECT_EQ(h.tensors.size(), 1u);
  EXPECT_THAT(Parse(std::string("\x80\x02}q\x00(X", 8)), StatusIs(absl::StatusCode::kInvalidArgument, "Python pickle"));
}

TEST(Safetensors, RecognisesZipArchive) {
  EXPECT_THAT(Parse(std::string("PK\x03\x04", 4) + std::string(60, '\0')),
              StatusIs(absl::StatusCode::kInvalidArgument, "zip archive"));
}

TEST(Safetensors, RefusesHeaderThatIsNotJson) {
  EXPECT_THAT(Parse(FileImage("{not json", "")),
              StatusIs(absl::StatusCode::kInvalidArgument, "header is not valid JSON at header byte"));
}

TEST(Safetensors, RefusesHeaderThatIsNotUtf8) {
  EXPECT_THAT(Parse(FileImage("{\"\xff\":1}", "")), StatusIs(absl::StatusCode::kInvalidArgument, "not valid JSON"));
}

TEST(Safetensors, RefusesNulPadding) {
  EXPECT_THAT(Parse(FileImage(std::string("{}\0\0\0\0\0\0", 8), "")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "x.safetensors: header holds a NUL byte at header byte 2; only JSON whitespace may pad it"));
}

TEST(Safetensors, RefusesByteOrderMark) {
  EXPECT_THAT(Parse(FileImage("\xEF\xBB\xBF{}   ", "")),
              StatusIs(absl::StatusCode::kInvalidArgument, "byte-order mark"));
}

TEST(Safetensors, AcceptsJsonWhitespaceAroundObject) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SafetensorsHeader h, Parse(FileImage("\t\n{}  \r\n  ", "")));
  EXPECT_EQ(h.tensors.size(), 0u);
}

TEST(Safetensors, RefusesHeaderThatIsNotAnObject) {
  EXPECT_THAT(Parse(FileImage("[1,2]", "")), StatusIs(absl::StatusCode::kInvalidArgument, "not an object"));
  EXPECT_THAT(Parse(FileImage("3", "")), StatusIs(absl::StatusCode::kInvalidArgument, "not a JSON object"));
}

TEST(Safetensors, MetadataMustMapStringsToStrings) {
  EXPECT_THAT(Parse(FileImage("{\"__metadata__\":{\"epoch\":3}}", "")),
              StatusIs(absl::StatusCode::kInvalidArgument, "__metadata__ value of 'epoch' must be a string"));
  EXPECT_THAT(Parse(FileImage("{\"__metadata__\":{\"a\":[\"x\"]}}", "")),
              StatusIs(absl::StatusCode::kInvalidArgument, "must be a string, not an array"));
}

TEST(Safetensors, AcceptsEveryDtypeWithItsBitSize) {
  // Each dtype with 8 elements: bytes = 8 * bits / 8 = bits.
  const std::pair<const char*, int> kBits[] = {
      {"BOOL", 8}, {"U8", 8}, {"I8", 8}, {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},
      {"F8_E5M2FNUZ", 8}, {"F4", 4}, {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"I16", 16}, {"U16", 16}, {"F16", 16},
      {"BF16", 16}, {"I32", 32}, {"U32", 32}, {"F32", 32}, {"C64", 64}, {"F64", 64}, {"I64", 64}, {"U64", 64}};
  ASSERT_EQ(std::size(kBits), static_cast<size_t>(kDTypeCount));
  SafetensorsBuilder builder;
  for (const auto& [name, bits] : kBits) builder.Add(name, name, {8}, std::string(bits, '\0'));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SafetensorsHeader h, Parse(builder.Build()));
  ASSERT_EQ(h.tensors.size(), 22u);
  for (size_t i = 0; i < h.tensors.size(); ++i) {
    EXPECT_EQ(DTypeName(h.tensors[i].dtype), kBits[i].first);
    EXPECT_EQ(h.tensors[i].nbytes(), static_cast<uint64_t>(kBits[i].second));
  }
}

TEST(Safetensors, RefusesUnknownDtype) {
  EXPECT_THAT(Parse(FileImage(OneTensor("F12", "[1]", "[0,1]"), "x")),
              StatusIs(absl::StatusCode::kInvalidArgument, "x.safetensors: tensor 'a': unknown dtype 'F12'"));
}

TEST(Safetensors, RefusesSubByteCountThatDoesNotFillBytes) {
  EXPECT_THAT(Parse(FileImage(OneTensor("F4", "[3]", "[0,2]"), "xx")),
              StatusIs(absl::StatusCode::kInvalidArgument, "3 x F4 is 12 bits, not a whole number of bytes"));
  EXPECT_THAT(Parse(FileImage(OneTensor("F6_E3M2", "[3]", "[0,2]"), "xx")),
              StatusIs(absl::StatusCode::kInvalidArgument, "3 x F6_E3M2 is 18 bits"));
}

TEST(Safetensors, PacksF4AndF6) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SafetensorsHeader h, Parse(FileImage(OneTensor("F4", "[4,6]", "[0,12]"), std::string(12, 'x'))));
  EXPECT_EQ(h.tensors[0].nbytes(), 12u);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(h, Parse(FileImage(OneTensor("F6_E2M3", "[4,4]", "[0,12]"), std::string(12, 'x'))));
  EXPECT_EQ(h.tensors[0].nbytes(), 12u);
}

TEST(Safetensors, RefusesElementCountOverflow) {
  EXPECT_THAT(Parse(FileImage(OneTensor("F32", "[1099511627776,1099511627776]", "[0,4]"), "abcd")),
              StatusIs(absl::StatusCode::kInvalidArgument, "overflows 64 bits"));
}

TEST(Safetensors, RefusesByteSizeOverflow) {
  // 2^62 elements fit in 64 bits; 2^62 * 32 bits do not.
  EXPECT_THAT(Parse(FileImage(OneTensor("F32", "[4611686018427387904]", "[0,4]"), "abcd")),
              StatusIs(absl::StatusCode::kInvalidArgument, "byte size of 4611686018427387904 x F32 overflows"));
}

TEST(Safetensors, RefusesNegativeOrFractionalDimension) {
  EXPECT_THAT(Parse(FileImage(OneTensor("U8", "[-1]", "[0,1]"), "a")),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensor 'a': dimension -1 is negative"));
  EXPECT_THAT(Parse(FileImage(OneTensor("U8", "[1.5]", "[0,1]"), "a")),
              StatusIs(absl::StatusCode::kInvalidArgument, "shape holds 1.5, not an integer"));
  EXPECT_THAT(Parse(FileImage(OneTensor("U8", "[\"1\"]", "[0,1]"), "a")),
              StatusIs(absl::StatusCode::kInvalidArgument, "shape must hold non-negative integers"));
}

TEST(Safetensors, RefusesMalformedDataOffsets) {
  EXPECT_THAT(Parse(FileImage(OneTensor("U8", "[1]", "[0,1,2]"), "a")),
              StatusIs(absl::StatusCode::kInvalidArgument, "data_offsets must hold exactly 2 integers"));
  EXPECT_THAT(Parse(FileImage(OneTensor("U8", "[1]", "[0]"), "a")),
              StatusIs(absl::StatusCode::kInvalidArgument, "data_offsets must hold exactly 2 integers"));
  EXPECT_THAT(Parse(FileImage(OneTensor("U8", "[0]", "[4,0]"), "abcd")),
              StatusIs(absl::StatusCode::kInvalidArgument, "data_offsets [4, 0] end before they begin"));
}

TEST(Safetensors, RefusesMissingField) {
  EXPECT_THAT(Parse(FileImage("{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", "a")),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensor 'a': missing field 'data_offsets'"));
}

TEST(Safetensors, IgnoresUnknownTensorFields) {
  std::string header = "{\"a\":{\"dtype\":\"U8\",\"extra\":{\"x\":[1,{}]},\"shape\":[1],\"data_offsets\":[0,1]}}";
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SafetensorsHeader h, Parse(FileImage(header, "z")));
  EXPECT_EQ(h.tensors.size(), 1u);
}

TEST(Safetensors, RefusesByteLengthThatDisagreesWithShape) {
  EXPECT_THAT(Parse(FileImage(OneTensor("F32", "[3]", "[0,8]"), std::string(8, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "tensor 'a': shape [3] x F32 needs 12 bytes but data_offsets [0, 8] give 8"));
}

TEST(Safetensors, OrdersTensorsByOffsetNotJsonOrder) {
  std::string header =
      "{\"z\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[2,4]},"
      "\"y\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}";
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SafetensorsHeader h, Parse(FileImage(header, "abcd")));
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "y");
  EXPECT_EQ(h.tensors[1].name, "z");
}

TEST(Safetensors, RefusesDataNotStartingAtZero) {
  EXPECT_THAT(Parse(FileImage(OneTensor("U8", "[2]", "[2,4]"), "abcd")),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensor 'a': data starts at offset 2, not 0"));
}

TEST(Safetensors, RefusesHoleBetweenTensors) {
  std::string header =
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
      "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]}}";
  EXPECT_THAT(Parse(FileImage(header, "abcdef")),
              StatusIs(absl::StatusCode::kInvalidArgument, "bytes [2, 4) between tensors 'a' and 'b' belong to no tensor"));
}

TEST(Safetensors, RefusesOverlappingTensors) {
  std::string header =
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]},"
      "\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[2,6]}}";
  EXPECT_THAT(Parse(FileImage(header, "abcdef")),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensors 'a' and 'b' overlap at data bytes [2, 4)"));
}

TEST(Safetensors, RefusesTruncatedData) {
  EXPECT_THAT(Parse(FileImage(OneTensor("U8", "[4]", "[0,4]"), "ab")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "truncated: tensor 'a' ends at data byte 4 but the data section holds 2 bytes"));
}

TEST(Safetensors, RefusesTrailingBytes) {
  EXPECT_THAT(Parse(FileImage(OneTensor("U8", "[4]", "[0,4]"), "abcdef")),
              StatusIs(absl::StatusCode::kInvalidArgument, "2 trailing bytes after the last tensor"));
}

TEST(Safetensors, RefusesDuplicateTensorName) {
  std::string header =
      "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
      "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}";
  EXPECT_THAT(Parse(FileImage(header, "ab")),
              StatusIs(absl::StatusCode::kInvalidArgument, "x.safetensors: tensor name 'a' appears twice"));
}

TEST(Safetensors, RefusesControlCharactersInTensorNames) {
  std::string header = "{\"a\\nb\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
  EXPECT_THAT(Parse(FileImage(header, "z")), StatusIs(absl::StatusCode::kInvalidArgument,
                                                      "x.safetensors: tensor name holds control character 0x0A at byte 1"));
  std::string nul = "{\"p\\u0000q\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
  EXPECT_THAT(Parse(FileImage(nul, "z")), StatusIs(absl::StatusCode::kInvalidArgument, "control character 0x00 at byte 1"));
}

TEST(Safetensors, RefusesDuplicateFieldAndMetadataKey) {
  EXPECT_THAT(Parse(FileImage("{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "a")),
              StatusIs(absl::StatusCode::kInvalidArgument, "field 'dtype' appears twice"));
  EXPECT_THAT(Parse(FileImage("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", "")),
              StatusIs(absl::StatusCode::kInvalidArgument, "__metadata__ key 'k' appears twice"));
}

TEST(Safetensors, AcceptsZeroSizedAndScalarTensors) {
  std::string image = SafetensorsBuilder()
                          .Add("empty", "F32", {0, 4}, "")
                          .Add("scalar", "F64", {}, std::string(8, '\7'))
                          .Add("empty2", "BF16", {3, 0}, "")
                          .Build();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SafetensorsHeader h, Parse(image));
  ASSERT_EQ(h.tensors.size(), 3u);
  EXPECT_EQ(h.tensors[0].name, "empty");
  EXPECT_EQ(h.tensors[0].nbytes(), 0u);
  // Sorted by (begin, end): empty [0,0), scalar [0,8), empty2 [8,8).
  EXPECT_EQ(h.tensors[1].name, "scalar");
  EXPECT_TRUE(h.tensors[1].shape.empty());
  EXPECT_EQ(h.tensors[1].nbytes(), 8u);
  EXPECT_EQ(h.tensors[2].name, "empty2");
}

TEST(Safetensors, AcceptsUnalignedDataStart) {
  std::string header = OneTensor("I32", "[2,2]", "[0,16]");  // 52 bytes: data starts at 60
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SafetensorsHeader h, Parse(FileImage(header, std::string(16, '\0'))));
  EXPECT_EQ(h.data_start, 8 + header.size());
  EXPECT_NE(h.data_start % 8, 0u);
}

TEST(Safetensors, ElementCountOfRankZeroIsOne) {
  EXPECT_EQ(ElementCount({}), 1u);
  EXPECT_EQ(ElementCount({3, 0, 5}), 0u);
  EXPECT_EQ(ElementCount({1ull << 32, 1ull << 32}), std::nullopt);
}

// Regression (issue 11): a duplicate tensor name of 20,000 characters was
// quoted whole, and the message no longer fitted through gRPC's metadata.
TEST(Safetensors, QuotesALongDuplicateNameElided) {
  std::string name = std::string(96, 'a') + std::string(19'808, 'm') + std::string(96, 'z');
  std::string header = "{\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},\"" + name +
                       "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}";
  absl::StatusOr<SafetensorsHeader> parsed = Parse(FileImage(header, "ab"));
  EXPECT_EQ(parsed.status().message(), "x.safetensors: tensor name '" + std::string(96, 'a') + "…(20000 bytes)…" +
                                           std::string(96, 'z') + "' appears twice");
  EXPECT_EQ(CheckpointRuleOf(parsed.status()), CheckpointRule::kDuplicateKey);
}

TEST(Safetensors, QuotesLongNamesElidedInEveryTensorMessage) {
  std::string name(300, 'n');
  std::string quoted = "'" + std::string(96, 'n') + "…(300 bytes)…" + std::string(96, 'n') + "'";
  EXPECT_THAT(Parse(FileImage("{\"" + name + "\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}", "ab")),
              StatusIs(absl::StatusCode::kInvalidArgument, "x.safetensors: truncated: tensor " + quoted + " ends at"));
  EXPECT_THAT(Parse(FileImage("{\"a\":{\"dtype\":\"" + name + "\",\"shape\":[1],\"data_offsets\":[0,1]}}", "a")),
              StatusIs(absl::StatusCode::kInvalidArgument, "x.safetensors: tensor 'a': unknown dtype " + quoted));
}

// The reason (the metric's label) is attached where each rule is checked;
// these are the rules tests/server/ops/metrics_test.cc does not reach through
// ../shared, each with the label it had when labels were found by phrase.
TEST(Safetensors, EveryRefusalCarriesTheRuleItBroke) {
  using enum CheckpointRule;
  struct Case {
    std::string header, data;
    CheckpointRule rule;
  };
  std::vector<Case> cases = {
      {"3", "", kHeaderNotJson},
      {"\xEF\xBB\xBF{}   ", "", kHeaderNotJson},
      {"{\"\xff\":1}", "", kHeaderNotUtf8},
      {"{not json", "", kHeaderNotJson},
      {"[1,2]", "", kInvalid},
      {"{\"__metadata__\":\"x\"}", "", kBadMetadata},
      {"{\"__metadata__\":[1]}", "", kBadMetadata},
      {"{\"__metadata__\":{\"a\":{}}}", "", kBadMetadata},
      {"{\"__metadata__\":{},\"__metadata__\":{}}", "", kDuplicateKey},
      {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", "", kDuplicateKey},
      {"{\"a\":{\"dtype\":\"U8\",\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "a", kDuplicateKey},
      {"{\"a\":1}", "", kInvalid},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1]}}", "", kInvalid},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}", "a", kInvalid},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", "a", kInvalid},
      {"{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[-1,1]}}", "a", kNegativeValue},
      {"{\"a\\u0001\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", "a", kInvalid},
      {OneTensor("U8", "[4294967296,4294967296]", "[0,1]"), "a", kShapeOverflow},
      {OneTensor("F64", "[2305843009213693952]", "[0,1]"), "a", kShapeOverflow},
      {OneTensor("U8", "[1]", "[1,2]"), "ab", kOffsetsNotFromZero},
  };
  for (const Case& c : cases) {
    absl::StatusOr<SafetensorsHeader> parsed = Parse(FileImage(c.header, c.data));
    ASSERT_FALSE(parsed.ok()) << c.header;
    EXPECT_EQ(CheckpointRuleOf(parsed.status()), c.rule) << c.header << ": " << parsed.status();
  }
}

}  // namespace
}  // namespace weightd
