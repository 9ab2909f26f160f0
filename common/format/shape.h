// How messages and tables print a tensor's shape: "[4096, 11008]", "[]" for
// rank 0. One spelling for the checkpoint errors, the TP plan's errors and
// weightctl's tables.
#ifndef WEIGHTD_COMMON_FORMAT_SHAPE_H_
#define WEIGHTD_COMMON_FORMAT_SHAPE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace weightd {

inline std::string ShapeString(const std::vector<uint64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

}  // namespace weightd

#endif  // WEIGHTD_COMMON_FORMAT_SHAPE_H_
