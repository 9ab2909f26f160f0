// The seed side of peer seeding (docs/operations.md "Peer seeding"): opens
// transfer sessions of READY generations for joiners on other nodes. A
// session holds a lease on the generation (an unload drains until it ends)
// and a reference to it, and exports its host segments through the
// PeerTransport (a helper process that maps them read-only and serves only
// this session's token); everything is released when the session is
// destroyed, the export first.
// At most `max_joiners` sessions are open at once; more are UNAVAILABLE,
// which sends the joiner to its next peer.
//
// The gRPC layer (server/listen/peer_service.h) turns a session into a
// PeerTransferReply and ends it when the joiner finishes, goes away, or
// the session limit passes.
//
// Thread-safety: every method may be called from any thread.
#ifndef WEIGHTD_SERVER_PEER_PEER_SEED_H_
#define WEIGHTD_SERVER_PEER_PEER_SEED_H_

#include <chrono>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/base/scoped_fd.h"
#include "common/peer/peer_transport.h"
#include "server/metrics/metrics.h"
#include "server/registry/registry.h"
#include "weightd/v1/peer.pb.h"

namespace weightd {

struct PeerSeedOptions {
  int max_joiners = 4;                                   // --peer-max-joiners
  std::chrono::milliseconds session_limit{600000};       // --peer-deadline-seconds
  // Test-only faults (--peer-test-fault): "corrupt" serves host segment 0
  // from a private copy with one byte flipped; "stall" stops the
  // transport's progress once a session is open. "" in production.
  std::string test_fault;
};

class PeerSeed {
 public:
  // `registry`, `transport` and `metrics` (may be null) must outlive this.
  PeerSeed(ModelRegistry* registry, PeerTransport* transport, PeerSeedOptions options, Metrics* metrics);

  class Session {
   public:
    ~Session();  // releases the lease and the registrations
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
    const ModelGeneration& model() const { return *model_; }
    const std::string& joiner() const { return joiner_; }
    // How a joiner reaches the host segments (regions in plan order).
    const PeerOffer& offer() const { return export_->offer(); }
    // The joiner's report at the end: bytes it read, and whether they
    // verified. Only its claim: the seed logs it as such when the session
    // ends, beside the bytes its own transport counted as sent, in all and
    // per sender (which alone feed weightd_peer_bytes_sent_total).
    void Finished(uint64_t bytes_read, bool verified);

   private:
    friend class PeerSeed;
    Session() = default;
    struct Report {
      uint64_t bytes_read;
      bool verified;
    };
    // How long the end of a session waits for the transport's count.
    static constexpr std::chrono::milliseconds kCountTimeout{500};
    std::optional<Report> report_;
    PeerSeed* seed_ = nullptr;
    std::string joiner_;
    std::string lease_id_;
    std::shared_ptr<ModelGeneration> model_;
    ScopedFd corrupt_copy_;  // test fault "corrupt": a memfd served instead of host segment 0
    std::unique_ptr<PeerExport> export_;
  };

  // Opens a session on the READY generation of `name` for `joiner` (its
  // address, for logs and metrics) that opens `lanes` lanes (the joiner's
  // untrusted count: 0 counts as 1): the export gets one sender per lane
  // (for UCX, a helper process each, so lanes do not share one sending
  // core), and the log line names how many. INVALID_ARGUMENT for more than
  // kMaxPeerLanes lanes; the registry's errors (NOT_FOUND,
  // FAILED_PRECONDITION, INVALID_ARGUMENT); UNAVAILABLE at max_joiners; the
  // transport's when a segment cannot be registered or a sender cannot start.
  absl::StatusOr<std::unique_ptr<Session>> Open(const std::string& name, const std::string& joiner,
                                                uint32_t lanes = 1);

  // The reply that describes `session` to its joiner.
  void Describe(const Session& session, v1::PeerTransferReply* reply) const;

  int joiners() const;
  const PeerSeedOptions& options() const { return options_; }


 private:
  // A session ended: its slot back.
  void Closed();
  // `joiner` as a metric label: the first kMaxJoinerLabels names seen, then
  // "other", so joiners cannot grow the series without bound.
  std::string JoinerLabel(const std::string& joiner);
  static constexpr size_t kMaxJoinerLabels = 256;

  ModelRegistry* registry_;
  PeerTransport* transport_;
  const PeerSeedOptions options_;
  Metrics* metrics_;
  mutable absl::Mutex mu_;
  int joiners_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<std::string> labels_ ABSL_GUARDED_BY(mu_);
};

}  // namespace weightd

#endif  // WEIGHTD_SERVER_PEER_PEER_SEED_H_
