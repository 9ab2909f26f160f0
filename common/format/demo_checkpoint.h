// The built-in demo checkpoint: synthetic, deterministic, Llama-shaped BF16
// weights, sharded with a `model.safetensors.index.json` like real
// checkpoints, so every part of weightd can be exercised without downloads.
//
// Value rule (documented so any reader can check bytes without the file):
//   h    = FNV-1a 32-bit hash of the tensor name's UTF-8 bytes
//   u    = (h + i * 2654435761) mod 2^32        for element index i (row-major)
//   bits = 0x3C00 | ((u >> 16) & 0x807F)        the BF16 bit pattern, stored little-endian
// i.e. a sign bit, a fixed exponent (2^-7) and 7 varying mantissa bits:
// values in +-[0.0078125, 0.015564]. The one-byte dtypes of the engram preset:
//   F8_E4M3 byte = 0x30 | ((u >> 16) & 0x87)   sign, exponent 2^-1, 3 mantissa bits: +-[0.5, 0.9375]
//   F8_E8M0 byte = 0x78 | ((u >> 16) & 0x07)   a power of two in 2^-7 .. 2^0
//
// The "engram" preset is laid out like DeepSeek-V4.1's checkpoint, small: the
// ordinary BF16 shards, then two Engram files holding only tensors of the
// layers' `.engram.` modules: per layer an FP8 row table
// `model.layers.L.engram.embed.weight` [rows, dim] and its F8_E8M0 scale table
// `model.layers.L.engram.embed.scale` [rows, dim / 32], and in the last file
// one Engram tensor that is not a table, `model.layers.1.engram.gate_proj.weight`
// (BF16). Loading it with --host-resident .engram.embed. keeps exactly the
// tables on the host.
#ifndef WEIGHTD_COMMON_FORMAT_DEMO_CHECKPOINT_H_
#define WEIGHTD_COMMON_FORMAT_DEMO_CHECKPOINT_H_

#include <cstdint>
#include <functional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace weightd {

struct DemoPreset {
  std::string name;
  uint64_t vocab = 0;
  uint64_t hidden = 0;
  uint64_t intermediate = 0;
  uint64_t layers = 0;
  uint64_t heads = 0;
  uint64_t kv_heads = 0;
  uint64_t max_shard_bytes = 0;
  // Engram tables (the "engram" preset): rows and dim of each FP8 table; 0: none.
  uint64_t engram_rows = 0;
  uint64_t engram_dim = 0;
};

struct DemoTensor {
  std::string name;
  std::vector<uint64_t> shape;
  std::string dtype = "BF16";  // BF16, F8_E4M3 or F8_E8M0
  // The file it is written to: empty for the ordinary shards (cut at
  // max_shard_bytes), else an Engram file's number (1 or 2).
  int engram_file = 0;
  uint64_t element_bytes() const { return dtype == "BF16" ? 2 : 1; }
  uint64_t nbytes() const;
};

// "tiny" (~7 MiB), "small" (~260 MiB), "llama-1b" (~2.4 GiB) or "engram"
// (~10 MiB, the DeepSeek-V4.1 layout above); NOT_FOUND otherwise.
absl::StatusOr<DemoPreset> FindDemoPreset(absl::string_view name);
std::vector<std::string> DemoPresetNames();
// The tensors of a preset, in file order.
std::vector<DemoTensor> DemoTensors(const DemoPreset& preset);

uint32_t DemoNameHash(absl::string_view name);
// u of the rule above.
inline uint32_t DemoRuleWord(uint32_t name_hash, uint64_t index) {
  return name_hash + static_cast<uint32_t>(index) * 2654435761u;
}
inline uint16_t DemoValueBits(uint32_t name_hash, uint64_t index) {
  return static_cast<uint16_t>(0x3C00u | ((DemoRuleWord(name_hash, index) >> 16) & 0x807Fu));
}
// Writes `count` elements starting at element `first` as little-endian BF16 bytes.
void FillDemoValues(uint32_t name_hash, uint64_t first, uint64_t count, char* out);
// The byte of element `index` of a one-byte `dtype` (F8_E4M3, F8_E8M0) tensor.
uint8_t DemoByte(absl::string_view dtype, uint32_t name_hash, uint64_t index);

// Writes the preset into `dir` (created if missing): shards, index and
// config.json. `progress(bytes_done, bytes_total)` is called after each chunk.
// Errors keep errno's text and name the file.
absl::Status WriteDemoCheckpoint(const std::string& dir, const DemoPreset& preset,
                                 const std::function<void(uint64_t, uint64_t)>& progress = nullptr);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FORMAT_DEMO_CHECKPOINT_H_
