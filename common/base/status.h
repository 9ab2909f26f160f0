// Error-model helpers shared by every weightd module.
//
// Debian's Abseil (20220623) has no RETURN_IF_ERROR / ASSIGN_OR_RETURN, so the
// project defines them once here with its own prefix. Every foreign error
// source has one converter that keeps the cause (errno text, CUDA driver text).
#ifndef WEIGHTD_COMMON_BASE_STATUS_H_
#define WEIGHTD_COMMON_BASE_STATUS_H_

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

#define WEIGHTD_CONCAT_INNER_(a, b) a##b
#define WEIGHTD_CONCAT_(a, b) WEIGHTD_CONCAT_INNER_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define WEIGHTD_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status weightd_status_ = (expr);           \
    if (!weightd_status_.ok()) return weightd_status_; \
  } while (0)

// `lhs = value of rexpr` (an absl::StatusOr<T>), or returns its error.
#define WEIGHTD_ASSIGN_OR_RETURN(lhs, rexpr) \
  WEIGHTD_ASSIGN_OR_RETURN_IMPL_(WEIGHTD_CONCAT_(weightd_statusor_, __LINE__), lhs, rexpr)
#define WEIGHTD_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                   \
  if (!tmp.ok()) return std::move(tmp).status();        \
  lhs = std::move(tmp).value()

namespace weightd {

// "what: strerror(err)" with a code chosen by what the caller can do about it:
// ENOENT -> NOT_FOUND, EACCES/EPERM -> PERMISSION_DENIED, ENOMEM/ENOSPC/EMFILE
// -> RESOURCE_EXHAUSTED, EINTR/EAGAIN -> UNAVAILABLE, EINVAL/EISDIR/ELOOP/ENAMETOOLONG -> INVALID_ARGUMENT,
// anything else -> INTERNAL. Thread-safe (uses strerror_r).
absl::Status ErrnoToStatus(absl::string_view what, int err);

// Returns `status` with "prefix: " put before its message, keeping its code
// and payloads (a checkpoint error's reason, format_error.h); OK stays OK.
absl::Status Annotate(const absl::Status& status, absl::string_view prefix);

// Names (tensor, file, model, TP rule pattern, device, checkpoint path as
// given) longer than this are elided in messages.
inline constexpr size_t kMaxNameBytesInMessages = 200;
// Messages longer than this are cut where they leave the process: a gRPC
// status travels in HTTP/2 trailers, which clients refuse past 8 KiB
// ("received initial metadata size exceeds limit"), and the fd channel's
// ERR reply is one datagram of at most 4096 bytes.
inline constexpr size_t kMaxStatusMessageBytes = 1024;

// `name` as it appears in a message: unchanged up to kMaxNameBytesInMessages
// bytes, else its first and last 96 bytes around "…(N bytes)…", cut on UTF-8
// character boundaries, so one long user string cannot swamp the message.
std::string ElideName(absl::string_view name);
// ElideName in single quotes: "tensor " + QuoteName(name) + " appears twice".
// The one way messages quote a tensor, file or model name.
std::string QuoteName(absl::string_view name);

// `message` unchanged up to `max_bytes`, else cut on a UTF-8 character
// boundary and ended with a visible "…[truncated, N bytes in all]" marker so
// that the result is at most `max_bytes` bytes.
std::string CapMessage(absl::string_view message, size_t max_bytes = kMaxStatusMessageBytes);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_BASE_STATUS_H_
