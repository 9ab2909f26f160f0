#include "common/format/demo_checkpoint.h"

#include <fstream>

#include "common/format/catalog.h"
#include "gtest/gtest.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

TEST(DemoCheckpoint, ValueRuleMatchesDocumentedFormula) {
  // FNV-1a 32 of "a" is 0xe40c292c (the published FNV test vector).
  EXPECT_EQ(DemoNameHash("a"), 0xe40c292cu);
  EXPECT_EQ(DemoNameHash(""), 2166136261u);
  // u = 0xe40c292c + 1 * 2654435761 = 0x8243a2dd (mod 2^32); bits = 0x3C00 | (0x8243 & 0x807F) = 0xBC43.
  EXPECT_EQ(DemoValueBits(0xe40c292cu, 1), 0xBC43);
  char out[4];
  FillDemoValues(0xe40c292cu, 1, 1, out);
  EXPECT_EQ(static_cast<unsigned char>(out[0]), 0x43);
  EXPECT_EQ(static_cast<unsigned char>(out[1]), 0xBC);
}

TEST(DemoCheckpoint, PresetsHaveLlamaShapesAndSizes) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(DemoPreset tiny, FindDemoPreset("tiny"));
  std::vector<DemoTensor> tensors = DemoTensors(tiny);
  EXPECT_EQ(tensors.size(), 2u + 9u * 2u + 1u);
  EXPECT_EQ(tensors.front().name, "model.embed_tokens.weight");
  EXPECT_EQ(tensors.front().shape, (std::vector<uint64_t>{4096, 256}));
  EXPECT_EQ(tensors.back().name, "lm_head.weight");
  uint64_t total = 0;
  for (const DemoTensor& t : tensors) total += t.nbytes();
  EXPECT_EQ(total, 7604736u);  // about 7 MiB
  WEIGHTD_ASSERT_OK_AND_ASSIGN(DemoPreset small, FindDemoPreset("small"));
  total = 0;
  for (const DemoTensor& t : DemoTensors(small)) total += t.nbytes();
  EXPECT_EQ(total, 272656384u);  // about 260 MiB
  WEIGHTD_ASSERT_OK_AND_ASSIGN(DemoPreset big, FindDemoPreset("llama-1b"));
  total = 0;
  for (const DemoTensor& t : DemoTensors(big)) total += t.nbytes();
  EXPECT_EQ(total, 2601652224u);  // about 2.4 GiB
  EXPECT_THAT(FindDemoPreset("huge"), StatusIs(absl::StatusCode::kNotFound, "unknown demo preset 'huge'"));
}

TEST(DemoCheckpoint, TheEngramPresetKeepsItsTablesInTwoEngramFiles) {
  // The one-byte value rules at the element the BF16 rule test uses.
  EXPECT_EQ(DemoByte("F8_E4M3", 0xe40c292cu, 1), 0x33);  // u >> 16 = 0x8243: 0x30 | (0x43 & 0x87)
  EXPECT_EQ(DemoByte("F8_E8M0", 0xe40c292cu, 1), 0x7B);  // 0x78 | (0x43 & 0x07)
  WEIGHTD_ASSERT_OK_AND_ASSIGN(DemoPreset engram, FindDemoPreset("engram"));
  std::vector<DemoTensor> tensors = DemoTensors(engram);
  ASSERT_EQ(tensors.size(), 2u + 9u * 2u + 1u + 5u);
  std::vector<std::string> in_engram_files;
  for (const DemoTensor& t : tensors) {
    EXPECT_EQ(t.engram_file > 0, t.name.find(".engram.") != std::string::npos) << t.name;
    if (t.engram_file > 0) in_engram_files.push_back(t.name + " " + t.dtype + " " + std::to_string(t.engram_file));
  }
  EXPECT_EQ(in_engram_files, (std::vector<std::string>{
                                 "model.layers.0.engram.embed.weight F8_E4M3 1",
                                 "model.layers.0.engram.embed.scale F8_E8M0 1",
                                 "model.layers.1.engram.embed.weight F8_E4M3 2",
                                 "model.layers.1.engram.embed.scale F8_E8M0 2",
                                 "model.layers.1.engram.gate_proj.weight BF16 2",
                             }));
  EXPECT_EQ(tensors[tensors.size() - 2].shape, (std::vector<uint64_t>{4096, 8}));  // a scale per 32 FP8 values
  uint64_t total = 0;
  for (const DemoTensor& t : tensors) total += t.nbytes();
  EXPECT_EQ(total, 6752768u);
}

TEST(DemoCheckpoint, WrittenCheckpointCatalogsAndHoldsTheRuleBytes) {
  testing::TempDir dir;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(DemoPreset tiny, FindDemoPreset("tiny"));
  WEIGHTD_ASSERT_OK(WriteDemoCheckpoint(dir.path(), tiny));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog c, BuildCatalog(dir.path()));
  EXPECT_EQ(c.tensors.size(), 21u);
  EXPECT_EQ(c.files.size(), 2u);  // 4 MiB shards
  EXPECT_TRUE(c.warnings.empty());
  EXPECT_EQ(c.total_bytes(), 7604736u);
  const CatalogTensor* q = c.Find("model.layers.1.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(DTypeName(q->dtype), "BF16");
  std::ifstream f(c.files[q->file].path, std::ios::binary);
  f.seekg(static_cast<std::streamoff>(q->offset + 2 * 1000));
  unsigned char b[2];
  f.read(reinterpret_cast<char*>(b), 2);
  uint16_t expected = DemoValueBits(DemoNameHash(q->name), 1000);
  EXPECT_EQ(b[0] | (b[1] << 8), expected);
}

}  // namespace
}  // namespace weightd
