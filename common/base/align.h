// Rounding byte counts and offsets to a multiple of an alignment (a page,
// an O_DIRECT block, a device allocation granularity).
#ifndef WEIGHTD_COMMON_BASE_ALIGN_H_
#define WEIGHTD_COMMON_BASE_ALIGN_H_

#include <cstdint>
#include <optional>

namespace weightd {

// `x` rounded down / up to a multiple of `a` (a > 0). AlignUp wraps past
// 2^64 - a: use CheckedAlignUp for sizes a client or a file supplies.
constexpr uint64_t AlignDown(uint64_t x, uint64_t a) { return x / a * a; }
constexpr uint64_t AlignUp(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }
// AlignUp, or nullopt when the result does not fit in 64 bits.
constexpr std::optional<uint64_t> CheckedAlignUp(uint64_t x, uint64_t a) {
  if (x > UINT64_MAX - (a - 1)) return std::nullopt;
  return AlignUp(x, a);
}

}  // namespace weightd

#endif  // WEIGHTD_COMMON_BASE_ALIGN_H_
