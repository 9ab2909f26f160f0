// weightd-peer-helper: the only process of weightd that runs UCX. weightd
// starts one per peer transfer (common/peer/helper_protocol.h says why and
// how); it is not meant to be run by hand.
//
//   seed: serves byte ranges of the regions at fds 4.. to a joiner that
//         presents the session token, over UCX active messages; every
//         request is checked against the token and the region's size.
//   join: connects to a seed's worker and fetches the ranges weightd asks
//         for straight into the destination memfds at fds 4.. (the new
//         generation's segments, which weightd seals and hashes after this
//         process has let go of them).
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
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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
// A seed has at most this many replies in flight; more requests are dropped.
constexpr size_t kMaxInFlight = 2 * kMaxSlots;

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

// The helper's sandbox, in two steps (docs/operations.md "Transfer helpers").
//
// RestrictFiles(), before UCX starts, so that every thread UCX makes
// inherits it: Landlock (Linux 5.13+, where the kernel enables it) handles
// every file system right the kernel knows and grants only reading (and
// mapping shared libraries) beneath what UCX reads to start and connect:
// /usr, /lib*, /etc/ld.so.cache, /etc/ucx, /sys, /dev/infiniband, this
// process's own /proc/<pid> (its routing table is /proc/net/route),
// /proc/meminfo, /proc/cpuinfo and /proc/sys. Nothing can be written,
// created, removed or run; other processes' /proc, /etc, /run, /home and
// the model roots cannot be read. With ABI 6 it also scopes abstract Unix
// sockets and signals to this process. Returns the ABI in force, 0 when the
// kernel (or a container's seccomp profile) refuses Landlock.
//
// RestrictCalls(), once UCX is up (a joiner: connected), for every thread
// at once (SCMP_FLTATR_CTL_TSYNC): seccomp refuses ptrace,
// process_vm_readv/writev, pidfd_*, signals to any process but itself,
// AF_UNIX sockets (weightd's own sockets admit its uid), io_uring (its
// socket operations bypass socket(2)), exec, namespaces, mounts, keyrings,
// bpf, perf_event_open and userfaultfd.
//
// So a peer that takes the helper over cannot reach weightd even where the
// helper keeps weightd's uid (a non-root daemon).
constexpr uint64_t kFsTruncate = 1ull << 14;  // LANDLOCK_ACCESS_FS_TRUNCATE (ABI 3)
constexpr uint64_t kFsIoctlDev = 1ull << 15;  // LANDLOCK_ACCESS_FS_IOCTL_DEV (ABI 5)
constexpr uint64_t kScopeAbstractUnix = 1ull << 0, kScopeSignal = 1ull << 1;  // ABI 6

// landlock_ruleset_attr as of ABI 6 (Debian 12's header stops at ABI 2).
struct RulesetAttr {
  uint64_t handled_access_fs;
  uint64_t handled_access_net;
  uint64_t scoped;
};

int RestrictFiles() {
  int abi = static_cast<int>(syscall(SYS_landlock_create_ruleset, nullptr, 0, LANDLOCK_CREATE_RULESET_VERSION));
  if (abi < 1) return 0;
  RulesetAttr attr{};
  attr.handled_access_fs = (LANDLOCK_ACCESS_FS_MAKE_SYM << 1) - 1;  // every right of ABI 1
  if (abi >= 2) attr.handled_access_fs |= LANDLOCK_ACCESS_FS_REFER;
  if (abi >= 3) attr.handled_access_fs |= kFsTruncate;
  if (abi >= 5) attr.handled_access_fs |= kFsIoctlDev;
  if (abi >= 6) attr.scoped = kScopeAbstractUnix | kScopeSignal;
  size_t attr_size = abi >= 6 ? sizeof attr : abi >= 4 ? 2 * sizeof(uint64_t) : sizeof(uint64_t);
  int ruleset = static_cast<int>(syscall(SYS_landlock_create_ruleset, &attr, attr_size, 0));
  bool ok = ruleset >= 0;
  const uint64_t read = LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_READ_DIR | LANDLOCK_ACCESS_FS_EXECUTE;
  for (const char* path : {"/usr", "/lib", "/lib64", "/etc/ld.so.cache", "/etc/ucx", "/sys", "/dev/infiniband",
                           "/proc/self/", "/proc/meminfo", "/proc/cpuinfo", "/proc/sys"}) {
    int fd = ok ? open(path, O_PATH | O_CLOEXEC) : -1;
    if (fd < 0) continue;  // absent here
    struct stat st {};
    fstat(fd, &st);
    // A rule on a file may name only the rights that apply to files.
    uint64_t rights = S_ISDIR(st.st_mode) ? read : read & ~LANDLOCK_ACCESS_FS_READ_DIR;
    landlock_path_beneath_attr rule{rights, fd};
    ok = syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &rule, 0) == 0;
    close(fd);
  }
  ok = ok && syscall(SYS_landlock_restrict_self, ruleset, 0) == 0;
  int err = errno;
  if (ruleset >= 0) close(ruleset);
  if (!ok) {
    // A container's seccomp profile may answer the version query but
    // refuse the rest: go on with seccomp alone (weightd logs the ABI).
    std::fprintf(stderr, "weightd-peer-helper: Landlock refused (%s); the file system is not restricted\n",
                 std::strerror(err));
    return 0;
  }
  return abi;
}

void RestrictCalls() {
  scmp_filter_ctx ctx = seccomp_init(SCMP_ACT_ALLOW);
  if (ctx == nullptr) Fail("seccomp_init failed");
  const uint32_t deny = SCMP_ACT_ERRNO(EPERM);
  const auto self = static_cast<scmp_datum_t>(getpid());
  int rc = seccomp_attr_set(ctx, SCMP_FLTATR_CTL_TSYNC, 1);  // UCX's async thread too
  for (int sys : {SCMP_SYS(ptrace), SCMP_SYS(process_vm_readv), SCMP_SYS(process_vm_writev), SCMP_SYS(pidfd_open),
                  SCMP_SYS(pidfd_getfd), SCMP_SYS(pidfd_send_signal), SCMP_SYS(tkill), SCMP_SYS(execve),
                  SCMP_SYS(execveat), SCMP_SYS(io_uring_setup), SCMP_SYS(io_uring_enter), SCMP_SYS(io_uring_register),
                  SCMP_SYS(unshare), SCMP_SYS(setns), SCMP_SYS(mount), SCMP_SYS(umount2),
                  SCMP_SYS(pivot_root), SCMP_SYS(chroot), SCMP_SYS(keyctl), SCMP_SYS(add_key), SCMP_SYS(request_key),
                  SCMP_SYS(bpf), SCMP_SYS(perf_event_open), SCMP_SYS(userfaultfd), SCMP_SYS(open_by_handle_at),
                  SCMP_SYS(name_to_handle_at)}) {
    rc |= seccomp_rule_add(ctx, deny, sys, 0);
  }
  for (int sys : {SCMP_SYS(kill), SCMP_SYS(tgkill), SCMP_SYS(rt_sigqueueinfo), SCMP_SYS(rt_tgsigqueueinfo)}) {
    rc |= seccomp_rule_add(ctx, deny, sys, 1, SCMP_A0(SCMP_CMP_NE, self));
  }
  rc |= seccomp_rule_add(ctx, deny, SCMP_SYS(socket), 1, SCMP_A0(SCMP_CMP_EQ, AF_UNIX));
  // New namespaces through clone(2)'s flags; clone3(2) passes them in
  // memory a filter cannot read, so it answers ENOSYS and glibc falls back
  // to clone(2).
  for (scmp_datum_t flag : {CLONE_NEWUSER, CLONE_NEWNS, CLONE_NEWNET, CLONE_NEWPID, CLONE_NEWIPC, CLONE_NEWUTS,
                            CLONE_NEWCGROUP}) {
    rc |= seccomp_rule_add(ctx, deny, SCMP_SYS(clone), 1, SCMP_A0(SCMP_CMP_MASKED_EQ, flag, flag));
  }
  rc |= seccomp_rule_add(ctx, SCMP_ACT_ERRNO(ENOSYS), SCMP_SYS(clone3), 0);
  if (rc != 0 || seccomp_load(ctx) != 0) Fail("cannot load the seccomp filter");
  seccomp_release(ctx);
}

struct Ucx {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  std::string address;
};

Ucx StartUcx() {
  Ucx u;
  // Peers are other nodes: shared-memory transports have nothing to reach,
  // and the sandbox forbids the files they need. Without the operator's
  // own UCX_TLS, UCX may use every transport but those.
  setenv("UCX_TLS", "^sm", /*overwrite=*/0);
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
// `control` handles a readable control socket; it is also looked at after
// every 256 progress rounds, so a peer that keeps the worker busy cannot
// starve weightd's messages.
template <typename Control>
[[noreturn]] void Run(Ucx& u, Control control) {
  for (;;) {
    int rounds = 0;
    while (ucp_worker_progress(u.worker) != 0 && ++rounds < 256) {
    }
    pollfd fds[2] = {{u.efd, POLLIN, 0}, {kControlFd, POLLIN, 0}};
    int timeout = 0;
    if (rounds < 256) {
      ucs_status_t armed = ucp_worker_arm(u.worker);
      if (armed != UCS_OK && armed != UCS_ERR_BUSY) Fail(UcxWhy("ucp_worker_arm", armed));
      timeout = armed == UCS_OK ? 1000 : 0;
    }
    if (poll(fds, 2, timeout) < 0 && errno != EINTR) Fail(absl::StrCat("poll: ", std::strerror(errno)));
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
  size_t in_flight = 0;  // replies UCX still sends
  uint64_t sent = 0;     // bytes of region data in replies UCX completed
};

struct Sending {
  Seed* seed;
  AmReply reply;  // the header stays valid until the send completes
  uint64_t n;     // bytes of region data it carries
};

void OnReplySent(void* request, ucs_status_t status, void* user_data) {
  auto* s = static_cast<Sending*>(user_data);
  --s->seed->in_flight;
  if (status == UCS_OK) s->seed->sent += s->n;
  delete s;
  ucp_request_free(request);
}

void SendReply(Seed& seed, ucp_ep_h ep, uint64_t id, int code, const char* data, uint64_t n) {
  auto* s = new Sending{&seed, AmReply{id, code, 0}, n};
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &OnReplySent;
  param.user_data = s;
  ++seed.in_flight;
  ucs_status_ptr_t sp = ucp_am_send_nbx(ep, kAmReply, &s->reply, sizeof s->reply, data, n, &param);
  if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {  // done at once, or that joiner's connection failed
    --seed.in_flight;
    if (sp == nullptr) seed.sent += n;
    delete s;
  }
}

// Every request is checked and answered here, in the callback, while its
// reply endpoint is certainly alive (UCX 1.13 may destroy a failed peer's
// reply endpoint later). Replies in flight are bounded: past
// kMaxInFlight a request is dropped without an answer or an allocation
// (a joiner keeps at most kMaxSlots asked).
ucs_status_t OnRequest(void* arg, const void* header, size_t header_length, void*, size_t length,
                       const ucp_am_recv_param_t* param) {
  auto& seed = *static_cast<Seed*>(arg);
  if (header_length != sizeof(AmRequest) || length != 0 || !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) {
    return UCS_OK;  // nothing to answer to; a rendezvous payload is dropped by returning UCS_OK
  }
  if (seed.stall) return UCS_OK;  // test fault: asked, never answered
  if (seed.in_flight >= kMaxInFlight) return UCS_OK;
  AmRequest r;
  std::memcpy(&r, header, sizeof r);
  if (!SameToken(r.token, seed.token)) {
    SendReply(seed, param->reply_ep, r.id, kPermissionDenied, nullptr, 0);
  } else if (r.region >= seed.regions.size() || r.n == 0 || r.n > kMaxPieceBytes ||
             r.offset > seed.regions[r.region].size || r.n > seed.regions[r.region].size - r.offset) {
    SendReply(seed, param->reply_ep, r.id, kInvalidArgument, nullptr, 0);
  } else {
    SendReply(seed, param->reply_ep, r.id, 0, seed.regions[r.region].base + r.offset, r.n);
  }
  return UCS_OK;
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
  int landlock = sandbox ? RestrictFiles() : 0;
  seed.ucx = StartUcx();
  SetHandler(seed.ucx, kAmRequest, &OnRequest, &seed);
  if (sandbox) RestrictCalls();
  Head ready{Kind::kReady, static_cast<uint32_t>(seed.ucx.address.size()), {}, landlock, 0};
  std::memcpy(ready.token, seed.token, sizeof ready.token);
  SendControl(&ready, sizeof ready, seed.ucx.address.data(), seed.ucx.address.size());
  char buf[64];
  Run(seed.ucx, [&] {
    for (size_t n; (n = ReceiveControl(buf, sizeof buf)) > 0;) {
      Count ask;
      if (n != sizeof ask) Fail("unexpected control message");
      std::memcpy(&ask, buf, sizeof ask);
      if (ask.kind != Kind::kCount) Fail("unexpected control message");
      Count answer{Kind::kCount, 0, seed.sent};
      SendControl(&answer, sizeof answer);
    }
  });
}

// ---- join ----

struct Join {
  Ucx ucx;
  bool sandbox = true;
  ucp_ep_h ep = nullptr;
  struct Destination {
    char* base = nullptr;  // writable mapping; null once released
    uint64_t size = 0;
    uint32_t receiving = 0;  // replies still landing in it
    uint64_t last_at = 0;    // test fault "late-write": a byte reported done
    uint64_t page = 4096;    // 2 MiB for hugetlb and advised THP destinations
  };
  std::vector<Destination> destinations;
  uint64_t piece_bytes = 0;
  uint32_t pieces = 0;
  std::string test_fault;
  // A request lives until both its send has completed (UCX reads the
  // header until then) and its reply has arrived.
  struct Pending {
    AmRequest request;
    uint32_t destination;
    uint64_t at;
    bool sent = false, replied = false;
  };
  std::unordered_map<uint64_t, Pending*> pending;  // asked, not answered
};

Join* g_join = nullptr;  // for OnDataReceived, which gets only the request id

void ReportDone(uint64_t id, int code, const std::string& text) {
  Done done{};
  done.code = code;
  done.id = id;
  std::snprintf(done.text, sizeof done.text, "%s", text.c_str());
  SendControl(&done, sizeof done);
}

// MADV_POPULATE_WRITE (Linux 5.14) for C libraries that predate it.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Makes the pages of bytes [at, at + n) of a destination before the bytes
// arrive: one call allocates, zeroes and maps them (whole 2 MiB pages for
// huge destinations) instead of a page fault per 4 KiB page inside the
// socket receive, the costliest part of filling fresh memory on a VM
// (docs/performance.md). Best effort: without it pages fault in.
void Populate(const Join::Destination& d, uint64_t at, uint64_t n) {
  uint64_t start = at / d.page * d.page;
  uint64_t end = std::min((at + n + d.page - 1) / d.page * d.page, (d.size + 4095) / 4096 * 4096);
  if (end > start) (void)madvise(d.base + start, end - start, MADV_POPULATE_WRITE);
}

void OnEndpointError(void*, ucp_ep_h, ucs_status_t status) { Fail(UcxWhy("the connection to the seed failed", status)); }

void OnRequestSent(void* request, ucs_status_t status, void* user_data) {
  if (status != UCS_OK) Fail(UcxWhy("sending a request to the seed", status));
  auto* p = static_cast<Join::Pending*>(user_data);
  p->sent = true;
  if (p->replied) delete p;
  ucp_request_free(request);
}

// A reply's bytes are in its destination: the destination may be released.
void Landed(uint32_t destination, uint64_t id) {
  --g_join->destinations[destination].receiving;
  ReportDone(id, 0, "");
}

struct Receiving {
  uint64_t id;
  uint32_t destination;
};

void OnDataReceived(void* request, ucs_status_t status, size_t, void* user_data) {
  auto* r = static_cast<Receiving*>(user_data);
  if (status != UCS_OK) Fail(UcxWhy("receiving bytes from the seed", status));
  Landed(r->destination, r->id);
  delete r;
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
  Join::Pending* p = it->second;
  join.pending.erase(it);
  const uint64_t n = p->request.n;
  const uint32_t destination = p->destination;
  Join::Destination& d = join.destinations[destination];
  char* dst = d.base + p->at;
  Populate(d, p->at, n);
  d.last_at = p->at;
  p->replied = true;
  if (p->sent) delete p;
  if (reply.code != 0) {
    --d.receiving;
    // Only the codes a seed sends; anything else is the seed misbehaving.
    if (reply.code == kPermissionDenied) {
      ReportDone(reply.id, kPermissionDenied, "the seed refused the session token");
    } else if (reply.code == kInvalidArgument) {
      ReportDone(reply.id, kInvalidArgument, "the seed refused a read outside its regions");
    } else {
      ReportDone(reply.id, kUnavailable, absl::StrCat("the seed refused a read (code ", reply.code, ")"));
    }
    return UCS_OK;
  }
  if (length != n) Fail(absl::StrCat("the seed sent ", length, " bytes for a read of ", n));
  if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    rp.cb.recv_am = &OnDataReceived;
    auto* receiving = new Receiving{reply.id, destination};
    rp.user_data = receiving;
    ucs_status_ptr_t sp = ucp_am_recv_data_nbx(join.ucx.worker, data, dst, length, &rp);
    if (UCS_PTR_IS_ERR(sp)) Fail(UcxWhy("ucp_am_recv_data_nbx", UCS_PTR_STATUS(sp)));
    if (sp == nullptr) {
      delete receiving;
      Landed(destination, reply.id);
    }
  } else {
    std::memcpy(dst, data, length);
    Landed(destination, reply.id);
  }
  return UCS_OK;
}

void Connect(Join& join, const Head& head, const char* address, int landlock) {
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
  if (join.sandbox) RestrictCalls();
  Head ready{Kind::kReady, 0, {}, landlock, 0};
  SendControl(&ready, sizeof ready);
}

void Ask(Join& join, const uint8_t* token, const Read& r) {
  if (r.destination >= join.destinations.size() || r.n == 0 || r.n > join.piece_bytes ||
      join.pending.size() >= join.pieces || join.pending.count(r.id)) {
    Fail("weightd sent a bad read");
  }
  Join::Destination& d = join.destinations[r.destination];
  if (d.base == nullptr || r.at > d.size || r.n > d.size - r.at) Fail("weightd sent a read outside its destination");
  ++d.receiving;
  auto* p = new Join::Pending{{}, r.destination, r.at};
  std::memcpy(p->request.token, token, kTokenBytes);
  p->request.id = r.id;
  p->request.region = r.region;
  p->request.offset = r.offset;
  p->request.n = r.n;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  param.cb.send = &OnRequestSent;
  param.user_data = p;
  param.flags = UCP_AM_SEND_FLAG_REPLY;
  join.pending.emplace(r.id, p);
  ucs_status_ptr_t sp = ucp_am_send_nbx(join.ep, kAmRequest, &p->request, sizeof p->request, nullptr, 0, &param);
  if (UCS_PTR_IS_ERR(sp)) Fail(UcxWhy("sending a request to the seed", UCS_PTR_STATUS(sp)));
  if (sp == nullptr) p->sent = true;  // done at once: no callback comes (a reply cannot have come yet)
}

// Test faults of a joiner's helper (--peer-test-fault, weightd's tests):
// what a helper taken over by its peer could do on Release.
//   keep-mapping  a forked child keeps a writable mapping for 10 s while
//                 the helper answers Released (weightd's seal must fail);
//   late-write    flips a byte it already reported done, then unmaps
//                 (weightd's hashes must catch it).
void ReleaseWithFault(Join::Destination& d, const std::string& fault) {
  if (fault == "late-write" && d.size > 0) d.base[d.last_at] ^= 0x5a;
  if (fault == "keep-mapping" && fork() == 0) {
    close_range(0, ~0u, 0);  // only the mapping stays (no pipe of a test waits for this process)
    sleep(10);
    _exit(0);
  }
}

// Unmaps a destination once no reply is landing in it, and says so.
void Release(Join& join, uint32_t destination) {
  if (destination >= join.destinations.size()) Fail("weightd released an unknown destination");
  Join::Destination& d = join.destinations[destination];
  if (d.receiving > 0) Fail("weightd released a destination with reads in flight");
  if (d.base != nullptr) {
    ReleaseWithFault(d, join.test_fault);
    munmap(d.base, d.size);
    d.base = nullptr;
  }
  struct Release done{Kind::kReleased, destination};
  SendControl(&done, sizeof done);
}

[[noreturn]] void RunJoin(uint32_t count, uint64_t piece_bytes, uint32_t pieces, const std::string& user, bool sandbox,
                          bool advise_huge, const std::string& test_fault) {
  Join join;
  g_join = &join;
  join.sandbox = sandbox;
  join.piece_bytes = piece_bytes;
  join.pieces = pieces;
  join.test_fault = test_fault;
  for (uint32_t i = 0; i < count; ++i) {
    const int fd = kFirstDataFd + static_cast<int>(i);
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) Fail(absl::StrCat("destination fd ", fd, " is not a file"));
    Join::Destination d;
    d.size = static_cast<uint64_t>(st.st_size);
    if (d.size > 0) {
      void* p = mmap(nullptr, d.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (p == MAP_FAILED) Fail(absl::StrCat("mmap of destination ", i, ": ", std::strerror(errno)));
      // A shmem page is huge or not by the mapping that faults it in.
      if (advise_huge) madvise(p, d.size, MADV_HUGEPAGE);
      d.base = static_cast<char*>(p);
      if (advise_huge || st.st_blksize == (2 << 20)) d.page = 2 << 20;
    }
    close(fd);
    join.destinations.push_back(d);
  }
  DropPrivileges(user);
  const int landlock = sandbox ? RestrictFiles() : 0;
  join.ucx = StartUcx();
  SetHandler(join.ucx, kAmReply, &OnReply, &join);  // RestrictCalls() once connected
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
        Connect(join, head, buf.data() + sizeof head, landlock);
      } else if (kind == Kind::kRead && join.ep != nullptr && n == sizeof(Read)) {
        Read r;
        std::memcpy(&r, buf.data(), sizeof r);
        Ask(join, token, r);
      } else if (kind == Kind::kRelease && n == sizeof(struct Release)) {
        struct Release r;
        std::memcpy(&r, buf.data(), sizeof r);
        Release(join, r.destination);
      } else {
        Fail("unexpected control message");
      }
    }
  };
  Run(join.ucx, control);
}

// `weightd-peer-helper sandbox-check PATH [--user NAME]`, for tests: the
// same privilege drop and sandbox as a transfer, then every thing the
// sandbox forbids is tried once; prints `what=errno-name` lines (`ok` when
// allowed) and `landlock=ABI`.
int SandboxCheck(const std::string& path, const std::string& user) {
  DropPrivileges(user);
  int abi = RestrictFiles();
  // The checks run on a thread made before the seccomp filter, as UCX's
  // async thread is: the filter must cover it too.
  absl::Mutex mu;
  bool go = false;
  std::thread checker([&] {
    {
      absl::MutexLock lock(&mu);
      mu.Await(absl::Condition(&go));
    }
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
    std::printf("unshare_user=%s\n", result(unshare(CLONE_NEWUSER) == 0).c_str());
    std::printf("io_uring=%s\n", result(syscall(SYS_io_uring_setup, 1, nullptr) >= 0 || errno != EPERM).c_str());
    std::thread t([] {});  // threads can still be made (clone3 answers ENOSYS, glibc uses clone)
    t.join();
    std::printf("thread=ok\n");
    char* argv[] = {const_cast<char*>("/bin/true"), nullptr};
    std::printf("exec=%s\n", result(execv("/bin/true", argv) == 0).c_str());
  });
  RestrictCalls();
  {
    absl::MutexLock lock(&mu);
    go = true;
  }
  checker.join();
  return 0;
}

int Main(int argc, char** argv) {
  // weightd starts it through /proc/self/fd/N, which would name it "N" in ps.
  prctl(PR_SET_NAME, "wd-peer-helper", 0, 0, 0);
  std::vector<std::string> args(argv + 1, argv + argc);
  std::string user, test_fault;
  bool stall = false;
  bool sandbox = true;
  bool advise_huge = false;
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--user" && i + 1 < args.size()) {
      user = args[++i];
    } else if (args[i] == "--stall") {
      stall = true;
    } else if (args[i] == "--no-sandbox") {
      sandbox = false;
    } else if (args[i] == "--advise-huge") {
      advise_huge = true;
    } else if (args[i] == "--test-fault" && i + 1 < args.size()) {
      test_fault = args[++i];
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
  uint64_t piece_bytes = 0;
  uint32_t pieces = 0;
  if (positional.size() == 2 && positional[0] == "seed" && absl::SimpleAtoi(positional[1], &regions) &&
      regions <= (1u << 16)) {
    close_range(kFirstDataFd + regions, ~0u, 0);  // the executable's fd, and anything else inherited
    RunSeed(static_cast<int>(regions), user, stall, sandbox);
  }
  if (positional.size() == 4 && positional[0] == "join" && absl::SimpleAtoi(positional[1], &regions) &&
      regions <= (1u << 16) && absl::SimpleAtoi(positional[2], &piece_bytes) &&
      absl::SimpleAtoi(positional[3], &pieces) && piece_bytes > 0 && piece_bytes <= kMaxPieceBytes && pieces > 0 &&
      pieces <= kMaxSlots) {
    close_range(kFirstDataFd + regions, ~0u, 0);
    RunJoin(regions, piece_bytes, pieces, user, sandbox, advise_huge, test_fault);
  }
  Fail("usage: weightd-peer-helper seed N | join N PIECE_BYTES PIECES [--user NAME] [--stall] [--no-sandbox] "
       "[--advise-huge] [--test-fault keep-mapping|late-write]");
}

}  // namespace
}  // namespace weightd::peer_helper

int main(int argc, char** argv) { return weightd::peer_helper::Main(argc, argv); }
