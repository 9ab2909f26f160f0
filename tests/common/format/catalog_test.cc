// Catalog over real checkpoints (../shared/real-checkpoints), the edge cases
// of ../shared/cases/cases.json, and generated sharded folders.
#include "common/format/catalog.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <map>

#include "common/format/format_error.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::SafetensorsBuilder;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;

std::map<std::string, int> DtypeCounts(const Catalog& c) {
  std::map<std::string, int> counts;
  for (const CatalogTensor& t : c.tensors) ++counts[std::string(DTypeName(t.dtype))];
  return counts;
}

std::string ReadBytes(const Catalog& c, const CatalogTensor& t, size_t n) {
  std::ifstream f(c.files[t.file].path, std::ios::binary);
  f.seekg(static_cast<std::streamoff>(t.offset));
  std::string out(n, '\0');
  f.read(out.data(), static_cast<std::streamsize>(n));
  return out;
}

// --- real checkpoints: counts and dtypes from real-checkpoints/SOURCES.md ---

struct RealCase {
  const char* path;
  size_t tensors;
  size_t files;
  std::map<std::string, int> dtypes;
};

class RealCheckpoint : public ::testing::TestWithParam<RealCase> {};

TEST_P(RealCheckpoint, CatalogsWithSourcesCounts) {
  WEIGHTD_REQUIRE_SHARED(shared);
  const RealCase& rc = GetParam();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog c, BuildCatalog(shared + "/real-checkpoints/" + rc.path));
  EXPECT_EQ(c.tensors.size(), rc.tensors);
  EXPECT_EQ(c.files.size(), rc.files);
  EXPECT_EQ(DtypeCounts(c), rc.dtypes);
  EXPECT_TRUE(c.warnings.empty()) << c.warnings.front();
}

const std::map<std::string, int> kFlux12 = {{"I64", 3}, {"F64", 3}, {"F32", 3}, {"I32", 3}, {"BF16", 3}, {"F16", 3},
                                            {"I16", 3}, {"F8_E4M3", 3}, {"F8_E5M2", 3}, {"I8", 3}, {"U8", 3}, {"BOOL", 3}};

INSTANTIATE_TEST_SUITE_P(
    SourcesMd, RealCheckpoint,
    ::testing::Values(
        RealCase{"fluxml-sharded", 36, 6, kFlux12},
        RealCase{"fluxml-nonsharded/model.safetensors", 36, 1, kFlux12},
        RealCase{"fluxml-nonsharded/model.with_metadata.safetensors", 36, 1, kFlux12},
        RealCase{"fluxml-nonsharded/model.numpy.safetensors", 27, 1,
                 {{"I64", 3}, {"F64", 3}, {"F32", 3}, {"I32", 3}, {"F16", 3}, {"I16", 3}, {"I8", 3}, {"U8", 3}, {"BOOL", 3}}},
        RealCase{"gpt2-tigrinya-lora", 72, 1, {{"F32", 72}}},
        RealCase{"candle-examples/jfk-codes.safetensors", 1, 1, {{"I64", 1}}},
        RealCase{"candle-examples/voices.safetensors", 2, 1, {{"I64", 1}, {"U8", 1}}},
        RealCase{"ndarray-safetensors/from_rust.safetensors", 4, 1, {{"F64", 1}, {"F32", 2}, {"I32", 1}}},
        RealCase{"ndarray-safetensors/rand.safetensors", 2, 1, {{"F32", 2}}},
        RealCase{"ndarray-safetensors/rand16.safetensors", 1, 1, {{"F16", 1}}},
        RealCase{"swift-safetensors/data.safetensors", 1, 1, {{"I32", 1}}},
        RealCase{"syoyo-safetensors-cpp/model.safetensors", 2, 1, {{"F64", 2}}},
        RealCase{"bogoai/model.safetensors", 1, 1, {{"F32", 1}}}),
    [](const ::testing::TestParamInfo<RealCase>& info) {
      std::string name = info.param.path;
      for (char& ch : name) {
        if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      }
      return name;
    });

TEST(RealCheckpoints, PinnedShapesOffsetsAndBytes) {
  WEIGHTD_REQUIRE_SHARED(shared);
  std::string real = shared + "/real-checkpoints/";
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog rust, BuildCatalog(real + "ndarray-safetensors/from_rust.safetensors"));
  const CatalogTensor* arr64 = rust.Find("arr64");
  ASSERT_NE(arr64, nullptr);
  EXPECT_EQ(arr64->shape, (std::vector<uint64_t>{2, 2}));
  double values[4];
  std::string bytes = ReadBytes(rust, *arr64, 32);
  std::memcpy(values, bytes.data(), 32);
  EXPECT_EQ(values[0], 1.0);
  EXPECT_EQ(values[3], 4.0);
  const CatalogTensor* arr_i32 = rust.Find("arr_i32");
  ASSERT_NE(arr_i32, nullptr);
  EXPECT_EQ(arr_i32->offset, 8u + 248u + 72u);
  EXPECT_EQ(arr_i32->nbytes, 28u);

  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog swift, BuildCatalog(real + "swift-safetensors/data.safetensors"));
  EXPECT_EQ(swift.files[0].data_start, 68u);  // unpadded header, data not 8-aligned
  EXPECT_EQ(swift.tensors[0].offset, 68u);

  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog lora, BuildCatalog(real + "gpt2-tigrinya-lora"));
  const CatalogTensor* a = lora.Find("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<uint64_t>{8, 768}));
  float first;
  std::string fb = ReadBytes(lora, *a, 4);
  std::memcpy(&first, fb.data(), 4);
  EXPECT_FLOAT_EQ(first, -0.03882298246026039f);
  EXPECT_EQ(lora.files[0].metadata.at("format"), "pt");

  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog voices, BuildCatalog(real + "candle-examples/voices.safetensors"));
  EXPECT_EQ(voices.total_bytes(), 291654u);
  EXPECT_EQ(voices.Find("mask")->shape, (std::vector<uint64_t>{1, 982, 33}));

  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog sharded, BuildCatalog(real + "fluxml-sharded"));
  EXPECT_EQ(sharded.total_bytes(), 4305u);  // == the index's metadata.total_size
  EXPECT_EQ(sharded.index_metadata.at("total_size"), "4305");
}

TEST(RealCheckpoints, RefusesAbuseAttempt) {
  WEIGHTD_REQUIRE_SHARED(shared);
  EXPECT_THAT(BuildCatalog(shared + "/real-checkpoints/syoyo-safetensors-cpp/safetensors_abuse_attempt_1.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "safetensors_abuse_attempt_1.safetensors: header length 1000 exceeds file size 88"));
}

// --- ../shared/cases/cases.json: every case gives its expected outcome ---

TEST(SharedCases, EveryCaseGivesItsExpectedOutcome) {
  WEIGHTD_REQUIRE_SHARED(shared);
  std::ifstream f(shared + "/cases/cases.json");
  nlohmann::json cases = nlohmann::json::parse(f);
  ASSERT_GE(cases.size(), 37u);
  for (const auto& c : cases) {
    std::string name = c["name"];
    std::string path = shared + "/cases/" + c["path"].get<std::string>();
    absl::StatusOr<Catalog> catalog = BuildCatalog(path);
    if (c["expect"] == "ok") {
      ASSERT_TRUE(catalog.ok()) << name << ": " << catalog.status();
      EXPECT_EQ(catalog->tensors.size(), c["tensors"].get<size_t>()) << name;
    } else {
      ASSERT_FALSE(catalog.ok()) << name << " was accepted";
      EXPECT_EQ(catalog.status().code(), absl::StatusCode::kInvalidArgument) << name << ": " << catalog.status();
      std::string message(catalog.status().message());
      EXPECT_EQ(message.find('\n'), std::string::npos) << name;
      // The line names the file (or the index) the rule was broken in.
      bool names_file = message.find(".safetensors") != std::string::npos || message.find(".json") != std::string::npos;
      EXPECT_TRUE(names_file) << name << ": " << message;
    }
  }
}

TEST(SharedCases, SpecificMessages) {
  WEIGHTD_REQUIRE_SHARED(shared);
  std::string cases = shared + "/cases/";
  EXPECT_THAT(BuildCatalog(cases + "git_lfs_pointer.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, "git_lfs_pointer.safetensors: git-LFS pointer, not a safetensors file"));
  EXPECT_THAT(BuildCatalog(cases + "header_len_past_eof.safetensors"),
              StatusIs(absl::StatusCode::kInvalidArgument, "header length 5000 exceeds file size 152"));
  EXPECT_THAT(BuildCatalog(cases + "sharded_missing_shard_file"),
              StatusIs(absl::StatusCode::kInvalidArgument, "names shard file 'model-00003-of-00003.safetensors', which does not exist"));
  EXPECT_THAT(BuildCatalog(cases + "sharded_tensor_absent_from_shard"),
              StatusIs(absl::StatusCode::kInvalidArgument, "places tensor 'layers.9.w' in model-00001-of-00002.safetensors, whose header does not hold it"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog wrong_total, BuildCatalog(cases + "sharded_total_size_wrong"));
  ASSERT_EQ(wrong_total.warnings.size(), 1u);
  EXPECT_NE(wrong_total.warnings[0].find("metadata.total_size is 1"), std::string::npos);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog stray, BuildCatalog(cases + "sharded_stray_weight_file"));
  EXPECT_EQ(stray.files.size(), 2u);  // consolidated.safetensors is not read
}

// --- generated folders: every index rule, without ../shared ---

class GeneratedFolder : public ::testing::Test {
 protected:
  void Shard(const std::string& name, const std::vector<std::string>& tensors) {
    SafetensorsBuilder b;
    for (const std::string& t : tensors) b.Add(t, "U8", {2}, "ab");
    WriteFile(dir_.Join(name), b.Build());
  }
  void Index(const std::string& text) { WriteFile(dir_.Join("model.safetensors.index.json"), text); }
  TempDir dir_;
};

TEST_F(GeneratedFolder, IndexedFolderReadsOnlyIndexedShards) {
  Shard("a.safetensors", {"x", "y"});
  Shard("b.safetensors", {"z"});
  Shard("stray.safetensors", {"x"});
  Index(R"({"metadata":{"total_size":6},"weight_map":{"x":"a.safetensors","y":"a.safetensors","z":"b.safetensors"}})");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog c, BuildCatalog(dir_.path()));
  EXPECT_EQ(c.tensors.size(), 3u);
  EXPECT_EQ(c.files.size(), 2u);
  EXPECT_EQ(c.files[c.Find("z")->file].name, "b.safetensors");
  EXPECT_TRUE(c.warnings.empty());
}

TEST_F(GeneratedFolder, MetadataBlockIsOptional) {
  Shard("a.safetensors", {"x"});
  Index(R"({"weight_map":{"x":"a.safetensors"}})");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog c, BuildCatalog(dir_.path()));
  EXPECT_EQ(c.tensors.size(), 1u);
}

TEST_F(GeneratedFolder, WrongTotalSizeIsAWarning) {
  Shard("a.safetensors", {"x"});
  Index(R"({"metadata":{"total_size":99},"weight_map":{"x":"a.safetensors"}})");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog c, BuildCatalog(dir_.path()));
  ASSERT_EQ(c.warnings.size(), 1u);
  EXPECT_EQ(c.warnings[0], "model.safetensors.index.json: metadata.total_size is 99 but the tensors hold 2 bytes");
}

TEST_F(GeneratedFolder, RefusesMissingShard) {
  Index(R"({"weight_map":{"x":"gone.safetensors"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, "names shard file 'gone.safetensors', which does not exist"));
}

TEST_F(GeneratedFolder, RefusesTensorAbsentFromItsShard) {
  Shard("a.safetensors", {"x"});
  Index(R"({"weight_map":{"x":"a.safetensors","q":"a.safetensors"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()), StatusIs(absl::StatusCode::kInvalidArgument, "places tensor 'q' in a.safetensors"));
}

TEST_F(GeneratedFolder, RefusesTensorStoredInTwoShards) {
  Shard("a.safetensors", {"x"});
  Shard("b.safetensors", {"x", "y"});
  Index(R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensor 'x' is stored in both a.safetensors and b.safetensors"));
}

TEST_F(GeneratedFolder, RefusesShardPathLeavingFolder) {
  Index(R"({"weight_map":{"x":"../a.safetensors"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()), StatusIs(absl::StatusCode::kInvalidArgument, "leaves the checkpoint folder"));
  Index(R"({"weight_map":{"x":"/etc/passwd"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()), StatusIs(absl::StatusCode::kInvalidArgument, "leaves the checkpoint folder"));
}

TEST_F(GeneratedFolder, RefusesShardSymlinkLeavingFolder) {
  TempDir outside;
  SafetensorsBuilder b;
  WriteFile(outside.Join("o.safetensors"), b.Add("x", "U8", {1}, "a").Build());
  ASSERT_EQ(symlink(outside.Join("o.safetensors").c_str(), dir_.Join("link.safetensors").c_str()), 0);
  Index(R"({"weight_map":{"x":"link.safetensors"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()), StatusIs(absl::StatusCode::kInvalidArgument, "outside the checkpoint folder"));
}

TEST_F(GeneratedFolder, RefusesMalformedIndex) {
  Index("{\"weight_map\": [}");
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, "model.safetensors.index.json: not valid JSON"));
  Index(R"({"metadata":{}})");
  EXPECT_THAT(BuildCatalog(dir_.path()), StatusIs(absl::StatusCode::kInvalidArgument, "missing the \"weight_map\" object"));
  Index(R"({"weight_map":{"x":3}})");
  EXPECT_THAT(BuildCatalog(dir_.path()), StatusIs(absl::StatusCode::kInvalidArgument, "weight_map entry 'x' must be a file name"));
}

// The reason (the metric's label) is attached where each catalog rule is
// checked, with the label it had when labels were found by phrase.
TEST_F(GeneratedFolder, EveryRefusalCarriesTheRuleItBroke) {
  auto rule = [&] { return CheckpointRuleOf(BuildCatalog(dir_.path()).status()); };
  Shard("a.safetensors", {"x"});
  Shard("b.safetensors", {"x", "y"});
  EXPECT_EQ(rule(), CheckpointRule::kDuplicateTensor);  // no index: every file
  Index(R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  EXPECT_EQ(rule(), CheckpointRule::kDuplicateTensor);
  Index(R"({"weight_map":{"x":"../a.safetensors"}})");
  EXPECT_EQ(rule(), CheckpointRule::kShardOutsideCheckpoint);
  Index(R"({"weight_map":{"x":"gone.safetensors"}})");
  EXPECT_EQ(rule(), CheckpointRule::kMissingShard);
  Index(R"({"weight_map":{"q":"a.safetensors"}})");
  EXPECT_EQ(rule(), CheckpointRule::kTensorAbsentFromShard);
  Index("{\"weight_map\": [}");
  EXPECT_EQ(rule(), CheckpointRule::kBadIndex);
  Index("{\"weight_map\": {\"\xff\": 1}}");  // not UTF-8: still the index's fault
  EXPECT_EQ(rule(), CheckpointRule::kBadIndex);
  Index(R"({"weight_map":{"x":3}})");
  EXPECT_EQ(rule(), CheckpointRule::kBadIndex);
  ASSERT_EQ(unlink(dir_.Join("model.safetensors.index.json").c_str()), 0);
  ASSERT_EQ(mkdir(dir_.Join("model.safetensors.index.json").c_str(), 0755), 0);
  EXPECT_EQ(rule(), CheckpointRule::kBadIndex);
  EXPECT_EQ(CheckpointRuleOf(BuildCatalog(dir_.Join("nothing-here")).status()), std::nullopt);  // NOT_FOUND by its code
}

// A shard name longer than 200 bytes is elided where it is quoted.
TEST_F(GeneratedFolder, QuotesALongShardNameElided) {
  std::string shard = std::string(100, 's') + "/" + std::string(100, 't') + "/" + std::string(50, 'u') + ".safetensors";
  Index(R"({"weight_map":{"x":")" + shard + R"("}})");
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "model.safetensors.index.json: names shard file '" + std::string(96, 's') + "…(264 bytes)…" +
                           std::string(33, 't') + "/" + std::string(50, 'u') + ".safetensors', which does not exist"));
}

// Regression: a FIFO named as a shard once hung the load (open blocked).
TEST_F(GeneratedFolder, RefusesFifoShardWithoutBlocking) {
  Shard("a.safetensors", {"x"});
  ASSERT_EQ(mkfifo(dir_.Join("b.safetensors").c_str(), 0644), 0);
  Index(R"({"weight_map":{"x":"a.safetensors","y":"b.safetensors"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, "names shard file 'b.safetensors', which is not a regular file"));
  EXPECT_THAT(BuildCatalog(dir_.Join("b.safetensors")), StatusIs(absl::StatusCode::kInvalidArgument, "not a file or folder"));
}

// Regression: deeply nested index metadata once overflowed the stack.
TEST_F(GeneratedFolder, RefusesDeeplyNestedIndex) {
  Shard("a.safetensors", {"x"});
  std::string deep = std::string(200000, '[') + std::string(200000, ']');
  Index(R"({"metadata":{"deep":)" + deep + R"(},"weight_map":{"x":"a.safetensors"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, "model.safetensors.index.json: not valid JSON: nests deeper than 64 levels"));
}

TEST_F(GeneratedFolder, FolderWithoutIndexRefusesDanglingLinksAndFifos) {
  Shard("a.safetensors", {"x"});
  ASSERT_EQ(symlink(dir_.Join("gone").c_str(), dir_.Join("b.safetensors").c_str()), 0);
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "b.safetensors: dangling symbolic link among the checkpoint's .safetensors files"));
  ASSERT_EQ(unlink(dir_.Join("b.safetensors").c_str()), 0);
  ASSERT_EQ(mkfifo(dir_.Join("c.safetensors").c_str(), 0644), 0);
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, "c.safetensors: not a regular file among"));
}

// Regression (issue 12): an index that exists but is not a regular file
// silently fell back to "every *.safetensors in the folder".
TEST_F(GeneratedFolder, IndexThatIsADanglingLinkIsAnErrorNotAFallBack) {
  Shard("a.safetensors", {"x"});
  ASSERT_EQ(symlink(dir_.Join("gone.json").c_str(), dir_.Join("model.safetensors.index.json").c_str()), 0);
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "model.safetensors.index.json: dangling symbolic link; an index that exists must be a "
                       "regular file (no fall-back to every .safetensors file)"));
}

TEST_F(GeneratedFolder, IndexThatIsADirectoryIsAnErrorNotAFallBack) {
  Shard("a.safetensors", {"x"});
  ASSERT_EQ(mkdir(dir_.Join("model.safetensors.index.json").c_str(), 0755), 0);
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "model.safetensors.index.json: not a regular file (directory); an index that exists must be a "
                       "regular file (no fall-back to every .safetensors file)"));
}

TEST_F(GeneratedFolder, IndexThatIsAFifoIsAnErrorWithoutBlocking) {
  Shard("a.safetensors", {"x"});
  ASSERT_EQ(mkfifo(dir_.Join("model.safetensors.index.json").c_str(), 0644), 0);
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, "model.safetensors.index.json: not a regular file (FIFO, socket or device); an index that exists"));
}

// Regression (issue 12): a shard name holding a NUL byte was opened as the name before the NUL.
TEST_F(GeneratedFolder, RefusesNulByteInShardName) {
  Shard("a.safetensors", {"x"});
  Index(R"({"weight_map":{"x":"a.safetensors\u0000.bin"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "model.safetensors.index.json: weight_map entry 'x' names a shard with a NUL byte: "
                       "\"a.safetensors\\u0000.bin\""));
}

// The Hugging Face cache: snapshots/<rev>/<file> -> ../../blobs/<sha>, the
// index included. Offline too, shards may lead into the repository's blobs.
TEST_F(GeneratedFolder, HuggingFaceCacheLayoutCatalogs) {
  const std::string repo = dir_.Join("models--org--tiny");
  for (const std::string& d : {repo, repo + "/blobs", repo + "/snapshots", repo + "/snapshots/abc"}) {
    ASSERT_EQ(mkdir(d.c_str(), 0755), 0) << d;
  }
  SafetensorsBuilder b;
  WriteFile(repo + "/blobs/1111", b.Add("x", "U8", {2}, "ab").Build());
  WriteFile(repo + "/blobs/2222", R"({"weight_map":{"x":"model-00001-of-00001.safetensors"}})");
  ASSERT_EQ(symlink("../../blobs/1111", (repo + "/snapshots/abc/model-00001-of-00001.safetensors").c_str()), 0);
  ASSERT_EQ(symlink("../../blobs/2222", (repo + "/snapshots/abc/model.safetensors.index.json").c_str()), 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog c, BuildCatalog(repo + "/snapshots/abc"));
  ASSERT_EQ(c.files.size(), 1u);
  EXPECT_EQ(c.files[0].name, "model-00001-of-00001.safetensors");
  EXPECT_EQ(c.Find("x")->nbytes, 2u);
}

TEST_F(GeneratedFolder, FolderWithoutIndexReadsEveryFileSorted) {
  Shard("b.safetensors", {"y"});
  Shard("a.safetensors", {"x"});
  WriteFile(dir_.Join("notes.txt"), "ignored");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog c, BuildCatalog(dir_.path()));
  ASSERT_EQ(c.files.size(), 2u);
  EXPECT_EQ(c.files[0].name, "a.safetensors");
  EXPECT_EQ(c.tensors[0].name, "x");
}

TEST_F(GeneratedFolder, FolderWithoutIndexRefusesNameInTwoFiles) {
  Shard("a.safetensors", {"x"});
  Shard("b.safetensors", {"x"});
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, "tensor 'x' is stored in both a.safetensors and b.safetensors"));
}

TEST_F(GeneratedFolder, EmptyFolderAndMissingPathAreNotFound) {
  EXPECT_THAT(BuildCatalog(dir_.path()), StatusIs(absl::StatusCode::kNotFound, "holds no .safetensors files"));
  EXPECT_THAT(BuildCatalog(dir_.Join("nope")), StatusIs(absl::StatusCode::kNotFound, "no such file or folder"));
}

TEST_F(GeneratedFolder, ErrorInShardNamesTheShard) {
  WriteFile(dir_.Join("a.safetensors"), "version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n");
  Index(R"({"weight_map":{"x":"a.safetensors"}})");
  EXPECT_THAT(BuildCatalog(dir_.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, "a.safetensors: git-LFS pointer, not a safetensors file"));
}

// Headers only: a 200,000-tensor header is cataloged without reading data.
// (Timing is measured by tests/bench, not asserted here.)
TEST_F(GeneratedFolder, CatalogsLargeHeader) {
  std::string header = "{";
  const int kTensors = 200000;
  for (int i = 0; i < kTensors; ++i) {
    if (i) header += ",";
    header += "\"t." + std::to_string(i) + "\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[" + std::to_string(i) +
              "," + std::to_string(i + 1) + "]}";
  }
  header += "}";
  WriteFile(dir_.Join("big.safetensors"), testing::FileImage(header, std::string(kTensors, 'z')));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog c, BuildCatalog(dir_.Join("big.safetensors")));
  EXPECT_EQ(c.tensors.size(), 200000u);
  EXPECT_EQ(c.Find("t.199999")->offset, 8 + header.size() + 199999);
}

}  // namespace
}  // namespace weightd
