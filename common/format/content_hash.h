// The content hash of a tensor, the one every manifest carries
// (TensorEntry.content_hash) and a writer's commit checks: xxHash's XXH3-64
// (seed 0) over the tensor's bytes cut into kHashBlockBytes blocks. A
// tensor of one block (or empty) hashes to XXH3-64 of its bytes; a larger
// one to XXH3-64 of the little-endian array of its block hashes, so blocks
// can be hashed in parallel as they are read (server/load/loader.h).
//
// Thread-safety: pure functions.
#ifndef WEIGHTD_COMMON_FORMAT_CONTENT_HASH_H_
#define WEIGHTD_COMMON_FORMAT_CONTENT_HASH_H_

#include <cstdint>
#include <string>
#include <vector>

namespace weightd {

inline constexpr uint64_t kHashBlockBytes = 16ull << 20;

// The hash of `n` bytes at `data`.
uint64_t TensorContentHash(const char* data, uint64_t n);
// The hash of a tensor from its blocks' XXH3-64 hashes, in order.
uint64_t CombineBlockHashes(const std::vector<uint64_t>& blocks);
// 16 lowercase hex digits, as manifests spell it. Inline, by hand rather
// than StrFormat: clients spell 100,000 of these per attach, and the Python
// client's native module uses it without linking xxHash.
inline std::string ContentHashHex(uint64_t hash) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(16, '0');
  for (int i = 15; i >= 0; --i, hash >>= 4) out[i] = kDigits[hash & 0xf];
  return out;
}

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FORMAT_CONTENT_HASH_H_
