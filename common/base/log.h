// Timestamped, levelled log lines on stderr:
//   2026-11-30T04:50:00.123Z INFO  loaded 'llama' gen 3: 2.40 GiB in 1.20 s (2.00 GB/s)
// One event is one line: control bytes in a message (0x00-0x1f and 0x7f: a
// newline or ESC in a model name or path a client sent) are written as
// \xNN, so no client can forge or hide log lines or drive a terminal.
// Thread-safe: each line is written with one write(2).
#ifndef WEIGHTD_COMMON_BASE_LOG_H_
#define WEIGHTD_COMMON_BASE_LOG_H_

#include <string>

#include "absl/strings/string_view.h"

namespace weightd {

enum class LogLevel { kInfo, kWarning, kError };
void Log(LogLevel level, absl::string_view message);
inline void LogInfo(absl::string_view m) { Log(LogLevel::kInfo, m); }
inline void LogWarning(absl::string_view m) { Log(LogLevel::kWarning, m); }
inline void LogError(absl::string_view m) { Log(LogLevel::kError, m); }

// `message` with each control byte written as \xNN (lower-case hex); every
// other byte, UTF-8 included, unchanged. What Log() writes.
std::string EscapeControlBytes(absl::string_view message);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_BASE_LOG_H_
