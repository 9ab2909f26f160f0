// libFuzzer target for the safetensors header parser: any byte string is a
// candidate file image. ParseFileImage must return a status for every input:
// no crash, no sanitizer report, no exception escaping, no allocation sized by
// an unchecked length field (libFuzzer's -malloc_limit_mb, by default
// -rss_limit_mb, catches that).
#include <cstddef>
#include <cstdint>

#include "absl/strings/string_view.h"
#include "common/format/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view image(reinterpret_cast<const char*>(data), size);
  (void)weightd::ParseFileImage(image, "fuzz.safetensors");
  return 0;
}
