#include "common/base/status.h"

#include <cerrno>
#include <cstring>
#include <string>

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

}  // namespace

absl::Status ErrnoToStatus(absl::string_view what, int err) {
  char buf[256];
  // GNU strerror_r may return a static string instead of filling buf.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return absl::Status(CodeForErrno(err), absl::StrCat(what, ": ", text));
}

absl::Status Annotate(const absl::Status& status, absl::string_view prefix) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(prefix, ": ", status.message()));
}

}  // namespace weightd
