// The safetensors file format: header parsing and strict validation.
//
// Layout (safetensors spec, https://github.com/huggingface/safetensors):
//   bytes [0, 8)        N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8+N)      UTF-8 JSON object: {"name": {"dtype", "shape",
//                       "data_offsets": [begin, end]}, ..., "__metadata__": {str: str}}
//   bytes [8+N, EOF)    the data section; offsets are relative to its start
//
// Rules enforced (those of the reference crate's `SafeTensors::deserialize`
// and `validate`, plus duplicate-name rejection):
//   - the file holds at least the 8-byte prefix; N <= 100,000,000 (the
//     reference's MAX_HEADER_SIZE) and 8 + N <= file size;
//   - the header is valid UTF-8 JSON; JSON whitespace may surround the object,
//     anything else (NUL padding, a byte-order mark) is refused;
//   - `__metadata__`, when present, maps strings to strings;
//   - each tensor has a known dtype (see dtype.h), a shape of non-negative
//     integers whose element count fits in 64 bits, and two integer offsets
//     with begin <= end;
//   - elements * dtype bits is a whole number of bytes equal to end - begin;
//   - sorted by offset (not JSON order) the tensors start at 0 and are
//     contiguous: no hole, no overlap;
//   - the data section ends exactly at the last tensor's end: a truncated file
//     and trailing bytes are both errors;
//   - a tensor name appears once, and holds no control character (< 0x20,
//     0x7F; stricter than the reference, which accepts them).
// Zero-sized and rank-0 tensors are valid; the data need not be aligned.
#ifndef WEIGHTD_COMMON_FORMAT_SAFETENSORS_H_
#define WEIGHTD_COMMON_FORMAT_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "common/format/dtype.h"
#include "common/io/env.h"

namespace weightd {

inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorHeader {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // byte offset within the data section
  uint64_t end = 0;    // one past the last byte
  uint64_t nbytes() const { return end - begin; }
};

struct SafetensorsHeader {
  uint64_t header_length = 0;  // N
  uint64_t data_start = 0;     // 8 + N: file offset of the data section
  uint64_t data_length = 0;    // bytes of the data section
  std::vector<TensorHeader> tensors;  // sorted by begin offset
  std::map<std::string, std::string> metadata;
  // XXH3-64 of the header's JSON bytes as read (set by ReadHeader; 0 from
  // ParseHeaderJson alone): with the file's identity it tells an unchanged
  // file from a rewritten one (server/registry/registry.h, partial reload).
  uint64_t header_hash = 0;
};

// Validates a header given its JSON text and the file's total size.
// `file_label` prefixes every error ("x.safetensors: ..."). Errors are
// INVALID_ARGUMENT and name the tensor and the rule broken. Pure function.
absl::StatusOr<SafetensorsHeader> ParseHeaderJson(absl::string_view json, uint64_t header_length,
                                                  uint64_t file_size, absl::string_view file_label);

// Parses a complete in-memory file image (used by the fuzzer and tests).
absl::StatusOr<SafetensorsHeader> ParseFileImage(absl::string_view image, absl::string_view file_label);

// Reads and validates the header of an open file: reads the 8-byte prefix,
// recognises git-LFS pointers and zip archives, checks N against the limit
// and the file size before allocating N bytes, then parses. Never reads the
// data section.
absl::StatusOr<SafetensorsHeader> ReadHeader(const RandomAccessFile& file, absl::string_view file_label);

// Element count of `shape` (1 for rank 0), or nullopt on 64-bit overflow.
std::optional<uint64_t> ElementCount(const std::vector<uint64_t>& shape);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FORMAT_SAFETENSORS_H_
