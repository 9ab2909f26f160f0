// The messages between weightd and its peer transfer helpers
// (weightd-peer-helper, server/helper/peer_helper_main.cc), and between a joiner's
// helper and a seed's helper over UCX active messages.
//
// Why helpers: UCX over TCP lets any peer that connects to a worker make it
// write and read memory at addresses the peer names (UCT's TCP transport
// copies a PUT request's payload to the address in its header without a
// check: src/uct/tcp/tcp_ep.c uct_tcp_ep_handle_put_req in UCX 1.13; UCP's
// software RMA does the same for GETs). So weightd never runs UCX itself.
// Each transfer gets a helper process that
//   - maps only the bytes of that transfer: a seed's helper the sealed
//     segments of one generation, read-only; a joiner's helper the fresh
//     segments being filled (size-sealed memfds of the new generation),
//     writable, until weightd asks it to release them;
//   - switches to an unprivileged user (UcxHelperOptions::user) and sets
//     no_new_privs before UCX starts, and once UCX is up (a joiner: once
//     connected) sandboxes itself: Landlock without file system rights,
//     seccomp without ptrace, signals to others, AF_UNIX sockets or exec
//     (server/helper/peer_helper_main.cc Sandbox());
//   - dies with its transfer (the daemon closes the control socket, then
//     SIGKILLs and reaps it).
// A peer that takes over a helper therefore gets the bytes it could read
// anyway, or can write only bytes of a generation that is not served yet
// and never will be unless they pass the seal and the hashes: weightd seals
// each destination (F_SEAL_WRITE, refused with EBUSY while any process maps
// it writable, so a helper, or a child it forked, that kept a mapping fails
// the transfer) and only then hashes every tensor against the seed's
// hashes (docs/operations.md "Transfer helpers").
//
// Control socket: a SOCK_SEQPACKET socketpair at fd 3 of the helper; one
// message per struct below, native byte order (same host, same binary
// build). The helper exits when the socket reaches end of file.
//
//   seed:  weightd-peer-helper seed N [--user NAME] [--stall] [--no-sandbox]
//          fds 4 .. 4+N-1: the regions (their whole st_size is served).
//          One per sender of a session (PeerExportOptions::senders, one per
//          lane the joiner opens): each has its own worker and token.
//          helper -> daemon: Ready (token + worker address) or Error
//          daemon -> helper: Count; helper -> daemon: Count with the bytes
//          of the regions it has sent (replies UCX completed)
//   join:  weightd-peer-helper join N PIECE_BYTES PIECES [--user NAME] [--no-sandbox]
//          [--advise-huge] [--test-fault keep-mapping|late-write]
//          fds 4 .. 4+N-1: the destinations (their whole st_size, mapped
//          writable before UCX starts, the fds closed)
//          daemon -> helper: Connect, then Read and Release ...
//          helper -> daemon: Ready (connected) or Error, then one Done per
//          Read (at most PIECES in flight) and one Released per Release
//          (the destination is unmapped)
//
// Seed <-> joiner (UCX active messages, ucp_am_send_nbx): the joiner sends
// AmRequest (header only, with UCP_AM_SEND_FLAG_REPLY); the seed checks the
// token and the range and answers AmReply with the bytes as data, or with
// a non-zero status and no data.
#ifndef WEIGHTD_COMMON_PEER_HELPER_PROTOCOL_H_
#define WEIGHTD_COMMON_PEER_HELPER_PROTOCOL_H_

#include <cstdint>

#include "common/peer/peer_transport.h"

namespace weightd::peer_helper {

inline constexpr int kControlFd = 3;
inline constexpr int kFirstDataFd = 4;
inline constexpr uint32_t kTokenBytes = kPeerTokenBytes;
inline constexpr uint32_t kMaxAddressBytes = kMaxPeerWorkerAddressBytes;
inline constexpr uint64_t kMaxPieceBytes = 64ull << 20;  // one AmRequest
inline constexpr uint32_t kMaxSlots = 256;                // pieces in flight per joiner helper
inline constexpr uint32_t kMaxTextBytes = 480;

enum class Kind : uint32_t {
  kReady = 1, kError = 2, kConnect = 3, kRead = 4, kDone = 5, kCount = 6, kRelease = 7, kReleased = 8
};

// Ready, Error, Connect: a fixed head, then `length` bytes (address or text).
struct Head {
  Kind kind;
  uint32_t length;
  uint8_t token[kTokenBytes];  // Ready (seed), Connect
  int32_t landlock = 0;        // Ready: the Landlock ABI the helper runs under, 0 = none
  uint32_t reserved = 0;
};

struct Read {
  Kind kind = Kind::kRead;
  uint32_t destination;  // fd 4 + destination
  uint64_t id;           // echoed in Done
  uint32_t region;
  uint32_t reserved = 0;
  uint64_t offset;  // bytes into the region
  uint64_t n;       // <= PIECE_BYTES
  uint64_t at;      // bytes into the destination
};

// Release (weightd asks) and Released (the helper's answer, sent after
// munmap of the destination returned).
struct Release {
  Kind kind = Kind::kRelease;
  uint32_t destination = 0;
};

struct Done {
  Kind kind = Kind::kDone;
  int32_t code;     // absl::StatusCode; 0 = the destination holds the bytes (the helper's claim)
  uint64_t id;
  char text[kMaxTextBytes];  // NUL-terminated reason when code != 0
};

// Count: weightd asks with bytes = 0; a seed's helper answers with the
// bytes of region data whose replies UCX completed, counted on the seed's
// side (a joiner's own report of what it read is only a claim).
struct Count {
  Kind kind = Kind::kCount;
  uint32_t reserved = 0;
  uint64_t bytes = 0;
};

// UCX active message ids and headers.
inline constexpr unsigned kAmRequest = 11;
inline constexpr unsigned kAmReply = 12;

struct AmRequest {
  uint8_t token[kTokenBytes];
  uint64_t id;
  uint32_t region;
  uint32_t reserved = 0;
  uint64_t offset;
  uint64_t n;
};

struct AmReply {
  uint64_t id;
  int32_t code;  // absl::StatusCode; 0: the data is the n bytes asked for
  uint32_t reserved = 0;
};

}  // namespace weightd::peer_helper

#endif  // WEIGHTD_COMMON_PEER_HELPER_PROTOCOL_H_
