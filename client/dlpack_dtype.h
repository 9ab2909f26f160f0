// The one table from safetensors dtypes to DLPack 0.6 type codes, used by
// the C++ client (MappedModel::ToDLPack) and the Python extension.
//
// Policy: every 8-bit float (F8_E4M3, F8_E5M2, F8_E8M0, F8_E4M3FNUZ,
// F8_E5M2FNUZ) travels as an 8-bit unsigned carrier of the same shape, since
// DLPack 0.6 has no float8 code; the consumer reinterprets the bytes (torch:
// Tensor.view(torch.float8_e4m3fn, float8_e8m0fnu, ...), which the Python
// package does). The sub-byte dtypes (F4, F6_E2M3, F6_E3M2) have no entry:
// no DLPack 0.6 type holds an element smaller than a byte; read their raw
// bytes (the Python package pairs F4 into torch.float4_e2m1fn_x2). BOOL uses
// code 6 (kDLBool in DLPack >= 0.8, which torch and numpy read; 0.6 has no
// bool code).
#ifndef WEIGHTD_CLIENT_DLPACK_DTYPE_H_
#define WEIGHTD_CLIENT_DLPACK_DTYPE_H_

#include <dlpack/dlpack.h>

#include <cstdint>
#include <string_view>

namespace weightd {

inline constexpr uint8_t kDLBoolCode = 6;

struct DlpackDtype {
  const char* name;  // safetensors spelling
  uint8_t code;      // DLDataTypeCode
  uint8_t bits;
};

inline constexpr DlpackDtype kDlpackDtypes[] = {
    {"F64", kDLFloat, 64},   {"F32", kDLFloat, 32},     {"F16", kDLFloat, 16},     {"BF16", kDLBfloat, 16},
    {"C64", kDLComplex, 64}, {"I64", kDLInt, 64},       {"I32", kDLInt, 32},       {"I16", kDLInt, 16},
    {"I8", kDLInt, 8},       {"U64", kDLUInt, 64},      {"U32", kDLUInt, 32},      {"U16", kDLUInt, 16},
    {"U8", kDLUInt, 8},      {"BOOL", kDLBoolCode, 8}, {"F8_E4M3", kDLUInt, 8},   {"F8_E5M2", kDLUInt, 8},
    {"F8_E8M0", kDLUInt, 8}, {"F8_E4M3FNUZ", kDLUInt, 8}, {"F8_E5M2FNUZ", kDLUInt, 8},
};

// The entry for `dtype`, or nullptr when it has no DLPack equivalent.
inline const DlpackDtype* FindDlpackDtype(std::string_view dtype) {
  for (const DlpackDtype& d : kDlpackDtypes) {
    if (dtype == d.name) return &d;
  }
  return nullptr;
}

}  // namespace weightd

#endif  // WEIGHTD_CLIENT_DLPACK_DTYPE_H_
