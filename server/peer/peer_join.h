// The joining side of peer seeding (docs/operations.md "Peer seeding").
// A load with peers catalogs the local checkpoint's headers and makes its
// plan as always, then asks each peer in turn (weightd.v1.Peer/Transfer)
// for its READY generation of the same name. A peer is used only when its
// generation has the same checkpoint identity and plan: the same files
// (name, size, header hash), tensors (name, dtype, shape) and host segment
// layout. The host segments are then filled from the peer's memory over the
// PeerTransport, received straight into them by the transport's helpers
// over one or more lanes, while device-placed tensors are read from local
// storage in the same load; each segment is sealed once the helpers have
// unmapped it (a helper that kept a mapping fails the seal), then every
// tensor is hashed from the sealed bytes and must equal the seed's hash,
// and the model fingerprint must equal the seed's. Only then is the
// generation returned, with source "peer HOST:PORT".
//
// Any failure (unreachable, refused, not served, different checkpoint,
// transport failure, deadline, hash mismatch) frees everything received
// from that peer, logs one line naming the peer and the reason, counts
// weightd_peer_fallbacks_total{reason}, and moves to the next peer; after
// the last one the caller reads storage. Nothing received from a failed
// peer is ever served.
//
// Thread-safety: Load may be called from many threads at once.
#ifndef WEIGHTD_SERVER_PEER_PEER_JOIN_H_
#define WEIGHTD_SERVER_PEER_PEER_JOIN_H_

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/security/credentials.h>

#include "absl/status/statusor.h"
#include "common/format/catalog.h"
#include "common/peer/peer_transport.h"
#include "server/load/loader.h"
#include "server/metrics/metrics.h"
#include "server/model/model.h"

namespace weightd {

inline constexpr size_t kMaxPeers = 64;             // per request, and in the config
inline constexpr size_t kMaxPeerAddressBytes = 256;
// A seed's description is bounded by this (gRPC receive limit), and its
// counts must equal the local catalog's.
inline constexpr int kMaxPeerReplyBytes = 256 << 20;

// weightd_peer_fallbacks_total{reason}.
inline constexpr const char* kPeerFallbackReasons[] = {
    "unavailable",           // unreachable, shutting down, or at its joiner limit
    "not_served",            // no READY generation of the name there
    "different_checkpoint",  // files, tensors or plan differ
    "transfer_failed",       // the transport failed (seed died, connection reset)
    "deadline",              // --peer-deadline-seconds passed
    "hash_mismatch",         // received bytes or fingerprint differ from the seed's
    "seal_refused",          // a transfer helper still mapped a received segment writable (F_SEAL_WRITE: EBUSY)
    "local",                 // this node's peer transport cannot start (helper, user): no peer is tried
    "other"};

// How long a joiner waits for a peer to accept its connection (TCP, and
// TLS where configured) before that peer is `unavailable`.
inline constexpr std::chrono::seconds kPeerConnectTimeout{5};

// Checks a list of peer addresses: at most kMaxPeers, each "HOST:PORT" of
// at most kMaxPeerAddressBytes with a port in 1..65535. INVALID_ARGUMENT
// naming `what` ("peers", "--peers") and the entry.
absl::Status ValidatePeerList(const std::vector<std::string>& peers, const std::string& what);

struct PeerJoinOptions {
  std::vector<std::string> peers;  // the config's, tried after a request's own
  // Mutual TLS to seeds (--peer-tls-*): this node's certificate and key and
  // the fleet's CA; null: plain TCP. With `tls_server_name`, seeds'
  // certificates must carry that name instead of the address dialled.
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string tls_server_name;
  std::chrono::milliseconds deadline{600000};  // per peer: from asking it to READY
  uint32_t lanes = 0;  // --peer-lanes: parallel UCX endpoints (helpers) per transfer; 0: ChoosePeerLanes
  // --peer-verify: hash each received segment once sealed (per segment) or
  // all after the last byte (per transfer); every byte before publish either way.
  SourceHashing hashing = SourceHashing::kPerSegment;
  // The transport, created on first use; errors are the transport's.
  std::function<absl::StatusOr<PeerTransport*>()> transport;
  Metrics* metrics = nullptr;  // may be null
};

class PeerJoiner final : public GenerationSource {
 public:
  explicit PeerJoiner(PeerJoinOptions options) : options_(std::move(options)) {}
  // Before the first Load (the daemon makes its metrics after the registry).
  void set_metrics(Metrics* metrics) { options_.metrics = metrics; }

  // The peers a load of `request` asks: its own, then the config's, each
  // name expanded to every address it resolves to (a headless Service
  // stands for all its pods), without repeats, at most kMaxPeers.
  std::vector<std::string> PeersFor(const LoadRequest& request) const;

  // Seeds `request` (catalog built from the local checkpoint) from the first
  // peer that serves it, as described above; `loader` as for LoadGeneration
  // (its host_source is set here). On failure of every peer, the last
  // peer's error: the caller then loads from storage.
  // NOT_FOUND "no peers" at once when PeersFor(request) is empty. Each
  // peer name is resolved once per call, and the load is planned once
  // (PlanLoad) for every peer asked; a plan that cannot be made asks none.
  absl::StatusOr<std::unique_ptr<ModelGeneration>> Load(const Catalog& catalog, const LoadRequest& request,
                                                        const LoaderOptions& loader,
                                                        const ProgressFn& progress) override;

 private:
  absl::StatusOr<std::unique_ptr<ModelGeneration>> LoadFrom(const std::string& peer, const Catalog& catalog,
                                                            const LoadRequest& request, const PlannedLoad& planned,
                                                            const LoaderOptions& loader, const ProgressFn& progress,
                                                            uint32_t* lanes);
  PeerJoinOptions options_;
};

// The fall-back reason (kPeerFallbackReasons) of a failed LoadFrom.
std::string PeerFallbackReason(const absl::Status& status);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PEER_PEER_JOIN_H_
