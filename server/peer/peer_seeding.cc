#include "server/peer/peer_seeding.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "common/format/content_hash.h"
#include "common/base/parallel.h"
#include <thread>

namespace weightd {
namespace {

constexpr char kReasonPayload[] = "weightd/peer-fallback-reason";

absl::Status Differs(absl::string_view what) {
  return absl::FailedPreconditionError(absl::StrCat("the peer's generation differs from the local checkpoint: ", what));
}

absl::Status CheckFiles(const v1::PeerTransferReply& reply, const Catalog& catalog) {
  if (static_cast<size_t>(reply.files_size()) != catalog.files.size()) {
    return Differs(absl::StrCat(reply.files_size(), " files there, ", catalog.files.size(), " here"));
  }
  for (size_t f = 0; f < catalog.files.size(); ++f) {
    const v1::PeerFile& theirs = reply.files(static_cast<int>(f));
    const CatalogFile& ours = catalog.files[f];
    if (theirs.name() != ours.name || theirs.size() != ours.size || theirs.header_hash() != ours.header_hash) {
      return Differs(absl::StrCat("file ", f, " is ", QuoteName(theirs.name()), " of ", theirs.size(),
                                  " bytes there, ", QuoteName(ours.name), " of ", ours.size,
                                  " bytes here, or its header differs"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckTensor(const v1::PeerTensor& theirs, const CatalogTensor& ours, const TensorPlan& plan) {
  std::vector<uint64_t> shape(theirs.shape().begin(), theirs.shape().end());
  if (theirs.name() != ours.name || theirs.dtype() != DTypeName(ours.dtype) || shape != ours.shape) {
    return Differs(absl::StrCat("tensor ", QuoteName(ours.name), " has another name, dtype or shape there"));
  }
  bool host = plan.placement == Placement::kHost;
  if (theirs.host() != host ||
      (host && (theirs.host_segment() != plan.host_segment || theirs.host_offset() != plan.host_offset ||
                theirs.nbytes() != ours.nbytes))) {
    return Differs(absl::StrCat("tensor ", QuoteName(ours.name),
                                " is placed differently there (another placement or TP plan)"));
  }
  return absl::OkStatus();
}

// The tensor bytes of `catalog` that are not host-placed: read from storage.
uint64_t DeviceBytes(const Catalog& catalog, const LoadPlan& plan) {
  uint64_t bytes = 0;
  for (size_t i = 0; i < catalog.tensors.size(); ++i) {
    if (plan.tensors[i].placement != Placement::kHost) bytes += catalog.tensors[i].nbytes;
  }
  return bytes;
}

// Host bytes come from the peer straight into the new segments: the
// transport's helpers map them writable and UCX receives into them (one
// copy). Each segment is released once its ranges are in (the helpers
// unmap it) and then reported filled, which seals it (refused while any
// process still maps it writable) before the loader hashes it
// (server/load/source_fill.h). Segments go in plan order, `lanes + 1` at a
// time, so the lanes stay busy across the end of a segment.
class PullSource final : public HostSource {
 public:
  PullSource(PeerPull& pull, PeerOffer offer, uint32_t lanes) : pull_(pull), offer_(std::move(offer)), lanes_(lanes) {}

  absl::Status Fill(const std::vector<HostSegment*>& segments, const std::vector<std::vector<Range>>& ranges,
                    const std::function<absl::Status(uint32_t)>& filled) override {
    PeerConnectOptions options;
    options.lanes = lanes_;
    for (HostSegment* s : segments) {
      options.destinations.push_back({s->fd(), s->size()});
      options.advise_huge_pages |= s->page_kind() == PageKind::kShmemThp;
    }
    absl::StatusOr<std::unique_ptr<PeerConnection>> connection =
        pull_.transport().Connect(offer_, pull_.deadline(), options);
    if (!connection.ok()) return WithPeerReason(connection.status(), "transfer_failed");
    pull_.set_lanes_used((*connection)->lanes());
    absl::Status status = ParallelFor(
        segments.size(),
        [&](size_t i) -> absl::Status {
          std::vector<PeerRead> reads;
          uint64_t bytes = 0;
          for (const Range& r : ranges[i]) {
            if (r.n == 0) continue;
            reads.push_back({static_cast<uint32_t>(i), r.offset, r.n, static_cast<uint32_t>(i), r.offset});
            bytes += r.n;
          }
          WEIGHTD_RETURN_IF_ERROR((*connection)->Read(reads, pull_.deadline()));
          pull_.Received(bytes);
          WEIGHTD_RETURN_IF_ERROR((*connection)->Release(static_cast<uint32_t>(i), pull_.deadline()));
          absl::Status sealed = filled(static_cast<uint32_t>(i));
          return sealed.ok() ? sealed : WithPeerReason(sealed, "seal_refused");
        },
        lanes_ + 1);
    connection->reset();  // every helper is gone (reaped) before this returns
    return status;
  }

 private:
  PeerPull& pull_;
  const PeerOffer offer_;
  const uint32_t lanes_;
};

absl::Status Verify(const ModelGeneration& gen, const v1::PeerTransferReply& reply) {
  const std::vector<TensorRecord>& tensors = gen.ranks[0].tensors;
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint64_t theirs = reply.tensors(static_cast<int>(i)).content_hash();
    if (tensors[i].content_hash != theirs) {
      return absl::DataLossError(absl::StrCat("tensor ", QuoteName(tensors[i].name), ": the bytes received hash to ",
                                              ContentHashHex(tensors[i].content_hash), ", the seed's hash is ",
                                              ContentHashHex(theirs)));
    }
  }
  if (gen.fingerprint != reply.fingerprint()) {
    return absl::DataLossError(absl::StrCat("fingerprint ", gen.fingerprint, " differs from the seed's ",
                                            QuoteName(reply.fingerprint())));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WithPeerReason(absl::Status status, absl::string_view reason) {
  status.SetPayload(kReasonPayload, absl::Cord(reason));
  return status;
}

std::string PeerReasonOf(const absl::Status& status) {
  if (auto reason = status.GetPayload(kReasonPayload)) return std::string(*reason);
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded: return "deadline";
    case absl::StatusCode::kUnavailable: return "transfer_failed";
    case absl::StatusCode::kDataLoss: return "hash_mismatch";
    default: return "other";
  }
}

uint32_t ChoosePeerLanes(uint64_t host_bytes, uint32_t configured, unsigned cores) {
  if (configured > 0) return std::min(configured, kMaxPeerLanes);
  uint64_t by_size = std::max<uint64_t>(1, host_bytes / kPeerBytesPerLane);
  uint64_t by_cores = std::max(1u, cores);
  return static_cast<uint32_t>(std::min<uint64_t>({by_size, by_cores, kMaxAutoPeerLanes}));
}

absl::StatusOr<PeerOffer> OfferOf(const v1::PeerTransferReply& reply) {
  if (static_cast<uint32_t>(reply.more_senders_size()) >= kMaxPeerLanes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the peer offers ", 1 + reply.more_senders_size(), " senders, at most ", kMaxPeerLanes));
  }
  PeerOffer offer{reply.worker_address(), reply.session_token(), {}, {}};
  for (const v1::PeerSegment& s : reply.host_segments()) offer.region_sizes.push_back(s.size());
  for (const v1::PeerSender& s : reply.more_senders()) offer.more_senders.push_back({s.worker_address(), s.session_token()});
  return offer;
}

absl::Status CheckSameCheckpoint(const v1::PeerTransferReply& reply, const Catalog& catalog, const LoadPlan& plan) {
  WEIGHTD_RETURN_IF_ERROR(CheckFiles(reply, catalog));
  if (static_cast<size_t>(reply.tensors_size()) != catalog.tensors.size()) {
    return Differs(absl::StrCat(reply.tensors_size(), " tensors there, ", catalog.tensors.size(), " here"));
  }
  for (size_t i = 0; i < catalog.tensors.size(); ++i) {
    WEIGHTD_RETURN_IF_ERROR(CheckTensor(reply.tensors(static_cast<int>(i)), catalog.tensors[i], plan.tensors[i]));
  }
  if (static_cast<size_t>(reply.host_segments_size()) != plan.host_segments.size()) {
    return Differs(absl::StrCat(reply.host_segments_size(), " host segments there, ", plan.host_segments.size(),
                                " here"));
  }
  for (size_t i = 0; i < plan.host_segments.size(); ++i) {
    const v1::PeerSegment& s = reply.host_segments(static_cast<int>(i));
    if (s.file() != plan.host_segments[i].file || s.size() < plan.host_segments[i].bytes) {
      return Differs(absl::StrCat("host segment ", i, " holds file ", s.file(), " in ", s.size(), " bytes there, file ",
                                  plan.host_segments[i].file, " in ", plan.host_segments[i].bytes, " bytes here"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ModelGeneration>> SeedFromDescription(const v1::PeerTransferReply& reply,
                                                                     const Catalog& catalog,
                                                                     const LoadRequest& request,
                                                                     const PlannedLoad& planned,
                                                                     const LoaderOptions& loader,
                                                                     const ProgressFn& progress, PeerPull& pull) {
  const LoadPlan& plan = planned.plan;
  if (reply.transport() != pull.transport().name()) {
    return WithPeerReason(absl::FailedPreconditionError(absl::StrCat("the peer offers transport ",
                                                                     QuoteName(reply.transport()), ", this node has ",
                                                                     pull.transport().name())),
                          "different_checkpoint");
  }
  if (absl::Status same = CheckSameCheckpoint(reply, catalog, plan); !same.ok()) {
    return WithPeerReason(same, "different_checkpoint");
  }
  absl::StatusOr<PeerOffer> offer = OfferOf(reply);
  if (!offer.ok()) return WithPeerReason(offer.status(), "other");
  PullSource source(pull, *std::move(offer), ChoosePeerLanes(plan.host_bytes, pull.lanes()));
  LoaderOptions options = loader;
  options.host_source = &source;
  options.source_hashing = pull.hashing();
  absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = LoadGeneration(catalog, request, options, progress, nullptr, &planned);
  if (!gen.ok()) return gen.status();  // its code tells the reason (PeerReasonOf)
  if (absl::Status verified = Verify(**gen, reply); !verified.ok()) return WithPeerReason(verified, "hash_mismatch");
  (*gen)->source = absl::StrCat("peer ", pull.peer());
  (*gen)->bytes_read = DeviceBytes(catalog, plan);
  return gen;
}

}  // namespace weightd
