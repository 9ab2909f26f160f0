#include "server/peer_seed.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace weightd {

PeerSeed::PeerSeed(ModelRegistry* registry, PeerTransport* transport, PeerSeedOptions options, Metrics* metrics)
    : registry_(registry), transport_(transport), options_(std::move(options)), metrics_(metrics) {}

absl::StatusOr<std::unique_ptr<PeerSeed::Session>> PeerSeed::Open(const std::string& name, const std::string& joiner) {
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
  for (size_t i = 0; i < m.host_segments.size(); ++i) {
    const HostSegment& segment = *m.host_segments[i];
    const char* base = segment.data();
    if (i == 0 && options_.test_fault == "corrupt" && segment.size() > 0) {
      session->corrupt_copy_.reset(new char[segment.size()]);
      std::memcpy(session->corrupt_copy_.get(), base, segment.size());
      session->corrupt_copy_[segment.size() / 2] ^= 0x5a;
      base = session->corrupt_copy_.get();
    }
    WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<PeerRegion> region, transport_->Register(base, segment.size()));
    session->remote_.push_back(region->Describe());
    session->regions_.push_back(std::move(region));
  }
  if (options_.test_fault == "stall") transport_->StallForTest();
  LogInfo(absl::StrCat("peer ", joiner, " opened a transfer of '", name, "' generation ", m.generation, " (",
                       m.host_bytes, " host bytes)"));
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
  for (size_t i = 0; i < session.regions().size(); ++i) {
    const RemoteRegion& r = session.regions()[i];
    v1::PeerSegment* s = reply->add_host_segments();
    s->set_size(r.size);
    s->set_file(segment_file[i]);
    s->set_address(r.address);
    s->set_remote_key(r.key);
  }
  reply->set_transport(transport_->name());
  reply->set_worker_address(transport_->worker_address());
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

void PeerSeed::ReleaseRetired() {
  std::vector<std::shared_ptr<ModelGeneration>> due;  // freed after the lock
  absl::MutexLock lock(&mu_);
  auto now = std::chrono::steady_clock::now();
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (it->first <= now) {
      due.push_back(std::move(it->second));
      it = retired_.erase(it);
    } else {
      ++it;
    }
  }
}

int PeerSeed::joiners() const {
  absl::MutexLock lock(&mu_);
  return joiners_;
}

void PeerSeed::Closed(std::shared_ptr<ModelGeneration> model) {
  absl::MutexLock lock(&mu_);
  if (model != nullptr) retired_.emplace_back(std::chrono::steady_clock::now() + kRetireGrace, std::move(model));
  --joiners_;
  if (metrics_) metrics_->PeerJoiners(joiners_);
}

void PeerSeed::Session::Finished(uint64_t bytes_read, bool verified) {
  if (seed_->metrics_) seed_->metrics_->PeerBytesSent(seed_->JoinerLabel(joiner_), bytes_read);
  LogInfo(absl::StrCat("peer ", joiner_, " finished reading '", model_->request.name, "' generation ",
                       model_->generation, ": ", bytes_read, " bytes, ", verified ? "verified" : "NOT verified"));
}

PeerSeed::Session::~Session() {
  regions_.clear();  // deregistered before the lease lets the memory go
  if (!lease_id_.empty()) seed_->registry_->Release(lease_id_);
  seed_->Closed(std::move(model_));
}

}  // namespace weightd
