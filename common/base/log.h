// Timestamped, levelled log lines on stderr:
//   2026-11-30T04:50:00.123Z INFO  loaded 'llama' gen 3: 2.40 GiB in 1.20 s (2.00 GB/s)
// One event is one line, and what a client sent cannot pass for anything
// else: a message is written through EscapeForLog, so a newline, ESC or a
// C1 control in a model name or path cannot forge or hide a line or drive a
// terminal, a bidi override cannot reorder what an operator reads, and a
// literal backslash cannot imitate an escape.
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

// `message` with: each ASCII control byte (0x00-0x1f, 0x7f) and each byte
// that is not part of valid UTF-8 as \xNN (lower-case hex); each C1 control
// (U+0080-U+009F) and Unicode bidi format character (U+061C, U+200E,
// U+200F, U+202A-U+202E, U+2066-U+2069) as \u{XXXX}; a backslash as \\.
// Everything else, printable UTF-8 included, unchanged. What Log() writes.
std::string EscapeForLog(absl::string_view message);

// Whether `text` is valid UTF-8 (RFC 3629: no overlong forms, no
// surrogates, nothing above U+10FFFF): what a protobuf string field must
// hold, so a client checks names, paths and patterns before sending them.
bool IsValidUtf8(absl::string_view text);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_BASE_LOG_H_
