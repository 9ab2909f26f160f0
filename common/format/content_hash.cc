#include "common/format/content_hash.h"

#include <xxhash.h>

#include <algorithm>

namespace weightd {

uint64_t CombineBlockHashes(const std::vector<uint64_t>& blocks) {
  if (blocks.empty()) return XXH3_64bits(nullptr, 0);
  if (blocks.size() == 1) return blocks[0];
  std::vector<unsigned char> bytes(blocks.size() * 8);
  for (size_t i = 0; i < blocks.size(); ++i) {
    for (int b = 0; b < 8; ++b) bytes[i * 8 + b] = static_cast<unsigned char>(blocks[i] >> (8 * b));
  }
  return XXH3_64bits(bytes.data(), bytes.size());
}

uint64_t TensorContentHash(const char* data, uint64_t n) {
  std::vector<uint64_t> blocks;
  for (uint64_t start = 0; start < n; start += kHashBlockBytes) {
    blocks.push_back(XXH3_64bits(data + start, std::min(kHashBlockBytes, n - start)));
  }
  return CombineBlockHashes(blocks);
}

}  // namespace weightd
