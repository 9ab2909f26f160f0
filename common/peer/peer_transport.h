// PeerTransport: moves host memory between nodes' weightd daemons (issue
// "Peer seeding"). A seed exports the sealed host segments of a generation
// to one joiner and hands the joiner an offer (the transport's worker
// address, a random session token, the region sizes) over gRPC; the joiner
// connects to the offer and reads ranges of the regions into its own
// memory, several at once.
//
// The interface is small on purpose (export, connect, read, close) so that
// engines with GPU-direct lanes (NIXL, Mooncake) can be added beside the UCX
// one later; no transport's headers leak past its .cc.
//
// Trust: every peer may be hostile. Bytes read from a peer are untrusted;
// the caller verifies them (content hashes, fingerprint) before anything is
// served. UCX itself does not protect the process that runs it from its
// peers (over TCP, a connected peer can make UCX write and read memory at
// addresses it names: src/uct/tcp/tcp_ep.c, PUT requests), so the UCX
// transport runs UCX only in unprivileged helper processes that map
// nothing but the bytes of one transfer (common/peer/helper_protocol.h,
// docs/operations.md "Peer seeding").
#ifndef WEIGHTD_COMMON_PEER_PEER_TRANSPORT_H_
#define WEIGHTD_COMMON_PEER_PEER_TRANSPORT_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace weightd {

// Bounds on what a joiner accepts from a seed's offer.
inline constexpr size_t kMaxPeerWorkerAddressBytes = 16 << 10;
inline constexpr size_t kPeerTokenBytes = 16;
inline constexpr size_t kMaxPeerRegions = 1 << 16;

// At most this many lanes per connection (PeerConnectOptions::lanes), and
// senders per export (PeerExportOptions::senders).
inline constexpr uint32_t kMaxPeerLanes = 8;

// One sending endpoint of an export (for UCX: one helper process).
struct PeerSender {
  std::string worker_address;  // opaque transport bytes, 1..kMaxPeerWorkerAddressBytes
  std::string token;           // kPeerTokenBytes random bytes; every read from this sender presents them
};

// What a joiner needs to read one export. `worker_address` and `token` are
// sender 0; `more_senders` the others (at most kMaxPeerLanes - 1): lane L
// of a connection reads from sender L mod (1 + more_senders.size()), so
// every lane of a transfer has a sending process of its own when the
// export has as many senders as the connection lanes.
struct PeerOffer {
  std::string worker_address;          // sender 0's
  std::string token;                   // sender 0's
  std::vector<uint64_t> region_sizes;  // bytes readable in each region
  std::vector<PeerSender> more_senders{};
  uint32_t senders() const { return 1 + static_cast<uint32_t>(more_senders.size()); }
  // Sender `i` (< senders()) as one value.
  PeerSender sender(uint32_t i) const { return i == 0 ? PeerSender{worker_address, token} : more_senders[i - 1]; }
};

// One region to export: the first `size` bytes of the file `fd` refers to
// (a sealed memfd or hugetlbfs file). The fd is borrowed: the transport
// takes its own reference.
struct PeerExportRegion {
  int fd = -1;
  uint64_t size = 0;
};

struct PeerExportOptions {
  // Sending endpoints, 1..kMaxPeerLanes (for UCX: helper processes, each
  // mapping the regions read-only and serving its own token): one per lane
  // the joiner opens, so that no lane waits for another's sender.
  uint32_t senders = 1;
  // Test-only fault (--peer-test-fault stall): the export accepts reads
  // and never answers them, as a seed that hangs mid-transfer would.
  bool stall_for_test = false;
};

// Regions served to whoever presents the offer's token, until destroyed.
// After destruction nothing more of the regions is sent.
class PeerExport {
 public:
  virtual ~PeerExport() = default;
  virtual const PeerOffer& offer() const = 0;
  // Bytes of the regions sent to joiners so far, per sender in offer order
  // (sender 0 first), counted on this side by the transport (a joiner's
  // report of what it read is only its claim). DEADLINE_EXCEEDED when a
  // sender cannot tell by `deadline`, UNAVAILABLE when one is gone. Calls
  // are serialized by the caller.
  virtual absl::StatusOr<std::vector<uint64_t>> BytesSent(std::chrono::steady_clock::time_point deadline) = 0;
};

// Where a connection receives: one of the joiner's fresh host segments, a
// memfd (or hugetlbfs file) of `size` bytes whose size is already sealed
// (F_SEAL_SHRINK | F_SEAL_GROW), so that nothing the transport runs can
// truncate memory the caller maps. The fd is borrowed: the transport takes
// its own reference and gives it up in Release().
//
// Why a transport may write the caller's segments directly (issue 28: no
// staging copy in the caller): the caller never trusts what it wrote. It seals a
// destination (F_SEAL_WRITE, which the kernel refuses with EBUSY while any
// process still maps the file writable) only after Release(), and hashes it
// only after the seal; a transport process that kept a mapping fails the
// seal, and one that wrote anything else fails the hashes.
struct PeerDestination {
  int fd = -1;
  uint64_t size = 0;
};

struct PeerConnectOptions {
  std::vector<PeerDestination> destinations;  // at most kMaxPeerRegions
  // Parallel endpoints (for UCX: helper processes, each with its own
  // worker and endpoint) that one Read() spreads its pieces over,
  // 1..kMaxPeerLanes.
  uint32_t lanes = 1;
  // The destinations are shmem THP segments under shmem_enabled "advise":
  // mappings the transport makes get madvise(MADV_HUGEPAGE), since a page is
  // made huge or not by the mapping that faults it.
  bool advise_huge_pages = false;
};

// One read: bytes [offset, offset + n) of region `region` (an index into the
// offer's regions) into bytes [at, at + n) of destination `destination`.
struct PeerRead {
  uint32_t region = 0;
  uint64_t offset = 0;
  uint64_t n = 0;
  uint32_t destination = 0;
  uint64_t at = 0;
};

// A connection to one export. Read() may be called from several threads at
// once, and Release() of a destination no Read() in progress uses; the
// connection must outlive every call. Destruction stops every process of
// the transport and waits until they are gone (UCX: SIGKILL after 1 s, then
// reaped).
class PeerConnection {
 public:
  virtual ~PeerConnection() = default;
  // Issues the reads (the transport pipelines them over its lanes) and
  // returns when all are done, or the first error: INVALID_ARGUMENT for a
  // read outside its region or destination, or into a released destination
  // (checked here, and the region again by the seed), UNAVAILABLE when the
  // peer went away or failed, PERMISSION_DENIED when the seed refused the
  // token, DEADLINE_EXCEEDED past `deadline`. What the destinations hold
  // is the transport's claim until the caller has sealed and hashed them.
  // After an error the connection is broken: later calls fail at once
  // with the same error.
  virtual absl::Status Read(const std::vector<PeerRead>& reads, std::chrono::steady_clock::time_point deadline) = 0;
  // The transport's processes unmap `destination` and close their fds of
  // it, and say so; then, unless one of them misbehaves, the caller's seal
  // succeeds. Errors as for Read(); a broken connection releases nothing
  // (its destruction kills the processes, which releases everything).
  virtual absl::Status Release(uint32_t destination, std::chrono::steady_clock::time_point deadline) = 0;
  virtual uint32_t lanes() const = 0;
};

// Thread-safety: every method may be called from any thread.
class PeerTransport {
 public:
  virtual ~PeerTransport() = default;
  // "ucx", "fake": for logs, and both sides must name the same.
  virtual std::string name() const = 0;
  // Starts serving `regions` read-only from `options.senders` senders. The
  // transport's errors: UNAVAILABLE when it cannot start, RESOURCE_EXHAUSTED,
  // INVALID_ARGUMENT for a bad fd or size or a sender count outside
  // 1..kMaxPeerLanes.
  virtual absl::StatusOr<std::unique_ptr<PeerExport>> Export(const std::vector<PeerExportRegion>& regions,
                                                             const PeerExportOptions& options) = 0;
  // Connects to `offer`, which the caller took from an untrusted peer, to
  // receive into `options.destinations`: the transport checks the offer's
  // bounds (every sender's address and token, at most kMaxPeerLanes
  // senders) and the options' (INVALID_ARGUMENT). UNAVAILABLE when the peer
  // cannot be reached, DEADLINE_EXCEEDED past `deadline`.
  virtual absl::StatusOr<std::unique_ptr<PeerConnection>> Connect(const PeerOffer& offer,
                                                                  std::chrono::steady_clock::time_point deadline,
                                                                  const PeerConnectOptions& options) = 0;
};

// The UCX (UCP) transport through helper processes; see helper_transport.h.
struct UcxHelperOptions {
  // The weightd-peer-helper executable. It is opened once, here, and every
  // helper is started from that descriptor.
  std::string helper_path;
  // When the daemon runs as root, helpers switch to this user before UCX
  // starts; "" keeps root (not recommended).
  std::string user = "nobody";
  // Joiner side: a read is cut into pieces of at most `piece_bytes`, each
  // one UCX request whose reply lands in the destination's mapping in the
  // lane's helper; each lane keeps at most `pieces` in flight.
  uint64_t piece_bytes = 4ull << 20;
  uint32_t pieces = 16;
  // Test-only fault of joiner helpers (--peer-test-fault): "keep-mapping"
  // (on Release a child process keeps a writable mapping and the helper
  // says it released), "late-write" (on Release the helper flips a byte it
  // reported done). "" in production.
  std::string test_fault;
  // How long a helper may take to start and report its address.
  std::chrono::milliseconds start_timeout{20000};
  // Landlock and seccomp in the helpers (helper_protocol.h); false only
  // where a UCX transport needs what they forbid (--peer-helper-sandbox).
  bool sandbox = true;
};

// INVALID_ARGUMENT naming the path when the helper cannot be opened or is
// not an executable regular file; UNAVAILABLE without /proc.
absl::StatusOr<std::unique_ptr<PeerTransport>> MakeUcxHelperTransport(UcxHelperOptions options);

// The default helper path: weightd-peer-helper in the directory of the
// running executable (/proc/self/exe).
std::string DefaultPeerHelperPath();

}  // namespace weightd

#endif  // WEIGHTD_COMMON_PEER_PEER_TRANSPORT_H_
