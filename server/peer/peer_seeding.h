// The transport-level half of a joiner's load (server/peer/peer_join.h), apart
// from gRPC so tests drive it with a fake PeerTransport: check a seed's
// description against the local catalog and plan, pull the host segments
// through the transport while device tensors come from storage, and verify
// every hash and the fingerprint against the seed's.
//
// Thread-safety: a PeerPull is used by one load (its reads come from the
// load's threads at once).
#ifndef WEIGHTD_SERVER_PEER_PEER_SEEDING_H_
#define WEIGHTD_SERVER_PEER_PEER_SEEDING_H_

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <algorithm>

#include "absl/status/statusor.h"
#include "common/format/catalog.h"
#include "common/peer/peer_transport.h"
#include "server/load/loader.h"
#include "server/metrics/metrics.h"
#include "server/load/plan.h"
#include "weightd/v1/peer.pb.h"

namespace weightd {

// A status carrying its fall-back reason (kPeerFallbackReasons), and the
// reason of one: the carried one, else by code (DEADLINE_EXCEEDED
// "deadline", UNAVAILABLE "transfer_failed", DATA_LOSS "hash_mismatch",
// else "other").
absl::Status WithPeerReason(absl::Status status, absl::string_view reason);
std::string PeerReasonOf(const absl::Status& status);

// Lanes of a transfer (PeerConnectOptions::lanes): `configured` when not 0
// (--peer-lanes, at most kMaxPeerLanes); else one per kPeerBytesPerLane
// of host bytes and per core, at least 1, at most kMaxAutoPeerLanes. Per
// core, not fewer: a receiving helper spends most of its time creating the
// fresh pages it receives into, which parallelises across helpers (2 lanes
// beat 1 on 2 shared cores, 4 did not beat 2: docs/performance.md).
inline constexpr uint64_t kPeerBytesPerLane = 256ull << 20;
inline constexpr uint32_t kMaxAutoPeerLanes = 4;
uint32_t ChoosePeerLanes(uint64_t host_bytes, uint32_t configured,
                         unsigned cores = std::max(1u, std::thread::hardware_concurrency()));

// One load's pull from one peer.
class PeerPull {
 public:
  PeerPull(std::string peer, PeerTransport& transport, std::chrono::steady_clock::time_point deadline,
           Metrics* metrics, uint32_t lanes = 0)
      : peer_(std::move(peer)), transport_(transport), deadline_(deadline), metrics_(metrics), lanes_(lanes) {}
  uint32_t lanes() const { return lanes_; }  // as configured; 0: chosen per transfer (ChoosePeerLanes)
  // When the received segments are hashed (--peer-verify); before the load.
  SourceHashing hashing() const { return hashing_; }
  void set_hashing(SourceHashing hashing) { hashing_ = hashing; }
  // The lanes the transfer used (0 before it connected).
  uint32_t lanes_used() const { return lanes_used_.load(); }
  void set_lanes_used(uint32_t lanes) { lanes_used_ = lanes; }
  const std::string& peer() const { return peer_; }
  PeerTransport& transport() { return transport_; }
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }
  uint64_t bytes_read() const { return bytes_read_.load(); }
  void Received(uint64_t n) {
    bytes_read_ += n;
    if (metrics_) metrics_->PeerBytesReceived(peer_, n);
  }

 private:
  std::string peer_;
  PeerTransport& transport_;
  std::chrono::steady_clock::time_point deadline_;
  Metrics* metrics_;
  uint32_t lanes_;
  SourceHashing hashing_ = SourceHashing::kPerSegment;
  std::atomic<uint32_t> lanes_used_{0};
  std::atomic<uint64_t> bytes_read_{0};
};

// The offer of a seed's reply: its senders (at most kMaxPeerLanes: more is
// INVALID_ARGUMENT, which the caller counts as "other") and region sizes;
// the transport checks each sender's address and token.
absl::StatusOr<PeerOffer> OfferOf(const v1::PeerTransferReply& reply);

// OK when the seed's generation holds the same checkpoint (files by name,
// size and header hash; tensors by name, dtype and shape) with the same
// host segment layout as `plan`; FAILED_PRECONDITION naming the first
// difference otherwise. Every count in `reply` is checked against the
// local one before it is used.
absl::Status CheckSameCheckpoint(const v1::PeerTransferReply& reply, const Catalog& catalog, const LoadPlan& plan);

// Loads `request` with its host segments read from the seed `reply`
// describes (see peer_join.h); a generation with source "peer <peer>", or
// an error carrying its fall-back reason. `planned` is PlanLoad's result for
// `catalog`, `request` and `loader`: the plan the seed's layout is compared
// with and then loaded. Nothing of a failed pull survives the call.
absl::StatusOr<std::unique_ptr<ModelGeneration>> SeedFromDescription(const v1::PeerTransferReply& reply,
                                                                     const Catalog& catalog,
                                                                     const LoadRequest& request,
                                                                     const PlannedLoad& planned,
                                                                     const LoaderOptions& loader,
                                                                     const ProgressFn& progress, PeerPull& pull);

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PEER_PEER_SEEDING_H_
