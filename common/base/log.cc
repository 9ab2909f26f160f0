#include "common/base/log.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace weightd {

std::string EscapeControlBytes(absl::string_view message) {
  std::string out;
  out.reserve(message.size());
  for (char c : message) {
    unsigned char byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      absl::StrAppendFormat(&out, "\\x%02x", byte);
    } else {
      out.push_back(c);
    }
  }
  return out;
}

void Log(LogLevel level, absl::string_view message) {
  static constexpr absl::string_view kNames[] = {"INFO ", "WARN ", "ERROR"};
  std::string line = absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " ",
                                  kNames[static_cast<int>(level)], " ", EscapeControlBytes(message), "\n");
  (void)!write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace weightd
