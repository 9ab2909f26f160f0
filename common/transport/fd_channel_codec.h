// The fd channel's messages, encoded and parsed in one place for the daemon
// (server/listen/fd_channel.cc) and the C++ client (client/client.cc). The grammar,
// its limits and the exchange are documented once, in docs/api.md ("The fd
// channel"); the Python client (client/python/weightd/_fdsock.py) follows the
// same text.
//
// Pure functions of bytes: no socket, no fd. Thread-safe.
#ifndef WEIGHTD_COMMON_TRANSPORT_FD_CHANNEL_CODEC_H_
#define WEIGHTD_COMMON_TRANSPORT_FD_CHANNEL_CODEC_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace weightd {

// One SEQPACKET message's payload carries at most kMaxMessageBytes bytes and
// at most kMaxFdsPerMessage fds (the kernel's SCM_MAX_FD is 253).
inline constexpr size_t kMaxMessageBytes = 4096;
inline constexpr size_t kMaxFdsPerMessage = 250;
// The largest count an "OK <n>" may announce (Linux's default fs.nr_open).
inline constexpr uint64_t kMaxFdsPerClaim = 1 << 20;
// Ends an ERR message that was cut to fit in kMaxMessageBytes.
inline constexpr absl::string_view kTruncatedMarker = "...[truncated]";

struct FdChannelMessage {
  enum class Kind { kClaim, kOk, kMore, kErr };
  Kind kind = Kind::kMore;
  std::string lease_id;   // kClaim
  uint64_t fd_count = 0;  // kOk: fds announced, carried by this and the MOREs after it
  absl::Status error;     // kErr: the daemon's code and message (never OK)
};

std::string EncodeClaim(absl::string_view lease_id);
std::string EncodeOk(uint64_t fd_count);
std::string EncodeMore();
// "ERR <code> <message>", the message cut (at a UTF-8 character boundary)
// and ended with kTruncatedMarker when the whole would exceed
// kMaxMessageBytes. `error` must not be OK.
std::string EncodeErr(const absl::Status& error);

// Parses one payload. INVALID_ARGUMENT, naming what is wrong, for anything
// the grammar does not produce: an unknown verb, an empty lease id, an OK
// count that is not decimal digits or exceeds kMaxFdsPerClaim, an ERR code
// outside 1..16, a payload over kMaxMessageBytes.
absl::StatusOr<FdChannelMessage> ParseFdChannelMessage(absl::string_view payload);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_TRANSPORT_FD_CHANNEL_CODEC_H_
