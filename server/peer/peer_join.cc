#include "server/peer/peer_join.h"

#include <grpcpp/grpcpp.h>
#include <netdb.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/transport/tcp_address.h"
#include "server/peer/peer_seeding.h"
#include "weightd/v1/peer.grpc.pb.h"

namespace weightd {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// "HOST:PORT" -> every address it resolves to, "IP:PORT" ("[IPv6]:PORT"),
// in resolver order without repeats: a Kubernetes headless Service name
// stands for every weightd pod. A name that does not resolve stays as it
// is (the call to it then fails and counts as "unavailable").
std::vector<std::string> Expand(const std::string& peer) {
  absl::StatusOr<AddrInfoPtr> resolved = ResolveTcpAddress(peer, 0);
  if (!resolved.ok()) return {peer};
  std::vector<std::string> out;
  for (const addrinfo* a = resolved->get(); a != nullptr; a = a->ai_next) {
    char host[NI_MAXHOST], port[NI_MAXSERV];
    if (getnameinfo(a->ai_addr, a->ai_addrlen, host, sizeof host, port, sizeof port,
                    NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
      continue;
    }
    std::string one = a->ai_family == AF_INET6 ? absl::StrCat("[", host, "]:", port) : absl::StrCat(host, ":", port);
    if (std::find(out.begin(), out.end(), one) == out.end()) out.push_back(one);
  }
  if (out.empty()) out.push_back(peer);
  return out;
}

absl::Status FromGrpc(const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), CapMessage(s.error_message()));
}

}  // namespace

absl::Status ValidatePeerList(const std::vector<std::string>& peers, const std::string& what) {
  if (peers.size() > kMaxPeers) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", peers.size(), " peers, at most ", kMaxPeers));
  }
  for (const std::string& p : peers) {
    size_t colon = p.rfind(':');
    uint32_t port = 0;
    if (p.size() > kMaxPeerAddressBytes || colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(p.substr(colon + 1), &port) || port == 0 || port > 65535) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", QuoteName(p), " is not HOST:PORT (at most ",
                                                     kMaxPeerAddressBytes, " bytes, port 1..65535)"));
    }
  }
  return absl::OkStatus();
}

std::string PeerFallbackReason(const absl::Status& status) { return PeerReasonOf(status); }

std::vector<std::string> PeerJoiner::PeersFor(const LoadRequest& request) const {
  std::vector<std::string> out;
  for (const auto* list : {&request.peers, &options_.peers}) {
    for (const std::string& name : *list) {
      for (const std::string& p : Expand(name)) {
        if (out.size() < kMaxPeers && std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
      }
    }
  }
  return out;
}

absl::StatusOr<std::unique_ptr<ModelGeneration>> PeerJoiner::Load(const Catalog& catalog, const LoadRequest& request,
                                                                   const LoaderOptions& loader,
                                                                   const ProgressFn& progress) {
  const std::vector<std::string> peers = PeersFor(request);
  if (peers.empty()) return absl::NotFoundError("no peers");
  absl::StatusOr<PlannedLoad> planned = PlanLoad(catalog, request, loader);
  if (!planned.ok()) {
    if (options_.metrics) options_.metrics->PeerFallback("other");
    LogWarning(absl::StrCat("cannot seed '", request.name, "' from peers: ", planned.status().message(),
                            "; reading storage"));
    return planned.status();
  }
  absl::Status last = absl::NotFoundError("no peers");
  for (const std::string& peer : peers) {
    auto start = std::chrono::steady_clock::now();
    uint32_t lanes = 0;
    absl::StatusOr<std::unique_ptr<ModelGeneration>> gen =
        LoadFrom(peer, catalog, request, *planned, loader, progress, &lanes);
    if (gen.ok()) {
      double seconds = SecondsSince(start);
      uint64_t bytes = (*gen)->host_bytes;
      if (options_.metrics) options_.metrics->PeerSeeded(peer, bytes, seconds);
      LogInfo(absl::StrFormat("seeded '%s' from peer %s: %d host bytes in %.3f s (%.2f GB/s) over %d lane(s), "
                              "received into the segments, %d MiB on 2 MiB pages, hashed %s, fingerprint %s",
                              request.name, peer, bytes, seconds, seconds > 0 ? bytes / seconds / 1e9 : 0.0,
                              lanes, (*gen)->huge_page_bytes >> 20,
                              options_.hashing == SourceHashing::kPerTransfer ? "per transfer" : "per segment",
                              (*gen)->fingerprint));
      return gen;
    }
    std::string reason = PeerFallbackReason(gen.status());
    if (options_.metrics) options_.metrics->PeerFallback(reason);
    if (reason == "local") {
      LogWarning(absl::StrCat("cannot seed '", request.name, "' from peers: ", gen.status().message(),
                              "; reading storage"));
      return gen.status();
    }
    LogWarning(absl::StrCat("peer ", peer, " did not seed '", request.name, "' (", reason, "): ",
                            gen.status().message(), "; trying the next peer or storage"));
    last = gen.status();
  }
  return last;
}

absl::StatusOr<std::unique_ptr<ModelGeneration>> PeerJoiner::LoadFrom(const std::string& peer, const Catalog& catalog,
                                                                       const LoadRequest& request,
                                                                       const PlannedLoad& planned,
                                                                       const LoaderOptions& loader,
                                                                       const ProgressFn& progress,
                                                                       uint32_t* lanes) {
  auto deadline = std::chrono::steady_clock::now() + options_.deadline;
  absl::StatusOr<PeerTransport*> transport = options_.transport ? options_.transport()
                                                                : absl::UnavailableError("no peer transport");
  if (!transport.ok()) {
    return WithPeerReason(Annotate(transport.status(), "this node's peer transport cannot start"), "local");
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxPeerReplyBytes);
  if (!options_.tls_server_name.empty()) args.SetSslTargetNameOverride(options_.tls_server_name);
  std::shared_ptr<grpc::Channel> channel = grpc::CreateCustomChannel(
      peer, options_.credentials ? options_.credentials : grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + kPeerConnectTimeout)) {
    return WithPeerReason(
        absl::UnavailableError(absl::StrCat(
            "no connection within ", kPeerConnectTimeout.count(), " s",
            options_.credentials ? " (mutual TLS: check that its certificate and this node's are signed by "
                                   "--peer-tls-ca, carry serverAuth and clientAuth, and name the address dialled "
                                   "or --peer-tls-server-name)"
                                 : "")),
        "unavailable");
  }
  std::unique_ptr<v1::Peer::Stub> stub = v1::Peer::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options_.deadline);
  std::unique_ptr<grpc::ClientReaderWriter<v1::PeerTransferRequest, v1::PeerTransferReply>> stream =
      stub->Transfer(&context);
  v1::PeerTransferRequest ask;
  ask.set_name(request.name);
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  ask.set_joiner(std::string(host).substr(0, 64));
  ask.set_lanes(ChoosePeerLanes(planned.plan.host_bytes, options_.lanes));  // the seed starts a sender per lane
  v1::PeerTransferReply reply;
  if (!stream->Write(ask) || !stream->Read(&reply)) {
    absl::Status st = FromGrpc(stream->Finish());
    if (st.ok()) st = absl::UnavailableError("the peer ended the call without describing a generation");
    std::string reason = st.code() == absl::StatusCode::kNotFound || st.code() == absl::StatusCode::kFailedPrecondition
                             ? "not_served"
                             : st.code() == absl::StatusCode::kUnavailable ? "unavailable"
                             : st.code() == absl::StatusCode::kDeadlineExceeded ? "deadline" : "other";
    return WithPeerReason(st, reason);
  }
  PeerPull pull{peer, **transport, deadline, options_.metrics, options_.lanes};
  pull.set_hashing(options_.hashing);
  absl::StatusOr<std::unique_ptr<ModelGeneration>> gen =
      SeedFromDescription(reply, catalog, request, planned, loader, progress, pull);
  *lanes = pull.lanes_used();
  v1::PeerTransferRequest done;
  done.set_done(true);
  done.set_bytes_read(pull.bytes_read());
  done.set_verified(gen.ok());
  stream->Write(done);
  stream->WritesDone();
  (void)stream->Finish();  // the transfer's own result decides
  return gen;
}

}  // namespace weightd
