#include "common/base/status.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace weightd {
namespace {

absl::StatusCode CodeForErrno(int err) {
  switch (err) {
    case ENOENT:
    case ENOTDIR:
      return absl::StatusCode::kNotFound;
    case EACCES:
    case EPERM:
      return absl::StatusCode::kPermissionDenied;
    case ENOMEM:
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case EDQUOT:
      return absl::StatusCode::kResourceExhausted;
    case EINTR:
    case EAGAIN:
      return absl::StatusCode::kUnavailable;
    case EINVAL:
    case EISDIR:
    case ELOOP:
    case ENAMETOOLONG:
      return absl::StatusCode::kInvalidArgument;
    default:
      return absl::StatusCode::kInternal;
  }
}

bool IsContinuationByte(char c) { return (static_cast<unsigned char>(c) & 0xC0) == 0x80; }

// The largest offset <= `at` that does not split a UTF-8 character of `text`.
size_t CharBoundaryAtOrBefore(absl::string_view text, size_t at) {
  while (at > 0 && at < text.size() && IsContinuationByte(text[at])) --at;
  return at;
}

// The smallest offset >= `at` that does not split a UTF-8 character of `text`.
size_t CharBoundaryAtOrAfter(absl::string_view text, size_t at) {
  while (at < text.size() && IsContinuationByte(text[at])) ++at;
  return at;
}

}  // namespace

absl::Status ErrnoToStatus(absl::string_view what, int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return absl::Status(CodeForErrno(err), absl::StrCat(what, ": ", text));
}

absl::Status Annotate(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  absl::Status annotated(status.code(), absl::StrCat(prefix, ": ", status.message()));
  status.ForEachPayload(
      [&](absl::string_view type_url, const absl::Cord& payload) { annotated.SetPayload(type_url, payload); });
  return annotated;
}

std::string ElideName(absl::string_view name) {
  constexpr size_t kKeep = 96;  // bytes kept at each end
  if (name.size() <= kMaxNameBytesInMessages) return std::string(name);
  absl::string_view head = name.substr(0, CharBoundaryAtOrBefore(name, kKeep));
  absl::string_view tail = name.substr(CharBoundaryAtOrAfter(name, name.size() - kKeep));
  return absl::StrCat(head, "…(", name.size(), " bytes)…", tail);
}

std::string QuoteName(absl::string_view name) { return absl::StrCat("'", ElideName(name), "'"); }

std::string CapMessage(absl::string_view message, size_t max_bytes) {
  if (message.size() <= max_bytes) return std::string(message);
  std::string marker = absl::StrCat("…[truncated, ", message.size(), " bytes in all]");
  size_t keep = max_bytes > marker.size() ? max_bytes - marker.size() : 0;
  return absl::StrCat(message.substr(0, CharBoundaryAtOrBefore(message, keep)), marker);
}

}  // namespace weightd
