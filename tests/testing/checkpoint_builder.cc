#include "tests/testing/checkpoint_builder.h"

#include <xxhash.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "nlohmann/json.hpp"

namespace weightd::testing {

std::string FileImage(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
  return out + header + data;
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(contents.data(), static_cast<std::streamsize>(contents.size()));
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::abort();
  }
}

SafetensorsBuilder& SafetensorsBuilder::Add(const std::string& name, const std::string& dtype,
                                            const std::vector<uint64_t>& shape, const std::string& data) {
  entries_.push_back({name, dtype, shape, data});
  return *this;
}

SafetensorsBuilder& SafetensorsBuilder::Metadata(const std::string& key, const std::string& value) {
  metadata_.emplace_back(key, value);
  return *this;
}

std::string SafetensorsBuilder::Build() const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) {
    header["__metadata__"] = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata_) header["__metadata__"][k] = v;
  }
  std::string data;
  for (const Entry& e : entries_) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {data.size(), data.size() + e.data.size()}}};
    data += e.data;
  }
  std::string text = header.dump();
  text.append((8 - (8 + text.size()) % 8) % 8, ' ');
  return FileImage(text, data);
}

std::string Bytes(uint64_t n, uint32_t seed) {
  std::string s(n, '\0');
  uint32_t x = seed * 2654435761u + 1;
  for (uint64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

std::string Xxh3Hex(const void* data, size_t n) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(XXH3_64bits(data, n)));
  return buf;
}

}  // namespace weightd::testing
