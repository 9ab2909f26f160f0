// The packed tensor table: one rank's tensor manifest as one byte string
// (AttachResponse.packed_tensors), instead of one TensorEntry message per
// tensor. Built once per rank by the daemon, decoded by the C++ and Python
// clients without a per-tensor allocation of its own.
//
// Version 1, every integer little-endian (docs/api.md, "The packed tensor
// table", is the normative description):
//
//   header, 32 bytes:
//     0  u8[4] magic "WDPM"      4  u16 version (1)     6  u16 record_bytes (>= 64)
//     8  u32 tensor_count       12  u32 dtype_count    16  u32 dtype_bytes
//    20  u32 dim_count          24  u32 name_bytes     28  u32 reserved (0)
//   records: tensor_count x record_bytes (a reader of version 1 reads the
//            first 64 bytes of each and skips the rest):
//     0  u64 offset             8  u64 nbytes          16  u64 split_start
//    24  u64 content_hash (xxh3-64; clients print it as 16 lowercase hex digits)
//    32  u32 name_offset       36  u32 name_length     40  u32 segment
//    44  u32 dims_start        48  u32 ndim            52  u32 full_ndim
//    56  i32 split_dim (-1: not split)                 60  u16 dtype (index into the dtype table)
//    62  u8 placement (1 host, 2 device: the Placement enum)  63  u8 reserved (0)
//   dims: dim_count x u64; a tensor's shape is dims[dims_start, +ndim), its
//         full (checkpoint) shape the full_ndim that follow
//   dtype table, dtype_bytes: dtype_count x (u8 length >= 1, that many ASCII bytes)
//   names, name_bytes: UTF-8 tensor names, addressed by name_offset/name_length
//
// The buffer is exactly the sum of those sections; nothing is aligned (read
// with memcpy). Every offset, length and index is checked when parsing: a
// truncated or hostile buffer gives DATA_LOSS naming the field and the rule
// broken, never an out-of-bounds read.
#ifndef WEIGHTD_COMMON_FORMAT_PACKED_MANIFEST_H_
#define WEIGHTD_COMMON_FORMAT_PACKED_MANIFEST_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace weightd {

inline constexpr uint16_t kPackedManifestVersion = 1;
inline constexpr size_t kPackedManifestHeaderBytes = 32;
inline constexpr size_t kPackedManifestRecordBytes = 64;
inline constexpr uint8_t kPackedPlacementHost = 1;
inline constexpr uint8_t kPackedPlacementDevice = 2;

// One tensor to pack; Add() copies what the views point at.
struct PackedTensorInput {
  absl::string_view name;
  absl::string_view dtype;  // safetensors spelling: "BF16", ...
  absl::Span<const uint64_t> shape;
  absl::Span<const uint64_t> full_shape;
  uint8_t placement = kPackedPlacementHost;
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  int32_t split_dim = -1;
  uint64_t split_start = 0;
  uint64_t content_hash = 0;
};

// Builds a table. Not thread-safe; one use.
class PackedManifestWriter {
 public:
  void Add(const PackedTensorInput& t);
  // The encoded table. INVALID_ARGUMENT when a count or length does not fit
  // its 32-bit field (over 4 GiB of names, 2^32 dims, 65,536 dtypes).
  absl::StatusOr<std::string> Finish();

 private:
  std::string records_;
  std::string dims_;
  std::string dtypes_;
  std::string names_;
  uint64_t count_ = 0;
  uint64_t dim_count_ = 0;
  bool overflow_ = false;
  absl::flat_hash_map<std::string, uint32_t> dtype_index_;
};

// One decoded tensor; the string views point into the parsed buffer.
struct PackedTensor {
  absl::string_view name;
  absl::string_view dtype;
  uint32_t ndim = 0;
  uint32_t full_ndim = 0;
  uint8_t placement = kPackedPlacementHost;
  uint32_t segment = 0;
  uint64_t offset = 0;
  uint64_t nbytes = 0;
  int32_t split_dim = -1;
  uint64_t split_start = 0;
  uint64_t content_hash = 0;
  const char* dims = nullptr;  // ndim + full_ndim little-endian u64s, unaligned: read with Dim()

  uint64_t Dim(uint32_t k) const;      // shape[k], k < ndim
  uint64_t FullDim(uint32_t k) const;  // full_shape[k], k < full_ndim
};

// A validated view of a table. Does not own the bytes: they must outlive it
// and every PackedTensor it returns. Immutable; safe to read from many threads.
class PackedManifest {
 public:
  // Checks the header and every record (see the layout above). DATA_LOSS on
  // any violation: bad magic, a version other than 1, record_bytes < 64, a
  // buffer size other than the sections' sum, a name, dims or dtype index out
  // of its section, an empty or malformed dtype table entry, a placement
  // other than 1 or 2, a reserved field not 0. O(tensors).
  static absl::StatusOr<PackedManifest> Parse(absl::string_view bytes);

  uint32_t size() const { return count_; }
  // Tensor i < size(), in manifest order.
  PackedTensor Tensor(uint32_t i) const;

 private:
  PackedManifest() = default;
  const char* records_ = nullptr;
  uint32_t count_ = 0;
  uint32_t record_bytes_ = 0;
  const char* dims_ = nullptr;
  const char* names_ = nullptr;
  std::vector<absl::string_view> dtypes_;
};

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FORMAT_PACKED_MANIFEST_H_
