// Builds safetensors files in tests, so a bare clone tests every format rule
// without ../shared.
#ifndef WEIGHTD_TESTS_TESTING_CHECKPOINT_BUILDER_H_
#define WEIGHTD_TESTS_TESTING_CHECKPOINT_BUILDER_H_

#include <cstdint>
#include <string>
#include <vector>

namespace weightd::testing {

// The raw file image: 8-byte little-endian length of `header`, the header,
// then `data`. No validation: used to build malformed files.
std::string FileImage(const std::string& header, const std::string& data);

// Writes `contents` to `path` (aborts the test binary on I/O failure).
void WriteFile(const std::string& path, const std::string& contents);

// Builds a valid file: tensors laid out contiguously in call order.
class SafetensorsBuilder {
 public:
  // `data` must hold the tensor's exact bytes.
  SafetensorsBuilder& Add(const std::string& name, const std::string& dtype, const std::vector<uint64_t>& shape,
                          const std::string& data);
  SafetensorsBuilder& Metadata(const std::string& key, const std::string& value);
  std::string Build() const;  // header padded with spaces to an 8-aligned data start

 private:
  struct Entry {
    std::string name, dtype;
    std::vector<uint64_t> shape;
    std::string data;
  };
  std::vector<Entry> entries_;
  std::vector<std::pair<std::string, std::string>> metadata_;
};

// `n` deterministic pseudo-random bytes (an LCG seeded with `seed`).
std::string Bytes(uint64_t n, uint32_t seed);

// xxh3-64 of `data` as 16 hex digits (to pin tensor bytes in tests).
std::string Xxh3Hex(const void* data, size_t n);

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_CHECKPOINT_BUILDER_H_
