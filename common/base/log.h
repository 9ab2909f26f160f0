// Timestamped, levelled log lines on stderr:
//   2026-11-30T04:50:00.123Z INFO  loaded 'llama' gen 3: 2.40 GiB in 1.20 s (2.00 GB/s)
// Thread-safe: each line is written with one write(2).
#ifndef WEIGHTD_COMMON_BASE_LOG_H_
#define WEIGHTD_COMMON_BASE_LOG_H_

#include "absl/strings/string_view.h"

namespace weightd {

enum class LogLevel { kInfo, kWarning, kError };
void Log(LogLevel level, absl::string_view message);
inline void LogInfo(absl::string_view m) { Log(LogLevel::kInfo, m); }
inline void LogWarning(absl::string_view m) { Log(LogLevel::kWarning, m); }
inline void LogError(absl::string_view m) { Log(LogLevel::kError, m); }

}  // namespace weightd

#endif  // WEIGHTD_COMMON_BASE_LOG_H_
