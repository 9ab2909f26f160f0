#include "common/base/log.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace weightd {

void Log(LogLevel level, absl::string_view message) {
  static constexpr absl::string_view kNames[] = {"INFO ", "WARN ", "ERROR"};
  std::string line = absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " ",
                                  kNames[static_cast<int>(level)], " ", message, "\n");
  (void)!write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace weightd
