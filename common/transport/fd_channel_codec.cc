#include "common/transport/fd_channel_codec.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

using Kind = FdChannelMessage::Kind;

// Decimal digits only (no sign, no blanks), at most `max`.
bool ParseCount(absl::string_view digits, uint64_t max, uint64_t* out) {
  if (digits.empty() || digits.size() > 20) return false;
  uint64_t value = 0;
  for (char c : digits) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
    value = value * 10 + static_cast<uint64_t>(c - '0');
    if (value > max) return false;
  }
  *out = value;
  return true;
}

// The longest prefix of `s` of at most `n` bytes that does not split a UTF-8 character.
absl::string_view Utf8Prefix(absl::string_view s, size_t n) {
  if (s.size() <= n) return s;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return s.substr(0, n);
}

absl::Status Malformed(absl::string_view what, absl::string_view payload) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed fd-channel message (", what, "): '", Utf8Prefix(payload, 64),
                   payload.size() > 64 ? kTruncatedMarker : "", "'"));
}

absl::StatusOr<FdChannelMessage> ParseErr(absl::string_view payload) {
  absl::string_view rest = payload.substr(4);
  size_t space = rest.find(' ');
  uint64_t code = 0;
  if (!ParseCount(rest.substr(0, space), 16, &code) || code == 0) return Malformed("ERR code not in 1..16", payload);
  FdChannelMessage m;
  m.kind = Kind::kErr;
  absl::string_view message = space == absl::string_view::npos ? "" : rest.substr(space + 1);
  m.error = absl::Status(static_cast<absl::StatusCode>(code), message);
  return m;
}

}  // namespace

std::string EncodeClaim(absl::string_view lease_id) { return absl::StrCat("CLAIM ", lease_id); }
std::string EncodeOk(uint64_t fd_count) { return absl::StrCat("OK ", fd_count); }
std::string EncodeMore() { return "MORE"; }

std::string EncodeErr(const absl::Status& error) {
  std::string head = absl::StrCat("ERR ", static_cast<int>(error.code()), " ");
  absl::string_view message = error.message();
  if (head.size() + message.size() <= kMaxMessageBytes) return absl::StrCat(head, message);
  size_t room = kMaxMessageBytes - head.size() - kTruncatedMarker.size();
  return absl::StrCat(head, Utf8Prefix(message, room), kTruncatedMarker);
}

absl::StatusOr<FdChannelMessage> ParseFdChannelMessage(absl::string_view payload) {
  if (payload.size() > kMaxMessageBytes) return Malformed(absl::StrCat("over ", kMaxMessageBytes, " bytes"), payload);
  FdChannelMessage m;
  if (payload == "MORE") return m;
  if (absl::StartsWith(payload, "ERR ")) return ParseErr(payload);
  if (absl::StartsWith(payload, "OK ")) {
    if (!ParseCount(payload.substr(3), kMaxFdsPerClaim, &m.fd_count)) return Malformed("OK count", payload);
    m.kind = Kind::kOk;
    return m;
  }
  if (absl::StartsWith(payload, "CLAIM ") && payload.size() > 6) {
    m.kind = Kind::kClaim;
    m.lease_id = std::string(payload.substr(6));
    return m;
  }
  return Malformed("expected CLAIM, OK, MORE or ERR", payload);
}

}  // namespace weightd
