// The safetensors dtypes and their sizes in bits.
//
// Source: the safetensors specification and the reference crate's `Dtype`
// enum (safetensors 0.6): 22 dtypes. Sub-byte types (F4 = 4 bits, F6_* = 6
// bits) are packed, so a tensor's byte length is elements * bits / 8 and an
// element count whose bits do not fill whole bytes is invalid.
#ifndef WEIGHTD_COMMON_FORMAT_DTYPE_H_
#define WEIGHTD_COMMON_FORMAT_DTYPE_H_

#include <cstdint>
#include <optional>
#include "absl/strings/string_view.h"

namespace weightd {

enum class DType : uint8_t {
  kBool, kU8, kI8, kF8_E5M2, kF8_E4M3, kF8_E8M0, kF8_E4M3FNUZ, kF8_E5M2FNUZ,
  kF4, kF6_E2M3, kF6_E3M2, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kC64,
  kF64, kI64, kU64,
};
inline constexpr int kDTypeCount = 22;

// The spelling used in safetensors headers, e.g. "BF16", "F8_E4M3".
absl::string_view DTypeName(DType dtype);
// Parses a header spelling; nullopt for anything not in the list above.
std::optional<DType> ParseDType(absl::string_view name);
// Size of one element in bits (4 for F4, 6 for F6_*, 8 for BOOL/U8/F8_*, ...).
int DTypeBits(DType dtype);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FORMAT_DTYPE_H_
