// libFuzzer target for the packed tensor table decoder (AttachResponse
// .packed_tensors, common/format/packed_manifest.h): any byte string is a
// candidate table from a hostile daemon. Parse must return a status, and
// every record of a table it accepts must lie inside the input.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "absl/strings/string_view.h"
#include "common/format/packed_manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<weightd::PackedManifest> m = weightd::PackedManifest::Parse(bytes);
  if (!m.ok()) return 0;
  uint64_t sum = 0;
  for (uint32_t i = 0; i < m->size(); ++i) {
    weightd::PackedTensor t = m->Tensor(i);
    // Touch every byte a client reads: ASan reports any outside the input.
    for (char c : t.name) sum += static_cast<unsigned char>(c);
    for (char c : t.dtype) sum += static_cast<unsigned char>(c);
    for (uint32_t k = 0; k < t.ndim; ++k) sum += t.Dim(k);
    for (uint32_t k = 0; k < t.full_ndim; ++k) sum += t.FullDim(k);
  }
  if (sum == 1) std::abort();  // keeps the reads; never true for the seeds
  return 0;
}
