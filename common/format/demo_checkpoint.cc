#include "common/format/demo_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/scoped_fd.h"
#include "common/base/status.h"
#include "nlohmann/json.hpp"

namespace weightd {
namespace {

using json = nlohmann::json;

constexpr uint64_t kMiB = 1ull << 20;

const std::vector<DemoPreset>& Presets() {
  static const auto* presets = new std::vector<DemoPreset>{
      {"tiny", 4096, 256, 768, 2, 4, 4, 4 * kMiB},
      {"small", 32000, 1024, 2816, 6, 16, 8, 64 * kMiB},
      {"llama-1b", 80000, 2048, 8192, 16, 32, 8, 1024 * kMiB},
      {"engram", 2048, 256, 512, 2, 4, 2, 2 * kMiB, 4096, 256},
  };
  return *presets;
}

absl::Status WriteAll(int fd, const char* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(absl::StrCat(path, ": write"), errno);
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status WriteFileText(const std::string& path, const std::string& text) {
  ScopedFd fd(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoToStatus(absl::StrCat(path, ": create"), errno);
  return WriteAll(fd.get(), text.data(), text.size(), path);
}

std::string ShardHeader(const std::vector<const DemoTensor*>& tensors) {
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}, {"generator", "weightctl make-demo"}};
  uint64_t offset = 0;
  for (const DemoTensor* t : tensors) {
    header[t->name] = {{"dtype", t->dtype}, {"shape", t->shape}, {"data_offsets", {offset, offset + t->nbytes()}}};
    offset += t->nbytes();
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');  // data starts 8-aligned, as the reference writer does
  return text;
}

absl::Status WriteShard(const std::string& path, const std::vector<const DemoTensor*>& tensors, uint64_t& done,
                        uint64_t total, const std::function<void(uint64_t, uint64_t)>& progress) {
  ScopedFd fd(open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoToStatus(absl::StrCat(path, ": create"), errno);
  std::string header = ShardHeader(tensors);
  char prefix[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  WEIGHTD_RETURN_IF_ERROR(WriteAll(fd.get(), prefix, 8, path));
  WEIGHTD_RETURN_IF_ERROR(WriteAll(fd.get(), header.data(), header.size(), path));
  constexpr uint64_t kChunkElements = 2 * kMiB;
  std::vector<char> buffer(kChunkElements * 2);
  for (const DemoTensor* t : tensors) {
    uint32_t hash = DemoNameHash(t->name);
    const uint64_t width = t->element_bytes();
    uint64_t elements = t->nbytes() / width;
    for (uint64_t first = 0; first < elements; first += kChunkElements) {
      uint64_t count = std::min(kChunkElements, elements - first);
      if (width == 2) {
        FillDemoValues(hash, first, count, buffer.data());
      } else {
        for (uint64_t i = 0; i < count; ++i) buffer[i] = static_cast<char>(DemoByte(t->dtype, hash, first + i));
      }
      WEIGHTD_RETURN_IF_ERROR(WriteAll(fd.get(), buffer.data(), count * width, path));
      done += count * width;
      if (progress) progress(done, total);
    }
  }
  return absl::OkStatus();
}

}  // namespace

uint64_t DemoTensor::nbytes() const {
  uint64_t n = element_bytes();
  for (uint64_t d : shape) n *= d;
  return n;
}

absl::StatusOr<DemoPreset> FindDemoPreset(absl::string_view name) {
  for (const DemoPreset& p : Presets()) {
    if (p.name == name) return p;
  }
  return absl::NotFoundError(absl::StrCat("unknown demo preset '", name, "' (use tiny, small, llama-1b or engram)"));
}

std::vector<std::string> DemoPresetNames() {
  std::vector<std::string> names;
  for (const DemoPreset& p : Presets()) names.push_back(p.name);
  return names;
}

std::vector<DemoTensor> DemoTensors(const DemoPreset& p) {
  const uint64_t kv = p.hidden / p.heads * p.kv_heads;
  std::vector<DemoTensor> out;
  out.push_back({"model.embed_tokens.weight", {p.vocab, p.hidden}});
  for (uint64_t l = 0; l < p.layers; ++l) {
    std::string prefix = absl::StrCat("model.layers.", l, ".");
    out.push_back({prefix + "input_layernorm.weight", {p.hidden}});
    out.push_back({prefix + "self_attn.q_proj.weight", {p.hidden, p.hidden}});
    out.push_back({prefix + "self_attn.k_proj.weight", {kv, p.hidden}});
    out.push_back({prefix + "self_attn.v_proj.weight", {kv, p.hidden}});
    out.push_back({prefix + "self_attn.o_proj.weight", {p.hidden, p.hidden}});
    out.push_back({prefix + "post_attention_layernorm.weight", {p.hidden}});
    out.push_back({prefix + "mlp.gate_proj.weight", {p.intermediate, p.hidden}});
    out.push_back({prefix + "mlp.up_proj.weight", {p.intermediate, p.hidden}});
    out.push_back({prefix + "mlp.down_proj.weight", {p.hidden, p.intermediate}});
  }
  out.push_back({"model.norm.weight", {p.hidden}});
  out.push_back({"lm_head.weight", {p.vocab, p.hidden}});
  if (p.engram_rows > 0) {  // one Engram file per layer (the first two layers)
    for (uint64_t l = 0; l < std::min<uint64_t>(p.layers, 2); ++l) {
      std::string prefix = absl::StrCat("model.layers.", l, ".engram.");
      int file = static_cast<int>(l) + 1;
      out.push_back({prefix + "embed.weight", {p.engram_rows, p.engram_dim}, "F8_E4M3", file});
      out.push_back({prefix + "embed.scale", {p.engram_rows, p.engram_dim / 32}, "F8_E8M0", file});
      if (file == 2) out.push_back({prefix + "gate_proj.weight", {p.hidden, p.engram_dim}, "BF16", file});
    }
  }
  return out;
}

uint32_t DemoNameHash(absl::string_view name) {
  uint32_t h = 2166136261u;
  for (unsigned char c : name) {
    h ^= c;
    h *= 16777619u;
  }
  return h;
}

uint8_t DemoByte(absl::string_view dtype, uint32_t name_hash, uint64_t index) {
  uint32_t u = DemoRuleWord(name_hash, index);
  if (dtype == "F8_E8M0") return static_cast<uint8_t>(0x78u | ((u >> 16) & 0x07u));
  return static_cast<uint8_t>(0x30u | ((u >> 16) & 0x87u));  // F8_E4M3
}

void FillDemoValues(uint32_t name_hash, uint64_t first, uint64_t count, char* out) {
  for (uint64_t i = 0; i < count; ++i) {
    uint16_t bits = DemoValueBits(name_hash, first + i);
    out[2 * i] = static_cast<char>(bits & 0xFF);
    out[2 * i + 1] = static_cast<char>(bits >> 8);
  }
}

absl::Status WriteDemoCheckpoint(const std::string& dir, const DemoPreset& preset,
                                 const std::function<void(uint64_t, uint64_t)>& progress) {
  if (mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) return ErrnoToStatus(absl::StrCat(dir, ": mkdir"), errno);
  std::vector<DemoTensor> tensors = DemoTensors(preset);
  std::vector<std::vector<const DemoTensor*>> shards(1);
  std::vector<std::vector<const DemoTensor*>> engram_files;
  uint64_t shard_bytes = 0, total = 0;
  for (const DemoTensor& t : tensors) {
    if (t.engram_file > 0) {  // after the ordinary shards, in files of their own
      engram_files.resize(std::max<size_t>(engram_files.size(), t.engram_file));
      engram_files[t.engram_file - 1].push_back(&t);
      total += t.nbytes();
      continue;
    }
    if (shard_bytes > 0 && shard_bytes + t.nbytes() > preset.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(&t);
    shard_bytes += t.nbytes();
    total += t.nbytes();
  }
  shards.insert(shards.end(), engram_files.begin(), engram_files.end());
  json index = {{"metadata", {{"total_size", total}}}, {"weight_map", json::object()}};
  uint64_t done = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    std::string name = absl::StrFormat("model-%05d-of-%05d.safetensors", s + 1, shards.size());
    for (const DemoTensor* t : shards[s]) index["weight_map"][t->name] = name;
    WEIGHTD_RETURN_IF_ERROR(WriteShard(dir + "/" + name, shards[s], done, total, progress));
  }
  WEIGHTD_RETURN_IF_ERROR(WriteFileText(dir + "/model.safetensors.index.json", index.dump(2) + "\n"));
  json config = {{"architectures", {"LlamaForCausalLM"}},  {"model_type", "llama"},
                 {"hidden_size", preset.hidden},            {"intermediate_size", preset.intermediate},
                 {"num_hidden_layers", preset.layers},      {"num_attention_heads", preset.heads},
                 {"num_key_value_heads", preset.kv_heads},  {"vocab_size", preset.vocab},
                 {"torch_dtype", "bfloat16"},              {"weightd_demo_preset", preset.name}};
  return WriteFileText(dir + "/config.json", config.dump(2) + "\n");
}

}  // namespace weightd
