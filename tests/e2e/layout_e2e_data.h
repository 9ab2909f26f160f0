// The runtime layout the layout e2e tests publish (tests/e2e/layouts_e2e_test.cc
// in-process, tests/e2e/layout_writer_helper.cc from another process): what
// an engine's post-processing makes of a checkpoint (a fused, int8 qkv
// projection with fp32 per-row scales, and a transposed matrix kept as a
// strided view), and the deterministic bytes each tensor holds per rank.
#ifndef WEIGHTD_TESTS_E2E_LAYOUT_E2E_DATA_H_
#define WEIGHTD_TESTS_E2E_LAYOUT_E2E_DATA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "weightd/client.h"

namespace weightd::testing {

// qkv_proj.weight I8 [12, 8] (96 bytes) on `qkv`; qkv_proj.scale F32 [12]
// (48 bytes) on the host; o_proj.weight.t BF16 [8, 6] with strides (1, 8):
// a transposed [6, 8] matrix, 48 elements (96 bytes), on the host.
inline std::vector<LayoutTensorRequest> LayoutE2ETensors(Location qkv) {
  return {{"qkv_proj.weight", "I8", {12, 8}, {}, qkv},
          {"qkv_proj.scale", "F32", {12}, {}, Location::kHost},
          {"o_proj.weight.t", "BF16", {8, 6}, {1, 8}, Location::kHost}};
}

// The bytes tensor `name` of `rank` holds: byte i is
// (seed(name) + 31 * rank + 7 * i) mod 256, seed the sum of the name's chars.
inline std::string LayoutE2EBytes(const std::string& name, uint32_t rank, uint64_t nbytes) {
  uint32_t seed = 0;
  for (char c : name) seed += static_cast<unsigned char>(c);
  std::string out(nbytes, '\0');
  for (uint64_t i = 0; i < nbytes; ++i) out[i] = static_cast<char>((seed + 31 * rank + 7 * i) & 0xff);
  return out;
}

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_E2E_LAYOUT_E2E_DATA_H_
