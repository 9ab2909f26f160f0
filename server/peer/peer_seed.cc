#include "server/peer/peer_seed.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace weightd {
namespace {

// Test fault "corrupt": a memfd holding `segment` with its middle byte flipped.
absl::StatusOr<ScopedFd> CorruptCopy(const HostSegment& segment) {
  ScopedFd fd(static_cast<int>(memfd_create("wd-peer-corrupt", MFD_CLOEXEC)));
  if (!fd.valid()) return ErrnoToStatus("memfd_create", errno);
  std::string bytes(segment.data(), segment.size());
  bytes[bytes.size() / 2] ^= 0x5a;
  if (pwrite(fd.get(), bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size())) {
    return ErrnoToStatus("pwrite", errno);
  }
  return fd;
}

}  // namespace

PeerSeed::PeerSeed(ModelRegistry* registry, PeerTransport* transport, PeerSeedOptions options, Metrics* metrics)
    : registry_(registry), transport_(transport), options_(std::move(options)), metrics_(metrics) {}

absl::StatusOr<std::unique_ptr<PeerSeed::Session>> PeerSeed::Open(const std::string& name, const std::string& joiner,
                                                                   uint32_t lanes) {
  if (lanes > kMaxPeerLanes) {
    return absl::InvalidArgumentError(
        absl::StrCat("the joiner asks for ", lanes, " lanes, at most ", kMaxPeerLanes, " (--peer-lanes)"));
  }
  {
    absl::MutexLock lock(&mu_);
    if (joiners_ >= options_.max_joiners) {
      return absl::UnavailableError(absl::StrCat("this seed already serves ", joiners_,
                                                 " joiner(s), its limit (--peer-max-joiners); try another peer"));
    }
    ++joiners_;
    if (metrics_) metrics_->PeerJoiners(joiners_);
  }
  std::unique_ptr<Session> session(new Session());
  session->seed_ = this;  // from here on, its destructor gives the slot back
  session->joiner_ = joiner;
  WEIGHTD_ASSIGN_OR_RETURN(ModelRegistry::Grant grant, registry_->Attach(name, 0));
  session->lease_id_ = grant.lease_id;
  session->model_ = grant.model;
  WEIGHTD_RETURN_IF_ERROR(registry_->Claim(grant.lease_id).status());  // a peer's lease never waits on the fd socket
  const ModelGeneration& m = *grant.model;
  std::vector<PeerExportRegion> regions;
  // The manifest's host segments, which come first in every rank's list;
  // not the other NUMA copies (ModelGeneration::numa_copies) of them.
  for (size_t i = 0; i < m.ranks[0].segments.size(); ++i) {
    const SegmentRecord& record = m.segments[m.ranks[0].segments[i]];
    if (record.placement != Placement::kHost) break;
    const HostSegment& segment = *m.host_segments[record.owner];
    regions.push_back({segment.fd(), segment.size()});
    if (i == 0 && options_.test_fault == "corrupt" && segment.size() > 0) {
      WEIGHTD_ASSIGN_OR_RETURN(session->corrupt_copy_, CorruptCopy(segment));
      regions.back().fd = session->corrupt_copy_.get();
    }
  }
  PeerExportOptions export_options;
  export_options.stall_for_test = options_.test_fault == "stall";
  export_options.senders = std::max(lanes, 1u);
  WEIGHTD_ASSIGN_OR_RETURN(session->export_, transport_->Export(regions, export_options));
  LogInfo(absl::StrCat("peer ", joiner, " opened a transfer of '", name, "' generation ", m.generation, " (",
                       m.host_bytes, " host bytes) over ", export_options.senders, " lane(s), served by ",
                       session->export_->offer().senders(), " sender(s)"));
  return session;
}

void PeerSeed::Describe(const Session& session, v1::PeerTransferReply* reply) const {
  const ModelGeneration& m = session.model();
  reply->set_model(m.request.name);
  reply->set_generation(m.generation);
  reply->set_fingerprint(m.fingerprint);
  std::vector<uint32_t> segment_file(m.host_segments.size());
  for (size_t f = 0; f < m.files.size(); ++f) {
    v1::PeerFile* file = reply->add_files();
    file->set_name(m.files[f].stamp.name);
    file->set_size(m.files[f].stamp.identity.size);
    file->set_header_hash(m.files[f].stamp.header_hash);
    for (uint32_t id : m.files[f].host_segments) {
      if (id < segment_file.size()) segment_file[id] = static_cast<uint32_t>(f);
    }
  }
  for (const TensorRecord& t : m.ranks[0].tensors) {
    v1::PeerTensor* out = reply->add_tensors();
    out->set_name(t.name);
    out->set_dtype(std::string(DTypeName(t.dtype)));
    for (uint64_t d : t.full_shape) out->add_shape(d);
    out->set_content_hash(t.content_hash);
    out->set_host(t.placement == Placement::kHost);
    if (t.placement == Placement::kHost) {
      out->set_nbytes(t.nbytes);
      out->set_host_segment(t.segment);  // host segments come first in every rank's list
      out->set_host_offset(t.offset);
    }
  }
  const PeerOffer& offer = session.offer();
  for (size_t i = 0; i < offer.region_sizes.size(); ++i) {
    v1::PeerSegment* s = reply->add_host_segments();
    s->set_size(offer.region_sizes[i]);
    s->set_file(segment_file[i]);
  }
  reply->set_transport(transport_->name());
  reply->set_worker_address(offer.worker_address);
  reply->set_session_token(offer.token);
  for (const PeerSender& sender : offer.more_senders) {
    v1::PeerSender* out = reply->add_more_senders();
    out->set_worker_address(sender.worker_address);
    out->set_session_token(sender.token);
  }
  reply->set_session_seconds(std::chrono::duration<double>(options_.session_limit).count());
}

std::string PeerSeed::JoinerLabel(const std::string& joiner) {
  absl::MutexLock lock(&mu_);
  if (labels_.count(joiner) || labels_.size() < kMaxJoinerLabels) {
    labels_.insert(joiner);
    return joiner;
  }
  return "other";
}

int PeerSeed::joiners() const {
  absl::MutexLock lock(&mu_);
  return joiners_;
}

void PeerSeed::Closed() {
  absl::MutexLock lock(&mu_);
  --joiners_;
  if (metrics_) metrics_->PeerJoiners(joiners_);
}

void PeerSeed::Session::Finished(uint64_t bytes_read, bool verified) {
  report_ = Report{bytes_read, verified};
}

PeerSeed::Session::~Session() {
  if (export_ != nullptr) {
    // What this seed sent, as its transport counted it; the joiner's report
    // arrived over an unauthenticated stream and is logged as its claim.
    absl::StatusOr<std::vector<uint64_t>> by_sender =
        export_->BytesSent(std::chrono::steady_clock::now() + kCountTimeout);
    const uint64_t sent = by_sender.ok() ? std::accumulate(by_sender->begin(), by_sender->end(), uint64_t{0}) : 0;
    if (by_sender.ok() && seed_->metrics_) seed_->metrics_->PeerBytesSent(seed_->JoinerLabel(joiner_), sent);
    std::string claim = report_.has_value()
                            ? absl::StrCat("; the joiner reports it read ", report_->bytes_read, " bytes, ",
                                           report_->verified ? "verified" : "NOT verified", " (its claim)")
                            : "; the joiner sent no report";
    LogInfo(absl::StrCat("peer ", joiner_, " ended its transfer of '", model_->request.name, "' generation ",
                         model_->generation, ": this seed sent ",
                         by_sender.ok()
                             ? absl::StrCat(sent, " bytes (by sender: ", absl::StrJoin(*by_sender, " + "), ")")
                             : absl::StrCat("an unknown count of bytes (", by_sender.status().message(), ")"),
                         claim));
  }
  export_.reset();  // nothing more is sent once this returns
  if (!lease_id_.empty()) seed_->registry_->Release(lease_id_);
  model_.reset();
  seed_->Closed();
}

}  // namespace weightd
