#include "common/base/log.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace weightd {

namespace {

// The length of the valid UTF-8 sequence at `s` (RFC 3629: no overlongs, no
// surrogates, at most U+10FFFF) and its code point; 0 when invalid.
size_t Utf8Sequence(absl::string_view s, uint32_t* cp) {
  auto b = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  auto cont = [&](size_t i) { return i < s.size() && (b(i) & 0xc0) == 0x80; };
  unsigned char lead = b(0);
  if (lead < 0x80) return *cp = lead, 1;
  if (lead >= 0xc2 && lead <= 0xdf && cont(1)) return *cp = ((lead & 0x1fu) << 6) | (b(1) & 0x3fu), 2;
  if (lead >= 0xe0 && lead <= 0xef && cont(1) && cont(2)) {
    *cp = ((lead & 0x0fu) << 12) | ((b(1) & 0x3fu) << 6) | (b(2) & 0x3fu);
    return *cp >= 0x800 && (*cp < 0xd800 || *cp > 0xdfff) ? 3 : 0;
  }
  if (lead >= 0xf0 && lead <= 0xf4 && cont(1) && cont(2) && cont(3)) {
    *cp = ((lead & 0x07u) << 18) | ((b(1) & 0x3fu) << 12) | ((b(2) & 0x3fu) << 6) | (b(3) & 0x3fu);
    return *cp >= 0x10000 && *cp <= 0x10ffff ? 4 : 0;
  }
  return 0;
}

bool HiddenCodePoint(uint32_t cp) {
  return (cp >= 0x80 && cp <= 0x9f) || cp == 0x061c || cp == 0x200e || cp == 0x200f ||
         (cp >= 0x202a && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

bool IsValidUtf8(absl::string_view text) {
  while (!text.empty()) {
    uint32_t cp = 0;
    size_t n = Utf8Sequence(text, &cp);
    if (n == 0) return false;
    text.remove_prefix(n);
  }
  return true;
}

std::string EscapeForLog(absl::string_view message) {
  std::string out;
  out.reserve(message.size());
  while (!message.empty()) {
    uint32_t cp = 0;
    size_t n = Utf8Sequence(message, &cp);
    if (n == 0 || (n == 1 && (cp < 0x20 || cp == 0x7f))) {
      absl::StrAppendFormat(&out, "\\x%02x", static_cast<unsigned char>(message[0]));
      n = 1;
    } else if (cp == '\\') {
      out += "\\\\";
    } else if (HiddenCodePoint(cp)) {
      absl::StrAppendFormat(&out, "\\u{%04x}", cp);
    } else {
      out.append(message.data(), n);
    }
    message.remove_prefix(n);
  }
  return out;
}

void Log(LogLevel level, absl::string_view message) {
  static constexpr absl::string_view kNames[] = {"INFO ", "WARN ", "ERROR"};
  std::string line = absl::StrCat(absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), " ",
                                  kNames[static_cast<int>(level)], " ", EscapeForLog(message), "\n");
  (void)!write(STDERR_FILENO, line.data(), line.size());
}

}  // namespace weightd
