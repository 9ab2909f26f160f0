#include "server/listen/fd_channel.h"

#include "absl/strings/match.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/base/log.h"
#include "common/base/status.h"
#include "common/transport/fd_channel_codec.h"

namespace weightd {
namespace {

// "OK <n>" with the first fds, then "MORE"s: one fd per segment of the rank
// that is exported by fd, in segment order.
bool SendFds(int sock, const std::vector<int>& fds) {
  size_t sent = std::min(fds.size(), kMaxFdsPerMessage);
  if (!SendMessage(sock, EncodeOk(fds.size()), {fds.begin(), fds.begin() + sent}).ok()) return false;
  while (sent < fds.size()) {
    size_t n = std::min(fds.size() - sent, kMaxFdsPerMessage);
    if (!SendMessage(sock, EncodeMore(), {fds.begin() + sent, fds.begin() + sent + n}).ok()) return false;
    sent += n;
  }
  return true;
}

bool SendSegmentFds(int sock, const ModelRegistry::Grant& grant) {
  std::vector<int> fds;
  if (grant.layout != nullptr) {  // a lease on a runtime layout maps its segments
    for (const SegmentRecord& segment : grant.layout->segments) {
      if (segment.exports_fd()) fds.push_back(segment.fd);
    }
    return SendFds(sock, fds);
  }
  for (uint32_t id : grant.model->SegmentsOf(grant.rank, grant.numa_copy)) {
    const SegmentRecord& segment = grant.model->segments[id];
    if (segment.exports_fd()) fds.push_back(segment.fd);
  }
  return SendFds(sock, fds);
}

}  // namespace

struct FdChannel::Connection {
  ScopedFd sock;
  std::string lease_id;   // empty until claimed
  std::string update_id;  // a writer's claimed update instead: the connection is its lease
  std::string layout_writer_id;  // a layout writer's claim instead: the connection is its lease
  bool refused = false;  // ERR sent and writing shut down: drained until the deadline
  std::chrono::steady_clock::time_point deadline;
};

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::Start(FdChannelOptions options, ModelRegistry* registry) {
  WEIGHTD_ASSIGN_OR_RETURN(ScopedFd listener, ListenSeqpacket(options.path, options.mode));
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) return ErrnoToStatus("pipe2", errno);
  std::unique_ptr<FdChannel> channel(new FdChannel(std::move(options), registry, std::move(listener),
                                                   ScopedFd(pipe_fds[0]), ScopedFd(pipe_fds[1])));
  channel->thread_ = std::thread([c = channel.get()] { c->Loop(); });
  return channel;
}

FdChannel::FdChannel(FdChannelOptions options, ModelRegistry* registry, ScopedFd listener, ScopedFd wake_read,
                     ScopedFd wake_write)
    : options_(std::move(options)),
      registry_(registry),
      listener_(std::move(listener)),
      wake_read_(std::move(wake_read)),
      wake_write_(std::move(wake_write)) {}

FdChannel::~FdChannel() {
  char byte = 1;
  (void)!write(wake_write_.get(), &byte, 1);
  if (thread_.joinable()) thread_.join();
  for (auto& c : connections_) {
    if (!c->lease_id.empty()) registry_->Release(c->lease_id);
    if (!c->update_id.empty()) (void)registry_->AbortUpdate(c->update_id, "writer_disconnected");
    if (!c->layout_writer_id.empty()) (void)registry_->AbortLayout(c->layout_writer_id, "writer_disconnected");
  }
  unlink(options_.path.c_str());
}

void FdChannel::Loop() {
  while (true) {
    std::vector<pollfd> fds = {{wake_read_.get(), POLLIN, 0}, {listener_.get(), POLLIN, 0}};
    for (auto& c : connections_) fds.push_back({c->sock.get(), POLLIN, 0});
    int ready = poll(fds.data(), fds.size(), 100);
    if (ready < 0 && errno != EINTR) return;
    if (fds[0].revents) return;
    if (fds[1].revents & POLLIN) Accept();
    auto now = std::chrono::steady_clock::now();
    std::vector<std::unique_ptr<Connection>> keep;
    for (size_t i = 0; i < connections_.size(); ++i) {
      Connection& c = *connections_[i];
      short revents = i + 2 < fds.size() ? fds[i + 2].revents : 0;
      bool alive = true;
      if (revents & (POLLIN | POLLHUP | POLLERR)) {
        alive = Serve(c);
      } else if (!c.update_id.empty()) {
        alive = registry_->IsUpdateOpen(c.update_id);  // committed or aborted: the writer sees EOF
      } else if (!c.layout_writer_id.empty()) {
        alive = registry_->IsLayoutWriterOpen(c.layout_writer_id);
      } else if (c.lease_id.empty()) {
        alive = now < c.deadline;  // never claimed (or refused): give up after the deadline
      } else {
        alive = registry_->IsLeaseLive(c.lease_id);  // revoked by a forced unload or Detach
      }
      if (!alive) {
        if (!c.lease_id.empty()) registry_->Release(c.lease_id);
        // A writer gone before committing: its update ends (NOT_FOUND once committed; ignored).
        if (!c.update_id.empty()) (void)registry_->AbortUpdate(c.update_id, "writer_disconnected");
        if (!c.layout_writer_id.empty()) (void)registry_->AbortLayout(c.layout_writer_id, "writer_disconnected");
        continue;
      }
      keep.push_back(std::move(connections_[i]));
    }
    connections_ = std::move(keep);
    registry_->ExpirePending();
  }
}

void FdChannel::Accept() {
  int fd = accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
  if (fd < 0) {
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
      // The listener stays readable: back off instead of spinning until fds free up.
      if (!warned_fd_limit_) LogWarning(absl::StrCat("fd socket: accept: ", strerror(errno), "; backing off"));
      warned_fd_limit_ = true;
      usleep(50 * 1000);
    }
    return;
  }
  ScopedFd sock(fd);
  // Refuse early: a peer that may not claim, or one too many, holds no slot.
  std::string why;
  if (!PeerAllowed(sock.get(), &why)) return Refuse(std::move(sock), absl::StatusCode::kPermissionDenied, why);
  if (CountConnections(false) >= options_.max_connections) {
    return Refuse(std::move(sock), absl::StatusCode::kResourceExhausted,
                  absl::StrCat("too many fd-socket connections (", options_.max_connections, ")"));
  }
  auto c = std::make_unique<Connection>();
  c->sock = std::move(sock);
  c->deadline = std::chrono::steady_clock::now() + registry_->claim_timeout();
  connections_.push_back(std::move(c));
}

// Closing a Unix socket whose receive queue holds the client's unread CLAIM
// resets the connection: the client would see ECONNRESET (or EPIPE) instead
// of the ERR line. So the refused socket stays in the poll set, write side
// shut, until the client closes or kRefusalDrain passes.
void FdChannel::Refuse(ScopedFd sock, absl::StatusCode code, const std::string& why) {
  (void)SendMessage(sock.get(), EncodeErr(absl::Status(code, why)), {});
  shutdown(sock.get(), SHUT_WR);
  if (CountConnections(true) >= kMaxRefused) return;  // a flood of refusals holds no more fds
  auto c = std::make_unique<Connection>();
  c->sock = std::move(sock);
  c->refused = true;
  c->deadline = std::chrono::steady_clock::now() + kRefusalDrain;
  connections_.push_back(std::move(c));
}

size_t FdChannel::CountConnections(bool refused) const {
  return std::count_if(connections_.begin(), connections_.end(), [&](const auto& c) { return c->refused == refused; });
}

bool FdChannel::PeerAllowed(int sock, std::string* why) const {
  absl::StatusOr<PeerCredentials> peer = GetPeerCredentials(sock);
  if (!peer.ok()) {
    *why = std::string(peer.status().message());
    return false;
  }
  if (peer->uid == getuid() || peer->uid == 0 || peer->gid == getgid()) return true;
  if (std::find(options_.allowed_gids.begin(), options_.allowed_gids.end(), peer->gid) != options_.allowed_gids.end()) {
    return true;
  }
  *why = absl::StrCat("peer uid ", peer->uid, " gid ", peer->gid, " (pid ", peer->pid,
                      ") is neither the daemon's uid or gid nor in the allowed gids");
  return false;
}

bool FdChannel::Serve(Connection& c) {
  absl::StatusOr<std::string> message = ReceiveMessage(c.sock.get(), nullptr, 0);
  if (!message.ok()) return false;  // EOF or error: the lease (if any) ends
  if (c.refused) return true;            // drained; closed at EOF or the deadline
  if (!c.lease_id.empty() || !c.update_id.empty() || !c.layout_writer_id.empty()) {
    return true;  // clients send nothing after CLAIM; ignore
  }
  auto refuse = [&](const absl::Status& error) {
    (void)SendMessage(c.sock.get(), EncodeErr(error), {});
    return false;
  };
  absl::StatusOr<FdChannelMessage> claim = ParseFdChannelMessage(*message);
  if (!claim.ok() || claim->kind != FdChannelMessage::Kind::kClaim) {
    return refuse(absl::InvalidArgumentError("expected 'CLAIM <lease_id>'"));
  }
  if (absl::StartsWith(claim->lease_id, kUpdateIdPrefix)) {
    // A writer's update (BeginUpdate) is claimed the same way as a lease.
    absl::StatusOr<std::shared_ptr<const StagedUpdate>> update = registry_->ClaimUpdate(claim->lease_id);
    if (!update.ok()) return refuse(update.status());
    c.update_id = claim->lease_id;
    std::vector<int> fds;
    for (const StagedSegment& s : (*update)->segments) fds.push_back(s.memory->fd());
    return SendFds(c.sock.get(), fds);
  }
  if (absl::StartsWith(claim->lease_id, kLayoutWriterIdPrefix)) {
    // A layout writer (BeginLayout) likewise.
    absl::StatusOr<std::shared_ptr<const StagedLayout>> staged = registry_->ClaimLayoutWriter(claim->lease_id);
    if (!staged.ok()) return refuse(staged.status());
    c.layout_writer_id = claim->lease_id;
    std::vector<int> fds;
    for (const StagedLayoutSegment& s : (*staged)->segments) fds.push_back(s.memory->fd());
    return SendFds(c.sock.get(), fds);
  }
  absl::StatusOr<ModelRegistry::Grant> grant = registry_->Claim(claim->lease_id);
  if (!grant.ok()) return refuse(grant.status());
  c.lease_id = grant->lease_id;
  return SendSegmentFds(c.sock.get(), *grant);
}

}  // namespace weightd
