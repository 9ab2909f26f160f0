// PeerTransport: moves host memory between nodes' weightd daemons (issue
// "Peer seeding"). A seed registers the host segments of a generation and
// hands their remote descriptors (address, size, opaque key bytes) and its
// worker address to a joiner over gRPC; the joiner connects to that worker
// and reads ranges of the regions into its own memory, several at once.
//
// The interface is small on purpose (register, connect, read, close) so that
// engines with GPU-direct lanes (NIXL, Mooncake) can be added beside the UCX
// one (ucx_transport.h) later; no transport's headers leak past its .cc.
//
// Trust: bytes read from a peer are untrusted; the caller verifies them
// (content hashes, fingerprint) before anything is served. What a transport
// lets a remote reader reach is the transport's property: see
// docs/operations.md "Peer seeding" for UCX over TCP.
#ifndef WEIGHTD_COMMON_PEER_PEER_TRANSPORT_H_
#define WEIGHTD_COMMON_PEER_PEER_TRANSPORT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace weightd {

// Bounds on what a joiner accepts from a seed's description (bytes).
inline constexpr size_t kMaxPeerWorkerAddressBytes = 64 << 10;
inline constexpr size_t kMaxPeerRemoteKeyBytes = 64 << 10;

// A region of a seed's memory as a joiner sees it.
struct RemoteRegion {
  uint64_t address = 0;  // the seed's virtual address of byte 0
  uint64_t size = 0;     // bytes
  std::string key;       // opaque remote-key bytes (PeerRegion::remote_key)
};

// A local region registered for remote reads; deregistered when destroyed.
// The memory must stay mapped for the object's lifetime.
class PeerRegion {
 public:
  virtual ~PeerRegion() = default;
  virtual RemoteRegion Describe() const = 0;
};

// One read: bytes [offset, offset + n) of region `region` (an index into the
// regions given to Connect) into `dst` (caller-owned, n bytes).
struct PeerRead {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t n = 0;
  char* dst = nullptr;
};

// A connection to one remote worker. Read() may be called from several
// threads at once; destruction waits for nothing of the caller's (every
// Read has returned).
class PeerConnection {
 public:
  virtual ~PeerConnection() = default;
  // Issues every read at once (the transport may pipeline them) and returns
  // when all are done, or the first error: INVALID_ARGUMENT for a read
  // outside its region, UNAVAILABLE when the peer went away or failed,
  // DEADLINE_EXCEEDED past `deadline`. On return no transfer still writes
  // into any `dst`, whatever the result. After an error the connection is
  // broken: later reads fail at once.
  virtual absl::Status Read(const std::vector<PeerRead>& reads, std::chrono::steady_clock::time_point deadline) = 0;
};

class PeerTransport {
 public:
  virtual ~PeerTransport() = default;
  // "ucx", "fake": for logs.
  virtual std::string name() const = 0;
  // The opaque bytes a remote Connect() needs to reach this transport.
  virtual std::string worker_address() const = 0;
  // Registers `size` bytes at `base` for remote reads (read-only memory is
  // fine). RESOURCE_EXHAUSTED or INTERNAL with the transport's reason.
  virtual absl::StatusOr<std::unique_ptr<PeerRegion>> Register(const void* base, uint64_t size) = 0;
  // Connects to the worker at `worker_address` to read `regions` (which
  // the caller took from an untrusted peer: the transport validates the
  // key bytes). INVALID_ARGUMENT for malformed bytes, UNAVAILABLE when the
  // peer cannot be reached.
  virtual absl::StatusOr<std::unique_ptr<PeerConnection>> Connect(const std::string& worker_address,
                                                                  const std::vector<RemoteRegion>& regions) = 0;
  // Test-only fault (weightd --peer-test-fault stall): stops serving remote
  // reads for good, as a seed that hangs mid-transfer would.
  virtual void StallForTest() = 0;
};

// The UCX (UCP) transport: one context and worker, a progress thread.
// UCX reads its UCX_* environment variables (UCX_TLS, UCX_NET_DEVICES, ...)
// here. UNAVAILABLE with UCX's reason when it cannot start.
absl::StatusOr<std::unique_ptr<PeerTransport>> MakeUcxTransport();

}  // namespace weightd

#endif  // WEIGHTD_COMMON_PEER_PEER_TRANSPORT_H_
