// weightd-peer-helper: the only process of weightd that runs UCX. weightd
// starts one per peer transfer (common/peer/helper_protocol.h says why and
// how); it is not meant to be run by hand.
//
//   seed: serves byte ranges of the regions at fds 4.. to a joiner that
//         presents the session token, over UCX active messages; every
//         request is checked against the token and the region's size.
//   join: connects to a seed's worker and fetches the ranges weightd asks
//         for into slots of the staging memfd at fd 4.
//
// Single-threaded: one UCP worker (UCS_THREAD_MODE_SINGLE), woken through
// its event fd (UCP_FEATURE_WAKEUP) and the control socket. Any protocol
// error from weightd or the peer ends the process with an Error message.
// References: UCX 1.13 ucp.h (ucp_init, ucp_worker_create, ucp_worker_arm,
// ucp_worker_set_am_recv_handler, ucp_am_send_nbx, ucp_am_recv_data_nbx,
// ucp_ep_create).
#include <errno.h>
#include <fcntl.h>
#include <linux/landlock.h>
#include <seccomp.h>
#include <sys/ptrace.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/peer/helper_protocol.h"

namespace weightd::peer_helper {
namespace {

constexpr int kUnavailable = static_cast<int>(absl::StatusCode::kUnavailable);
constexpr int kInvalidArgument = static_cast<int>(absl::StatusCode::kInvalidArgument);
constexpr int kPermissionDenied = static_cast<int>(absl::StatusCode::kPermissionDenied);
constexpr int kResourceExhausted = static_cast<int>(absl::StatusCode::kResourceExhausted);
// UCX parses a worker address without being told its length; the bytes a
// peer sent are copied into a zeroed buffer this much larger.
constexpr size_t kParsePadding = 64 << 10;
// A seed answers at most this many requests at once and queues at most
// kMaxQueued more; past that a request is refused (RESOURCE_EXHAUSTED).
constexpr size_t kMaxInFlight = 64;
constexpr size_t kMaxQueued = 4096;

void SendControl(const void* head, size_t head_bytes, const void* tail = nullptr, size_t tail_bytes = 0) {
  iovec iov[2] = {{const_cast<void*>(head), head_bytes}, {const_cast<void*>(tail), tail_bytes}};
  msghdr msg{};
  msg.msg_iov = iov;
  msg.msg_iovlen = tail_bytes > 0 ? 2 : 1;
  while (sendmsg(kControlFd, &msg, MSG_NOSIGNAL) < 0) {
    if (errno == EINTR) continue;
    _exit(0);  // weightd is gone: nothing left to do
  }
}

[[noreturn]] void Fail(const std::string& text) {
  std::string t = text.substr(0, kMaxTextBytes);
  Head head{Kind::kError, static_cast<uint32_t>(t.size()), {}};
  SendControl(&head, sizeof head, t.data(), t.size());
  std::fprintf(stderr, "weightd-peer-helper: %s\n", t.c_str());
  _exit(2);
}

std::string UcxWhy(const char* what, ucs_status_t status) { return absl::StrCat(what, ": ", ucs_status_string(status)); }

// Gives up root before any peer is heard: the named user's uid and gid, no
// supplementary groups, no way back (no_new_privs), not ptrace-able.
void DropPrivileges(const std::string& user) {
  if (geteuid() == 0 && !user.empty()) {
    passwd* pw = getpwnam(user.c_str());
    if (pw == nullptr) Fail(absl::StrCat("no user '", user, "' to run the peer helper as (--peer-helper-user)"));
    if (setgroups(0, nullptr) != 0 || setgid(pw->pw_gid) != 0 || setuid(pw->pw_uid) != 0) {
      Fail(absl::StrCat("cannot switch to user '", user, "': ", std::strerror(errno)));
    }
    if (pw->pw_uid != 0 && setuid(0) == 0) Fail("could switch back to root after dropping privileges");
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) {
    Fail(absl::StrCat("prctl: ", std::strerror(errno)));
  }
}

// Once UCX has read its configuration and opened its transports, the
// helper needs no file system and no way to reach other processes:
//  - Landlock (Linux 5.13+, where the kernel enables it) with every file
//    system right handled and none granted: no open, create, unlink or
//    exec of any path; descriptors already open keep working;
//  - seccomp (libseccomp): no ptrace, process_vm_readv/writev, pidfd_*,
//    signals to any process but itself, AF_UNIX sockets (weightd's own
//    sockets admit its uid), or exec.
// So a peer that takes the helper over cannot touch weightd even where the
// helper keeps weightd's uid (a non-root daemon). Returns the Landlock ABI
// in force (0: the kernel has none).
int Sandbox() {
  int abi = static_cast<int>(syscall(SYS_landlock_create_ruleset, nullptr, 0, LANDLOCK_CREATE_RULESET_VERSION));
  if (abi >= 1) {
    landlock_ruleset_attr attr{};
    attr.handled_access_fs = (LANDLOCK_ACCESS_FS_MAKE_SYM << 1) - 1;  // every right of ABI 1
    if (abi >= 2) attr.handled_access_fs |= LANDLOCK_ACCESS_FS_REFER;
    int ruleset = static_cast<int>(syscall(SYS_landlock_create_ruleset, &attr, sizeof attr, 0));
    // What UCX still reads while it connects: the routing table (is the
    // peer reachable through this interface: /proc/net/route, a link into
    // this process's own /proc/<pid>) and the memory size.
    bool ok = ruleset >= 0;
    for (const char* path : {"/proc/self/", "/proc/meminfo"}) {
      int fd = ok ? open(path, O_PATH | O_CLOEXEC) : -1;
      if (fd < 0) continue;
      landlock_path_beneath_attr rule{LANDLOCK_ACCESS_FS_READ_FILE, fd};
      ok = syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &rule, 0) == 0;
      close(fd);
    }
    ok = ok && syscall(SYS_landlock_restrict_self, ruleset, 0) == 0;
    if (!ok) {
      // A container's seccomp profile may answer the version query but
      // refuse the rest: go on with seccomp alone, and say so.
      std::fprintf(stderr, "weightd-peer-helper: Landlock refused (%s); the file system is not restricted\n",
                   std::strerror(errno));
      abi = 0;
    }
    if (ruleset >= 0) close(ruleset);
  } else {
    abi = 0;
  }
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (ctx == nullptr) Fail("seccomp_init failed");
  const uint32_t deny = SCMP_ACT_ERRNO(EPERM);
  const auto self = static_cast<scmp_datum_t>(getpid());
  int rc = 0;
  for (int sys : {SCMP_SYS(ptrace), SCMP_SYS(process_vm_readv), SCMP_SYS(process_vm_writev), SCMP_SYS(pidfd_open),
                  SCMP_SYS(pidfd_getfd), SCMP_SYS(pidfd_send_signal), SCMP_SYS(tkill), SCMP_SYS(execve),
                  SCMP_SYS(execveat)}) {
    rc |= seccomp_rule_add(ctx, deny, sys, 0);
  }
  for (int sys : {SCMP_SYS(kill), SCMP_SYS(tgkill), SCMP_SYS(rt_sigqueueinfo), SCMP_SYS(rt_tgsigqueueinfo)}) {
    rc |= seccomp_rule_add(ctx, deny, sys, 1, SCMP_A0(SCMP_CMP_NE, self));
  }
  rc |= seccomp_rule_add(ctx, deny, SCMP_SYS(socket), 1, SCMP_A0(SCMP_CMP_EQ, AF_UNIX));
  if (rc != 0 || seccomp_load(ctx) != 0) Fail("cannot load the seccomp filter");
  seccomp_release(ctx);
  return abi;
}

struct Ucx {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  std::string address;
};

Ucx StartUcx() {
  Ucx u;
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) Fail(UcxWhy("ucp_config_read", st));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;  // no RMA: UCP's software GET/PUT handlers stay off
  st = ucp_init(&params, config, &u.context);
  ucp_config_release(config);
  if (st != UCS_OK) Fail(UcxWhy("ucp_init", st));
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  st = ucp_worker_create(u.context, &wp, &u.worker);
  if (st != UCS_OK) Fail(UcxWhy("ucp_worker_create", st));
  ucp_address_t* address = nullptr;
  size_t length = 0;
  st = ucp_worker_get_address(u.worker, &address, &length);
  if (st != UCS_OK) Fail(UcxWhy("ucp_worker_get_address", st));
  if (length == 0 || length > kMaxAddressBytes) Fail(absl::StrCat("UCX worker address of ", length, " bytes"));
  u.address.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(u.worker, address);
  st = ucp_worker_get_efd(u.worker, &u.efd);
  if (st != UCS_OK) Fail(UcxWhy("ucp_worker_get_efd", st));
  return u;
}

void SetHandler(Ucx& u, unsigned id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t p{};
  p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                 UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  p.id = id;
  p.cb = cb;
  p.arg = arg;
  p.flags = UCP_AM_FLAG_WHOLE_MSG;
  ucs_status_t st = ucp_worker_set_am_recv_handler(u.worker, &p);
  if (st != UCS_OK) Fail(UcxWhy("ucp_worker_set_am_recv_handler", st));
}

// Progresses the worker and sleeps on its event fd and the control socket.
// `control` handles a readable control socket; `idle` runs after each
// progress round (to start queued work).
template <typename Control, typename Idle>
[[noreturn]] void Run(Ucx& u, Control control, Idle idle) {
  for (;;) {
    while (ucp_worker_progress(u.worker) != 0) {
    }
    idle();
    ucs_status_t armed = ucp_worker_arm(u.worker);
    if (armed == UCS_ERR_BUSY) continue;
    if (armed != UCS_OK) Fail(UcxWhy("ucp_worker_arm", armed));
    pollfd fds[2] = {{u.efd, POLLIN, 0}, {kControlFd, POLLIN, 0}};
    if (poll(fds, 2, 1000) < 0 && errno != EINTR) Fail(absl::StrCat("poll: ", std::strerror(errno)));
    if (fds[1].revents != 0) control();
  }
}

// Receives one control message into `buf` without blocking: its size, 0
// when none is waiting; exits when weightd closed the socket.
size_t ReceiveControl(char* buf, size_t size) {
  for (;;) {
    ssize_t n = recv(kControlFd, buf, size, MSG_DONTWAIT | MSG_TRUNC);
    if (n > 0 && static_cast<size_t>(n) > size) Fail("control message too long");
    if (n > 0) return static_cast<size_t>(n);
    if (n == 0) _exit(0);  // weightd ended the transfer
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    _exit(0);
  }
}

bool SameToken(const uint8_t* a, const uint8_t* b) {
  uint8_t diff = 0;
  for (uint32_t i = 0; i < kTokenBytes; ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

// ---- seed ----

struct Region {
  const char* base;
  uint64_t size;
};

struct Seed {
  Ucx ucx;
  std::vector<Region> regions;
  uint8_t token[kTokenBytes];
  bool stall = false;
  struct Ask {
    ucp_ep_h ep;
    AmRequest request;
  };
  std::deque<Ask> queue;
  size_t in_flight = 0;
  uint64_t malformed = 0;
};

struct Sending {
  Seed* seed;
  AmReply reply;
};

void OnReplySent(void* request, ucs_status_t, void* user_data) {
  auto* s = static_cast<Sending*>(user_data);
  --s->seed->in_flight;
  delete s;
  ucp_request_free(request);
}

void SendReply(Seed& seed, ucp_ep_h ep, uint64_t id, int code, const char* data, uint64_t n) {
  auto* s = new Sending{&seed, AmReply{id, code, 0}};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &OnReplySent;
  param.user_data = s;
  ++seed.in_flight;
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, kAmReply, &s->reply, sizeof s->reply, data, n, &param);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {  // done at once, or that joiner's connection failed
    --seed.in_flight;
    delete s;
  }
}

ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void*, size_t length,
                       const ucp_am_recv_param_t* param) {
  auto& seed = *static_cast<Seed*>(arg);
  if (header_length != sizeof(AmRequest) || length != 0 || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    ++seed.malformed;  // nothing to answer to; a rendezvous payload is dropped by returning UCS_OK
    return UCS_OK;
  }
  Seed::Ask ask{param->reply_ep, {}};
  std::memcpy(&ask.request, header, sizeof ask.request);
  if (seed.queue.size() >= kMaxQueued) {
    SendReply(seed, ask.ep, ask.request.id, kResourceExhausted, nullptr, 0);
  } else {
    seed.queue.push_back(ask);
  }
  return UCS_OK;
}

void Serve(Seed& seed) {
  if (seed.stall) {
    seed.queue.clear();  // test fault: asked, never answered
    return;
  }
  while (!seed.queue.empty() && seed.in_flight < kMaxInFlight) {
    Seed::Ask ask = seed.queue.front();
    seed.queue.pop_front();
    const AmRequest& r = ask.request;
    if (!SameToken(r.token, seed.token)) {
      SendReply(seed, ask.ep, r.id, kPermissionDenied, nullptr, 0);
    } else if (r.region >= seed.regions.size() || r.n == 0 || r.n > kMaxPieceBytes ||
               r.offset > seed.regions[r.region].size || r.n > seed.regions[r.region].size - r.offset) {
      SendReply(seed, ask.ep, r.id, kInvalidArgument, nullptr, 0);
    } else {
      SendReply(seed, ask.ep, r.id, 0, seed.regions[r.region].base + r.offset, r.n);
    }
  }
}

[[noreturn]] void RunSeed(int regions, const std::string& user, bool stall, bool sandbox) {
  Seed seed;
  seed.stall = stall;
  for (int i = 0; i < regions; ++i) {
    int fd = kFirstDataFd + i;
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) Fail(absl::StrCat("region fd ", fd, " is not a file"));
    uint64_t size = static_cast<uint64_t>(st.st_size);
    const char* base = "";
    if (size > 0) {
      void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) Fail(absl::StrCat("mmap of region ", i, ": ", std::strerror(errno)));
      base = static_cast<const char*>(p);
    }
    close(fd);
    seed.regions.push_back({base, size});
  }
  if (getrandom(seed.token, sizeof seed.token, 0) != static_cast<ssize_t>(sizeof seed.token)) {
    Fail(absl::StrCat("getrandom: ", std::strerror(errno)));
  }
  DropPrivileges(user);
  seed.ucx = StartUcx();
  SetHandler(seed.ucx, kAmRequest, &OnRequest, &seed);
  if (sandbox) Sandbox();
  Head ready{Kind::kReady, static_cast<uint32_t>(seed.ucx.address.size()), {}};
  std::memcpy(ready.token, seed.token, sizeof ready.token);
  SendControl(&ready, sizeof ready, seed.ucx.address.data(), seed.ucx.address.size());
  char buf[64];
  Run(
      seed.ucx, [&] { while (ReceiveControl(buf, sizeof buf) > 0) Fail("unexpected control message"); },
      [&] { Serve(seed); });
}

// ---- join ----

struct Join {
  Ucx ucx;
  bool sandbox = true;
  ucp_ep_h ep = nullptr;
  char* staging = nullptr;
  uint64_t slot_bytes = 0;
  uint32_t slots = 0;
  struct Pending {
    Join* join;
    AmRequest request;
    uint32_t slot;
  };
  std::unordered_map<uint64_t, std::unique_ptr<Pending>> pending;
};

void ReportDone(uint64_t id, int code, const std::string& text) {
  Done done{};
  done.code = code;
  done.id = id;
  std::snprintf(done.text, sizeof done.text, "%s", text.c_str());
  SendControl(&done, sizeof done);
}

void OnEndpointError(void*, ucp_ep_h, ucs_status_t status) { Fail(UcxWhy("the connection to the seed failed", status)); }

void OnRequestSent(void* request, ucs_status_t status, void*) {
  if (status != UCS_OK) Fail(UcxWhy("sending a request to the seed", status));
  ucp_request_free(request);
}

void OnDataReceived(void* request, ucs_status_t status, size_t, void* user_data) {
  auto id = reinterpret_cast<uintptr_t>(user_data);
  if (status != UCS_OK) Fail(UcxWhy("receiving bytes from the seed", status));
  ReportDone(id, 0, "");
  ucp_request_free(request);
}

ucs_status_t OnReply(void* arg, const void* header, size_t header_length, void* data, size_t length,
                     const ucp_am_recv_param_t* param) {
  auto& join = *static_cast<Join*>(arg);
  if (header_length != sizeof(AmReply)) Fail("the seed sent a malformed reply");
  AmReply reply;
  std::memcpy(&reply, header, sizeof reply);
  auto it = join.pending.find(reply.id);
  if (it == join.pending.end()) Fail(absl::StrCat("the seed answered request ", reply.id, ", which was not asked"));
  std::unique_ptr<Join::Pending> p = std::move(it->second);
  join.pending.erase(it);
  if (reply.code != 0) {
    const char* why = reply.code == kPermissionDenied ? "the seed refused the session token"
                      : reply.code == kInvalidArgument ? "the seed refused a read outside its regions"
                                                       : "the seed refused a read";
    ReportDone(reply.id, reply.code == kResourceExhausted ? kUnavailable : reply.code, why);
    return UCS_OK;
  }
  if (length != p->request.n) {
    Fail(absl::StrCat("the seed sent ", length, " bytes for a read of ", p->request.n));
  }
  char* dst = join.staging + p->slot * join.slot_bytes;
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &OnDataReceived;
    rp.user_data = reinterpret_cast<void*>(static_cast<uintptr_t>(reply.id));
    ucs_status_ptr_t sp = ucp_am_recv_data_nbx(join.ucx.worker, data, dst, length, &rp);
    if (UCS_PTR_IS_ERR(sp)) Fail(UcxWhy("ucp_am_recv_data_nbx", UCS_PTR_STATUS(sp)));
    if (sp == nullptr) ReportDone(reply.id, 0, "");
  } else {
    std::memcpy(dst, data, length);
    ReportDone(reply.id, 0, "");
  }
  return UCS_OK;
}

void Connect(Join& join, const Head& head, const char* address) {
  std::string padded(head.length + kParsePadding, '\0');
  std::memcpy(padded.data(), address, head.length);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(padded.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &OnEndpointError;
  ucs_status_t st = ucp_ep_create(join.ucx.worker, &ep, &join.ep);
  if (st != UCS_OK) Fail(UcxWhy("cannot connect to the seed's worker (ucp_ep_create)", st));
  if (join.sandbox) Sandbox();
  Head ready{Kind::kReady, 0, {}};
  SendControl(&ready, sizeof ready);
}

void Ask(Join& join, const uint8_t* token, const Read& r) {
  if (r.slot >= join.slots || r.n == 0 || r.n > join.slot_bytes || join.pending.count(r.id)) {
    Fail("weightd sent a bad read");
  }
  auto p = std::make_unique<Join::Pending>(Join::Pending{&join, {}, r.slot});
  std::memcpy(p->request.token, token, kTokenBytes);
  p->request.id = r.id;
  p->request.region = r.region;
  p->request.offset = r.offset;
  p->request.n = r.n;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &OnRequestSent;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  const AmRequest* header = &p->request;  // stays put until the reply: the map owns it
  join.pending.emplace(r.id, std::move(p));
  ucs_status_ptr_t sp = ucp_am_send_nbx(join.ep, kAmRequest, header, sizeof *header, nullptr, 0, &param);
  if (UCS_PTR_IS_ERR(sp)) Fail(UcxWhy("sending a request to the seed", UCS_PTR_STATUS(sp)));
}

[[noreturn]] void RunJoin(uint64_t slot_bytes, uint32_t slots, const std::string& user, bool sandbox) {
  Join join;
  join.sandbox = sandbox;
  join.slot_bytes = slot_bytes;
  join.slots = slots;
  struct stat st {};
  if (fstat(kFirstDataFd, &st) != 0 || static_cast<uint64_t>(st.st_size) != slot_bytes * slots) {
    Fail("the staging memfd is missing or of the wrong size");
  }
  void* p = mmap(nullptr, slot_bytes * slots, PROT_READ | PROT_WRITE, MAP_SHARED, kFirstDataFd, 0);
  if (p == MAP_FAILED) Fail(absl::StrCat("mmap of the staging memfd: ", std::strerror(errno)));
  close(kFirstDataFd);
  join.staging = static_cast<char*>(p);
  DropPrivileges(user);
  join.ucx = StartUcx();
  SetHandler(join.ucx, kAmReply, &OnReply, &join);  // Sandbox() once connected (ucp_ep_create reads /sys)
  std::vector<char> buf(sizeof(Head) + kMaxAddressBytes);
  uint8_t token[kTokenBytes] = {};
  auto control = [&] {
    while (size_t n = ReceiveControl(buf.data(), buf.size())) {
      Kind kind;
      std::memcpy(&kind, buf.data(), sizeof kind);
      if (kind == Kind::kConnect && join.ep == nullptr && n >= sizeof(Head)) {
        Head head;
        std::memcpy(&head, buf.data(), sizeof head);
        if (head.length == 0 || head.length > kMaxAddressBytes || n != sizeof head + head.length) {
          Fail("weightd sent a bad worker address");
        }
        std::memcpy(token, head.token, sizeof token);
        Connect(join, head, buf.data() + sizeof head);
      } else if (kind == Kind::kRead && join.ep != nullptr && n == sizeof(Read)) {
        Read r;
        std::memcpy(&r, buf.data(), sizeof r);
        Ask(join, token, r);
      } else {
        Fail("unexpected control message");
      }
    }
  };
  Run(join.ucx, control, [] {});
}

// `weightd-peer-helper sandbox-check PATH [--user NAME]`, for tests: the
// same privilege drop and sandbox as a transfer, then every thing the
// sandbox forbids is tried once; prints `what=errno-name` lines (`ok` when
// allowed) and `landlock=ABI`.
int SandboxCheck(const std::string& path, const std::string& user) {
  DropPrivileges(user);
  int abi = Sandbox();
  pid_t parent = getppid();
  auto result = [](bool ok) { return ok ? std::string("ok") : std::string(strerrorname_np(errno)); };
  std::printf("landlock=%d\n", abi);
  int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  std::printf("open=%s\n", result(fd >= 0).c_str());
  std::printf("socket_unix=%s\n", result(socket(AF_UNIX, SOCK_STREAM, 0) >= 0).c_str());
  std::printf("socket_inet=%s\n", result(socket(AF_INET, SOCK_STREAM, 0) >= 0).c_str());
  std::printf("kill_parent=%s\n", result(kill(parent, 0) == 0).c_str());
  std::printf("kill_self=%s\n", result(kill(getpid(), 0) == 0).c_str());
  std::printf("ptrace_parent=%s\n", result(ptrace(PTRACE_SEIZE, parent, nullptr, nullptr) == 0).c_str());
  char byte;
  iovec local{&byte, 1}, remote{reinterpret_cast<void*>(0x1000), 1};
  std::printf("vm_read_parent=%s\n", result(process_vm_readv(parent, &local, 1, &remote, 1, 0) >= 0).c_str());
  char* argv[] = {const_cast<char*>("/bin/true"), nullptr};
  std::printf("exec=%s\n", result(execv("/bin/true", argv) == 0).c_str());
  return 0;
}

int Main(int argc, char** argv) {
  // weightd starts it through /proc/self/fd/N, which would name it "N" in ps.
  prctl(PR_SET_NAME, "wd-peer-helper", 0, 0, 0);
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string user;
  bool stall = false;
  bool sandbox = true;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--user" && i + 1 < args.size()) {
      user = args[++i];
    } else if (args[i] == "--stall") {
      stall = true;
    } else if (args[i] == "--no-sandbox") {
      sandbox = false;
    } else {
      positional.push_back(args[i]);
    }
  }
  if (positional.size() == 2 && positional[0] == "sandbox-check") return SandboxCheck(positional[1], user);
  struct stat st {};
  if (fstat(kControlFd, &st) != 0 || !S_ISSOCK(st.st_mode)) {
    std::fprintf(stderr, "weightd-peer-helper is started by weightd for peer seeding; it is not run by hand\n");
    return 2;
  }
  uint32_t regions = 0;
  uint64_t slot_bytes = 0;
  uint32_t slots = 0;
  if (positional.size() == 2 && positional[0] == "seed" && absl::SimpleAtoi(positional[1], &regions) &&
      regions <= (1u << 16)) {
    close_range(kFirstDataFd + regions, ~0u, 0);  // the executable's fd, and anything else inherited
    RunSeed(static_cast<int>(regions), user, stall, sandbox);
  }
  if (positional.size() == 3 && positional[0] == "join" && absl::SimpleAtoi(positional[1], &slot_bytes) &&
      absl::SimpleAtoi(positional[2], &slots) && slot_bytes > 0 && slot_bytes <= kMaxPieceBytes && slots > 0 &&
      slots <= kMaxSlots) {
    close_range(kFirstDataFd + 1, ~0u, 0);
    RunJoin(slot_bytes, slots, user, sandbox);
  }
  Fail("usage: weightd-peer-helper seed N | join SLOT_BYTES SLOTS [--user NAME] [--stall] [--no-sandbox]");
}

}  // namespace
}  // namespace weightd::peer_helper

int main(int argc, char** argv) { return weightd::peer_helper::Main(argc, argv); }
