// The UCX PeerTransport as weightd sees it: every export and every
// connection is a weightd-peer-helper process (helper_protocol.h says why),
// started from the executable's descriptor opened once, and spoken to over
// a SOCK_SEQPACKET control socket. weightd itself links no UCX.
//
// Joiner side: each lane's helper maps the destinations (the new
// generation's segments) writable and UCX receives into them: weightd
// copies nothing. Nothing here trusts those bytes: the caller seals
// each destination after Release() (F_SEAL_WRITE fails while any process
// maps it writable) and hashes it after the seal (peer_transport.h).
#include <fcntl.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/base/log.h"
#include "common/base/scoped_fd.h"
#include "common/base/status.h"
#include "common/peer/helper_protocol.h"
#include "common/peer/peer_transport.h"

extern char** environ;

namespace weightd {
namespace {

namespace ph = peer_helper;
using Clock = std::chrono::steady_clock;

int MillisUntil(Clock::time_point deadline) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
}

absl::Time ToAbsl(Clock::time_point deadline) { return absl::Now() + absl::FromChrono(deadline - Clock::now()); }

std::string DescribeWait(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit status ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return "stopped";
}

// One helper process and weightd's end of its control socket.
class Helper {
 public:
  // Starts `binary_fd` with `args`; the control socket becomes its fd 3 and
  // `fds` its fds 4, 5, ... Only UCX_* variables of the environment go along.
  static absl::StatusOr<std::unique_ptr<Helper>> Start(int binary_fd, const std::vector<std::string>& args,
                                                       const std::vector<int>& fds) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return ErrnoToStatus("socketpair", errno);
    ScopedFd ours(sv[0]), theirs(sv[1]);
    // Copies above every target number, so that no dup2 below overwrites a
    // source still to be moved.
    const int count = static_cast<int>(fds.size());
    const int exe_target = ph::kFirstDataFd + count;
    std::vector<int> sources = {theirs.get()};  // in target order: control, data..., executable
    sources.insert(sources.end(), fds.begin(), fds.end());
    sources.push_back(binary_fd);
    std::vector<ScopedFd> copies;
    for (int fd : sources) {
      int copy = fcntl(fd, F_DUPFD_CLOEXEC, exe_target + 1);
      if (copy < 0) {
        return ErrnoToStatus(absl::StrCat("passing ", count, " segment fds to the peer helper (fd numbers up to ",
                                          exe_target + 1 + count, " against RLIMIT_NOFILE)"),
                             errno);
      }
      copies.emplace_back(copy);
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    int err = posix_spawn_file_actions_adddup2(&actions, copies[0].get(), ph::kControlFd);
    for (int i = 0; i < count; ++i) {
      err = err ? err : posix_spawn_file_actions_adddup2(&actions, copies[1 + i].get(), ph::kFirstDataFd + i);
    }
    err = err ? err : posix_spawn_file_actions_adddup2(&actions, copies.back().get(), exe_target);
    err = err ? err : posix_spawn_file_actions_addclosefrom_np(&actions, exe_target + 1);
    if (err != 0) {
      posix_spawn_file_actions_destroy(&actions);
      return ErrnoToStatus("posix_spawn_file_actions for the peer helper", err);
    }
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    posix_spawnattr_setsigmask(&attr, &none);
    posix_spawnattr_setsigdefault(&attr, &all);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      if (absl::StartsWith(*e, "UCX_")) env.emplace_back(*e);
    }
    std::vector<std::string> argv_strings = {"weightd-peer-helper"};
    argv_strings.insert(argv_strings.end(), args.begin(), args.end());
    std::vector<char*> argv, envp;
    for (std::string& a : argv_strings) argv.push_back(a.data());
    argv.push_back(nullptr);
    for (std::string& e : env) envp.push_back(e.data());
    envp.push_back(nullptr);
    // The executable by its descriptor, as the child sees it after the
    // file actions (fexecve without a second open of the path).
    std::string exe = absl::StrCat("/proc/self/fd/", exe_target);
    pid_t pid = -1;
    err = posix_spawn(&pid, exe.c_str(), &actions, &attr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    if (err != 0) return ErrnoToStatus("starting weightd-peer-helper (posix_spawn)", err);
    return std::unique_ptr<Helper>(new Helper(pid, std::move(ours)));
  }

  ~Helper() {
    Stop();
    Reap(absl::Seconds(1));
    absl::MutexLock lock(&pid_mu_);
    if (pid_ > 0) kill(pid_, SIGKILL);
    ReapLocked(absl::InfiniteDuration());
  }

  // Ends the transfer: the helper reads end of file and exits; a blocked
  // Receive returns.
  void Stop() { shutdown(control_.get(), SHUT_RDWR); }
  void Kill() {
    {
      absl::MutexLock lock(&pid_mu_);
      if (pid_ > 0) kill(pid_, SIGKILL);
    }
    Stop();
  }

  // One message, waiting for room in the socket until `deadline`.
  absl::Status Send(const void* head, size_t head_bytes, Clock::time_point deadline, const void* tail = nullptr,
                    size_t tail_bytes = 0) {
    iovec iov[2] = {{const_cast<void*>(head), head_bytes}, {const_cast<void*>(tail), tail_bytes}};
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = tail_bytes > 0 ? 2 : 1;
    while (sendmsg(control_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        return absl::UnavailableError(absl::StrCat("the peer helper is gone (", strerror(errno), ")"));
      }
      pollfd p{control_.get(), POLLOUT, 0};
      if (poll(&p, 1, MillisUntil(deadline)) == 0) {
        return absl::DeadlineExceededError("the peer helper stopped taking requests before the deadline");
      }
    }
    return absl::OkStatus();
  }

  // The next message, waiting until `deadline` (Clock::time_point::max():
  // no limit). An Error message becomes its status; end of file is
  // UNAVAILABLE with how the helper ended.
  absl::StatusOr<std::string> Receive(Clock::time_point deadline) {
    std::string buf(sizeof(ph::Head) + ph::kMaxAddressBytes, '\0');
    for (;;) {
      if (deadline != Clock::time_point::max()) {
        pollfd p{control_.get(), POLLIN, 0};
        int n = poll(&p, 1, MillisUntil(deadline));
        if (n < 0 && errno == EINTR) continue;
        if (n == 0) return absl::DeadlineExceededError("the peer helper did not answer before the deadline");
      }
      ssize_t n = recv(control_.get(), buf.data(), buf.size(), MSG_TRUNC);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Gone();
      if (static_cast<size_t>(n) > buf.size()) return absl::InternalError("the peer helper sent an oversized message");
      buf.resize(static_cast<size_t>(n));
      ph::Kind kind{};
      if (buf.size() >= sizeof kind) std::memcpy(&kind, buf.data(), sizeof kind);
      if (kind == ph::Kind::kError && buf.size() >= sizeof(ph::Head)) {
        return absl::UnavailableError(
            absl::StrCat("peer helper: ", CapMessage(absl::string_view(buf).substr(sizeof(ph::Head)))));
      }
      return buf;
    }
  }

 private:
  Helper(pid_t pid, ScopedFd control) : pid_(pid), control_(std::move(control)) {}

  // UNAVAILABLE: the helper is gone, and how it ended when it did within 1 s.
  absl::Status Gone() {
    Reap(absl::Seconds(1));
    absl::MutexLock lock(&pid_mu_);
    return absl::UnavailableError(absl::StrCat("the peer helper ended (", ended_.empty() ? "still running" : ended_,
                                               ")"));
  }

  void Reap(absl::Duration within) {
    absl::MutexLock lock(&pid_mu_);
    ReapLocked(within);
  }

  // Under pid_mu_, so that no signal is sent to a pid already reaped (and
  // perhaps reused).
  void ReapLocked(absl::Duration within) ABSL_EXCLUSIVE_LOCKS_REQUIRED(pid_mu_) {
    absl::Time until = absl::Now() + within;
    while (pid_ > 0) {
      int status = 0;
      pid_t r = waitpid(pid_, &status, within == absl::InfiniteDuration() ? 0 : WNOHANG);
      if (r == pid_ || (r < 0 && errno == ECHILD)) {
        ended_ = r == pid_ ? DescribeWait(status) : "reaped elsewhere";
        pid_ = -1;
        return;
      }
      if (r < 0 && errno != EINTR) return;
      if (absl::Now() >= until) return;
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  absl::Mutex pid_mu_;
  pid_t pid_ ABSL_GUARDED_BY(pid_mu_);
  ScopedFd control_;
  std::string ended_ ABSL_GUARDED_BY(pid_mu_);
};

// A seed's export: one helper per sender, each mapping the regions
// read-only with its own UCX worker and token, so that every lane of a
// joiner has a sending process (and core) of its own.
class HelperExport final : public PeerExport {
 public:
  HelperExport(std::vector<std::unique_ptr<Helper>> senders, PeerOffer offer)
      : senders_(std::move(senders)), offer_(std::move(offer)) {}
  // Every sender is told to stop before the first is reaped, so their exits
  // overlap: the teardown waits about 1 s at most, not 1 s per sender (a
  // joiner chooses how many, up to kMaxPeerLanes).
  ~HelperExport() override {
    for (auto& sender : senders_) sender->Stop();
    senders_.clear();
  }
  const PeerOffer& offer() const override { return offer_; }

  absl::StatusOr<std::vector<uint64_t>> BytesSent(Clock::time_point deadline) override {
    std::vector<uint64_t> sent;
    for (auto& helper : senders_) {
      ph::Count ask;
      WEIGHTD_RETURN_IF_ERROR(helper->Send(&ask, sizeof ask, deadline));
      WEIGHTD_ASSIGN_OR_RETURN(std::string message, helper->Receive(deadline));
      ph::Count answer;
      if (message.size() != sizeof answer) return absl::InternalError("the peer helper sent a malformed count");
      std::memcpy(&answer, message.data(), sizeof answer);
      if (answer.kind != ph::Kind::kCount) return absl::InternalError("the peer helper sent an unexpected message");
      sent.push_back(answer.bytes);
    }
    return sent;
  }

 private:
  std::vector<std::unique_ptr<Helper>> senders_;  // destroyed: each is reaped (SIGKILL after 1 s)
  PeerOffer offer_;
};

// A joiner's connection: one helper per lane, each with its own UCX worker
// and endpoint to the seed and its own mappings of every destination. One
// lock covers the bookkeeping of all lanes (a few operations per piece of
// megabytes); each lane has a thread that receives its helper's messages.
class HelperConnection final : public PeerConnection {
 public:
  HelperConnection(std::vector<std::unique_ptr<Helper>> lanes, const UcxHelperOptions& options,
                   std::vector<uint64_t> sizes, std::vector<uint64_t> destination_sizes)
      : lanes_(std::move(lanes)), piece_bytes_(options.piece_bytes), pieces_(options.pieces),
        sizes_(std::move(sizes)), destination_sizes_(std::move(destination_sizes)) {
    absl::MutexLock lock(&mu_);
    in_flight_.assign(lanes_.size(), 0);
    released_.assign(destination_sizes_.size(), 0);
    for (size_t l = 0; l < lanes_.size(); ++l) receivers_.emplace_back([this, l] { ReceiveLoop(l); });
  }

  ~HelperConnection() override {
    for (auto& lane : lanes_) lane->Stop();
    for (std::thread& t : receivers_) t.join();
    lanes_.clear();  // each helper is dead (reaped) before this returns
  }

  uint32_t lanes() const override { return static_cast<uint32_t>(lanes_.size()); }

  absl::Status Read(const std::vector<PeerRead>& reads, Clock::time_point deadline) override {
    struct Piece {
      ph::Read msg;
      uint32_t lane = 0;
    };
    std::deque<Piece> todo;
    {
      absl::MutexLock lock(&mu_);
      for (const PeerRead& r : reads) {
        WEIGHTD_RETURN_IF_ERROR(CheckRead(r));
        for (uint64_t at = 0; at < r.n; at += piece_bytes_) {
          Piece p;
          p.msg.destination = r.destination;
          p.msg.region = r.region;
          p.msg.offset = r.offset + at;
          p.msg.n = std::min(piece_bytes_, r.n - at);
          p.msg.at = r.at + at;
          todo.push_back(p);
        }
      }
    }
    std::vector<Piece> flying;
    absl::MutexLock lock(&mu_);
    while (!todo.empty() || !flying.empty()) {
      if (!broken_.ok()) return Abandon(flying);
      std::vector<Piece> asks;
      for (uint32_t lane; !todo.empty() && (lane = FreestLane()) < lanes_.size();) {
        Piece p = todo.front();
        todo.pop_front();
        p.lane = lane;
        p.msg.id = next_id_++;
        ++in_flight_[lane];
        done_.emplace(p.msg.id, Outcome{});
        asks.push_back(p);
        flying.push_back(p);
      }
      if (!asks.empty()) {
        // Outside the lock: a helper that stops reading its socket blocks
        // this call until its deadline, not every other one.
        mu_.Unlock();
        absl::Status sent;
        uint32_t lane = 0;
        for (const Piece& p : asks) {
          lane = p.lane;
          if (sent = lanes_[lane]->Send(&p.msg, sizeof p.msg, deadline); !sent.ok()) break;
        }
        mu_.Lock();
        if (!sent.ok()) {
          Break(sent);
          if (sent.code() == absl::StatusCode::kDeadlineExceeded) lanes_[lane]->Kill();
          return Abandon(flying);
        }
      }
      auto progress = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        if (!broken_.ok()) return true;
        for (const Piece& p : flying) {
          auto it = done_.find(p.msg.id);
          if (it != done_.end() && it->second.done) return true;
        }
        return !todo.empty() && FreestLane() < lanes_.size();
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&progress), ToAbsl(deadline))) {
        Break(absl::DeadlineExceededError("peer reads did not finish before the deadline"));
        for (auto& l : lanes_) l->Kill();
        return Abandon(flying);
      }
      for (size_t i = 0; i < flying.size();) {
        auto it = done_.find(flying[i].msg.id);
        if (it == done_.end() || !it->second.done) {
          ++i;
          continue;
        }
        absl::Status status = it->second.status;
        done_.erase(it);
        if (!status.ok()) {
          Break(status);
          return Abandon(flying);
        }
        flying.erase(flying.begin() + static_cast<ptrdiff_t>(i));
      }
    }
    return broken_;
  }

  absl::Status Release(uint32_t destination, Clock::time_point deadline) override {
    ph::Release ask;
    ask.destination = destination;
    {
      absl::MutexLock lock(&mu_);
      if (!broken_.ok()) return broken_;
      if (destination >= destination_sizes_.size() || released_[destination] != 0) {
        return absl::InvalidArgumentError(absl::StrCat("destination ", destination, " is unknown or released"));
      }
      released_[destination] = kAsked;
    }
    for (auto& lane : lanes_) {
      absl::Status sent = lane->Send(&ask, sizeof ask, deadline);
      if (!sent.ok()) {
        absl::MutexLock lock(&mu_);
        Break(sent);
        return broken_;
      }
    }
    absl::MutexLock lock(&mu_);
    auto answered = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !broken_.ok() || released_[destination] == kAsked + lanes_.size();
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&answered), ToAbsl(deadline))) {
      Break(absl::DeadlineExceededError("the peer helpers did not release a destination before the deadline"));
      for (auto& l : lanes_) l->Kill();
    }
    return broken_;
  }

 private:
  struct Outcome {
    bool done = false;
    absl::Status status;
  };
  // released_[d]: 0 until Release(d); then kAsked plus one per lane that answered.
  static constexpr uint32_t kAsked = 1;

  absl::Status CheckRead(const PeerRead& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (r.region >= sizes_.size() || r.offset > sizes_[r.region] || r.n > sizes_[r.region] - r.offset) {
      return absl::InvalidArgumentError(absl::StrCat("read of ", r.n, " bytes at ", r.offset, " of region ", r.region,
                                                     " is outside the peer's regions"));
    }
    if (r.destination >= destination_sizes_.size() || r.at > destination_sizes_[r.destination] ||
        r.n > destination_sizes_[r.destination] - r.at || released_[r.destination] != 0) {
      return absl::InvalidArgumentError(absl::StrCat("read of ", r.n, " bytes into byte ", r.at, " of destination ",
                                                     r.destination, " is outside it, or it was released"));
    }
    return absl::OkStatus();
  }

  // The lane with the fewest pieces in flight, or lanes_.size() when all are full.
  uint32_t FreestLane() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uint32_t best = static_cast<uint32_t>(lanes_.size());
    for (uint32_t l = 0; l < lanes_.size(); ++l) {
      if (in_flight_[l] < pieces_ && (best == lanes_.size() || in_flight_[l] < in_flight_[best])) best = l;
    }
    return best;
  }

  void Break(absl::Status status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (broken_.ok()) broken_ = std::move(status);
  }

  // After an error: this call's outcomes are forgotten (the connection is
  // broken; its helpers are killed when it is destroyed).
  template <typename Piece>
  absl::Status Abandon(const std::vector<Piece>& flying) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const Piece& p : flying) done_.erase(p.msg.id);
    return broken_;
  }

  void ReceiveLoop(size_t lane) {
    for (;;) {
      absl::StatusOr<std::string> msg = lanes_[lane]->Receive(Clock::time_point::max());
      absl::MutexLock lock(&mu_);
      if (!msg.ok()) return Break(msg.status());
      ph::Kind kind{};
      if (msg->size() >= sizeof kind) std::memcpy(&kind, msg->data(), sizeof kind);
      if (kind == ph::Kind::kReleased && msg->size() == sizeof(ph::Release)) {
        ph::Release r;
        std::memcpy(&r, msg->data(), sizeof r);
        if (r.destination >= released_.size() || released_[r.destination] == 0 ||
            released_[r.destination] >= kAsked + lanes_.size()) {
          return Break(absl::InternalError("the peer helper released a destination it was not asked to"));
        }
        ++released_[r.destination];
        continue;
      }
      ph::Done done;
      if (kind != ph::Kind::kDone || msg->size() != sizeof done || in_flight_[lane] == 0) {
        return Break(absl::InternalError("the peer helper sent an unexpected message"));
      }
      std::memcpy(&done, msg->data(), sizeof done);
      --in_flight_[lane];
      auto it = done_.find(done.id);
      if (it == done_.end()) continue;  // a read of a call that already gave up
      it->second.done = true;
      if (done.code != 0) {
        done.text[sizeof done.text - 1] = '\0';
        // What a helper reports; any other code is the helper misbehaving.
        bool known = done.code == static_cast<int>(absl::StatusCode::kPermissionDenied) ||
                     done.code == static_cast<int>(absl::StatusCode::kInvalidArgument) ||
                     done.code == static_cast<int>(absl::StatusCode::kUnavailable);
        it->second.status = known ? absl::Status(static_cast<absl::StatusCode>(done.code), done.text)
                                  : absl::UnavailableError("the peer helper reported an unknown error");
      }
    }
  }

  std::vector<std::unique_ptr<Helper>> lanes_;
  const uint64_t piece_bytes_;
  const uint32_t pieces_;
  const std::vector<uint64_t> sizes_;
  const std::vector<uint64_t> destination_sizes_;
  absl::Mutex mu_;
  std::vector<uint32_t> in_flight_ ABSL_GUARDED_BY(mu_);
  std::vector<size_t> released_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Outcome> done_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> receivers_;
};

class UcxHelperTransport final : public PeerTransport {
 public:
  UcxHelperTransport(ScopedFd binary, UcxHelperOptions options) : binary_(std::move(binary)), options_(std::move(options)) {}

  std::string name() const override { return "ucx"; }

  absl::StatusOr<std::unique_ptr<PeerExport>> Export(const std::vector<PeerExportRegion>& regions,
                                                     const PeerExportOptions& options) override {
    if (regions.size() > kMaxPeerRegions) {
      return absl::InvalidArgumentError(absl::StrCat(regions.size(), " regions to export, at most ", kMaxPeerRegions));
    }
    std::vector<int> fds;
    PeerOffer offer;
    for (const PeerExportRegion& r : regions) {
      struct stat st {};
      // The helper serves the file's whole size: it must be the size promised.
      if (fstat(r.fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) != r.size) {
        return absl::InvalidArgumentError(absl::StrCat("export region fd ", r.fd, " is not a file of ", r.size, " bytes"));
      }
      fds.push_back(r.fd);
      offer.region_sizes.push_back(r.size);
    }
    if (options.senders == 0 || options.senders > kMaxPeerLanes) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.senders, " peer senders (must be 1..", kMaxPeerLanes, ")"));
    }
    std::vector<std::string> args = {"seed", std::to_string(regions.size())};
    AddUser(args);
    if (options.stall_for_test) args.push_back("--stall");
    std::vector<std::unique_ptr<Helper>> senders;
    for (uint32_t i = 0; i < options.senders; ++i) {  // they start UCX at once
      WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<Helper> helper, Helper::Start(binary_.get(), args, fds));
      senders.push_back(std::move(helper));
    }
    const Clock::time_point started = Clock::now() + options_.start_timeout;
    for (auto& helper : senders) {
      WEIGHTD_ASSIGN_OR_RETURN(PeerSender sender, ReadySender(*helper, started));
      if (offer.worker_address.empty()) {
        offer.worker_address = std::move(sender.worker_address);
        offer.token = std::move(sender.token);
      } else {
        offer.more_senders.push_back(std::move(sender));
      }
    }
    return std::unique_ptr<PeerExport>(new HelperExport(std::move(senders), std::move(offer)));
  }

  absl::StatusOr<std::unique_ptr<PeerConnection>> Connect(const PeerOffer& offer, Clock::time_point deadline,
                                                          const PeerConnectOptions& options) override {
    if (offer.more_senders.size() >= kMaxPeerLanes) {
      return absl::InvalidArgumentError(
          absl::StrCat("the peer offers ", offer.senders(), " senders, at most ", kMaxPeerLanes));
    }
    for (uint32_t i = 0; i < offer.senders(); ++i) WEIGHTD_RETURN_IF_ERROR(CheckSender(offer.sender(i), i));
    if (offer.region_sizes.size() > kMaxPeerRegions) {
      return absl::InvalidArgumentError(absl::StrCat("the peer offers ", offer.region_sizes.size(),
                                                     " regions, at most ", kMaxPeerRegions));
    }
    WEIGHTD_ASSIGN_OR_RETURN(std::vector<uint64_t> destination_sizes, CheckDestinations(options));
    std::vector<int> fds;
    for (const PeerDestination& d : options.destinations) fds.push_back(d.fd);
    std::vector<std::string> args = {"join", std::to_string(fds.size()), std::to_string(options_.piece_bytes),
                                     std::to_string(options_.pieces)};
    AddUser(args);
    if (options.advise_huge_pages) args.push_back("--advise-huge");
    if (!options_.test_fault.empty()) {
      args.push_back("--test-fault");
      args.push_back(options_.test_fault);
    }
    std::vector<std::unique_ptr<Helper>> lanes;
    for (uint32_t l = 0; l < options.lanes; ++l) {
      WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<Helper> helper, Helper::Start(binary_.get(), args, fds));
      const PeerSender sender = offer.sender(l % offer.senders());  // a lane per sender, round robin
      ph::Head head{ph::Kind::kConnect, static_cast<uint32_t>(sender.worker_address.size()), {}};
      std::memcpy(head.token, sender.token.data(), sizeof head.token);
      WEIGHTD_RETURN_IF_ERROR(
          helper->Send(&head, sizeof head, deadline, sender.worker_address.data(), sender.worker_address.size()));
      lanes.push_back(std::move(helper));
    }
    for (auto& helper : lanes) {  // the helpers start UCX and connect at once
      WEIGHTD_ASSIGN_OR_RETURN(std::string ready,
                               helper->Receive(std::min(deadline, Clock::now() + options_.start_timeout)));
      ph::Head head_back{};
      if (ready.size() != sizeof head_back) return absl::InternalError("the peer helper sent an unexpected message");
      std::memcpy(&head_back, ready.data(), sizeof head_back);
      if (head_back.kind != ph::Kind::kReady) return absl::InternalError("the peer helper sent an unexpected message");
      NoteLandlock(head_back.landlock);
    }
    return std::unique_ptr<PeerConnection>(
        new HelperConnection(std::move(lanes), options_, offer.region_sizes, std::move(destination_sizes)));
  }

 private:
  // A seed helper's Ready: its worker address and token.
  absl::StatusOr<PeerSender> ReadySender(Helper& helper, Clock::time_point deadline) {
    WEIGHTD_ASSIGN_OR_RETURN(std::string ready, helper.Receive(deadline));
    ph::Head head;
    if (ready.size() < sizeof head) return absl::InternalError("the peer helper sent a malformed message");
    std::memcpy(&head, ready.data(), sizeof head);
    if (head.kind != ph::Kind::kReady || head.length == 0 || head.length != ready.size() - sizeof head) {
      return absl::InternalError("the peer helper sent a malformed message");
    }
    NoteLandlock(head.landlock);
    return PeerSender{ready.substr(sizeof head), std::string(reinterpret_cast<const char*>(head.token),
                                                             sizeof head.token)};
  }

  // Sender `i` of an untrusted offer: an address of 1..kMaxPeerWorkerAddressBytes, a token of kPeerTokenBytes.
  static absl::Status CheckSender(const PeerSender& sender, uint32_t i) {
    if (sender.worker_address.empty() || sender.worker_address.size() > kMaxPeerWorkerAddressBytes) {
      return absl::InvalidArgumentError(absl::StrCat("peer worker address of ", sender.worker_address.size(),
                                                     " bytes (must be 1..", kMaxPeerWorkerAddressBytes, ")",
                                                     i > 0 ? absl::StrCat(" of sender ", i) : ""));
    }
    if (sender.token.size() != kPeerTokenBytes) {
      return absl::InvalidArgumentError(absl::StrCat("peer session token of ", sender.token.size(),
                                                     " bytes (must be ", kPeerTokenBytes, ")",
                                                     i > 0 ? absl::StrCat(" of sender ", i) : ""));
    }
    return absl::OkStatus();
  }

  // The destinations' sizes, each checked: a file of its promised size
  // whose size is sealed (a helper must not be able to truncate memory
  // weightd maps: a read past the end is SIGBUS).
  static absl::StatusOr<std::vector<uint64_t>> CheckDestinations(const PeerConnectOptions& options) {
    if (options.lanes == 0 || options.lanes > kMaxPeerLanes) {
      return absl::InvalidArgumentError(absl::StrCat(options.lanes, " peer lanes (must be 1..", kMaxPeerLanes, ")"));
    }
    if (options.destinations.size() > kMaxPeerRegions) {
      return absl::InvalidArgumentError(
          absl::StrCat(options.destinations.size(), " destinations, at most ", kMaxPeerRegions));
    }
    std::vector<uint64_t> sizes;
    for (size_t i = 0; i < options.destinations.size(); ++i) {
      const PeerDestination& d = options.destinations[i];
      struct stat st {};
      int seals = fcntl(d.fd, F_GET_SEALS);
      if (fstat(d.fd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) != d.size ||
          seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW)) {
        return absl::InvalidArgumentError(absl::StrCat("peer destination ", i, " (fd ", d.fd,
                                                       ") is not a size-sealed memfd of ", d.size, " bytes"));
      }
      sizes.push_back(d.size);
    }
    return sizes;
  }

  // Says once per transport when helpers run without Landlock.
  void NoteLandlock(int abi) {
    if (options_.sandbox && abi == 0 && !warned_.exchange(true)) {
      LogWarning("peer transfer helpers run without Landlock (the kernel or a seccomp profile refuses it): their file "
                 "system is not restricted; seccomp still applies");
    }
  }

  void AddUser(std::vector<std::string>& args) const {
    if (!options_.user.empty()) {
      args.push_back("--user");
      args.push_back(options_.user);
    }
    if (!options_.sandbox) args.push_back("--no-sandbox");
  }

  ScopedFd binary_;
  const UcxHelperOptions options_;
  std::atomic<bool> warned_{false};
};

}  // namespace

std::string DefaultPeerHelperPath() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "weightd-peer-helper";
  std::string self(buf, static_cast<size_t>(n));
  size_t slash = self.rfind('/');
  return (slash == std::string::npos ? std::string(".") : self.substr(0, slash)) + "/weightd-peer-helper";
}

absl::StatusOr<std::unique_ptr<PeerTransport>> MakeUcxHelperTransport(UcxHelperOptions options) {
  if (options.piece_bytes == 0 || options.piece_bytes > ph::kMaxPieceBytes || options.pieces == 0 ||
      options.pieces > ph::kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("peer pieces out of range: ", options.pieces, " of ",
                                                   options.piece_bytes, " bytes (at most ", ph::kMaxSlots, " of ",
                                                   ph::kMaxPieceBytes, ")"));
  }
  if (!options.test_fault.empty() && options.test_fault != "keep-mapping" && options.test_fault != "late-write") {
    return absl::InvalidArgumentError(absl::StrCat("unknown peer helper test fault '", options.test_fault, "'"));
  }
  if (geteuid() == 0 && !options.user.empty()) {
    passwd pw{}, *found = nullptr;
    std::vector<char> buf(16384);
    if (getpwnam_r(options.user.c_str(), &pw, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("no user ", QuoteName(options.user), " to run the peer helpers as (--peer-helper-user)"));
    }
  }
  ScopedFd binary(open(options.helper_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!binary.valid()) {
    return ErrnoToStatus(absl::StrCat("opening the peer helper ", QuoteName(options.helper_path),
                                      " (--peer-helper)"),
                         errno);
  }
  struct stat st {};
  if (fstat(binary.get(), &st) != 0 || !S_ISREG(st.st_mode) || (st.st_mode & 0111) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("the peer helper ", QuoteName(options.helper_path),
                                                   " is not an executable file (--peer-helper)"));
  }
  // Helpers that keep this process's uid (a non-root weightd, or no helper
  // user) could open /proc/<pid>/mem of weightd wherever their Landlock is
  // missing or refused (a kernel or container without it); non-dumpable,
  // only root can (ptrace(2) "Ptrace access mode checking"). Core dumps of
  // weightd are then off.
  if (geteuid() != 0 || options.user.empty()) {
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    LogInfo("peer transfer helpers keep this daemon's uid: weightd made itself non-dumpable so that a helper cannot "
            "read or write its memory (no core dumps from now on)");
  }
  return std::unique_ptr<PeerTransport>(new UcxHelperTransport(std::move(binary), std::move(options)));
}

}  // namespace weightd
