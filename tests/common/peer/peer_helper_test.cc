// The UCX transport through real weightd-peer-helper processes, over TCP on
// the loopback device (UCX_TLS=tcp, UCX_NET_DEVICES=lo): the path two nodes
// use. Covers what a seed serves (only its regions, only to its token), how
// a joiner fails (deadline, seed gone), and what a helper runs with.
#include <dirent.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/peer/peer_transport.h"
#include "gtest/gtest.h"
#include "tests/testing/peer_destinations.h"
#include "tests/testing/process.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using std::chrono::steady_clock;

std::string ReadProc(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<pid_t> HelperChildren() { return testing::ChildrenNamed(getpid(), "wd-peer-helper"); }

class PeerHelperTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    setenv("UCX_NET_DEVICES", "lo", 1);
    setenv("WEIGHTD_TEST_SECRET", "not for helpers", 1);
    data_.resize(10 << 20);
    for (size_t i = 0; i < data_.size(); ++i) data_[i] = static_cast<char>((i * 131) ^ (i >> 13));
    fd_ = memfd_create("peer-helper-test", MFD_CLOEXEC);
    ASSERT_GE(fd_, 0);
    ASSERT_EQ(pwrite(fd_, data_.data(), data_.size(), 0), static_cast<ssize_t>(data_.size()));
    // Two of the region's size, one small.
    dest_ = std::make_unique<testing::PeerDestinations>(std::vector<uint64_t>{data_.size(), data_.size(), 1 << 20});
    WEIGHTD_ASSERT_OK_AND_ASSIGN(transport_, MakeUcxHelperTransport(Options()));
  }
  static UcxHelperOptions Options(const std::string& test_fault = "") {
    UcxHelperOptions options;
    options.helper_path = WEIGHTD_PEER_HELPER_PATH;
    options.piece_bytes = 1 << 20;  // a 10 MiB read is ten pieces, eight in flight
    options.pieces = 8;
    options.test_fault = test_fault;
    return options;
  }
  void TearDown() override { close(fd_); }

  std::unique_ptr<PeerExport> Export(bool stall = false, uint32_t senders = 1) {
    PeerExportOptions options;
    options.stall_for_test = stall;
    options.senders = senders;
    absl::StatusOr<std::unique_ptr<PeerExport>> e = transport_->Export({{fd_, data_.size()}}, options);
    EXPECT_TRUE(e.ok()) << e.status();
    return e.ok() ? std::move(*e) : nullptr;
  }
  std::unique_ptr<PeerConnection> Connect(const PeerOffer& offer, uint32_t lanes = 1) {
    absl::StatusOr<std::unique_ptr<PeerConnection>> c =
        transport_->Connect(offer, steady_clock::now() + seconds(30), dest_->Options(lanes));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  std::string data_;
  int fd_ = -1;
  std::unique_ptr<testing::PeerDestinations> dest_;
  std::unique_ptr<PeerTransport> transport_;
};

TEST_F(PeerHelperTest, ReadsRangesOfAnExportFromSeveralThreads) {
  EXPECT_EQ(transport_->name(), "ucx");
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(e->offer().region_sizes, std::vector<uint64_t>{data_.size()});
  EXPECT_EQ(e->offer().token.size(), kPeerTokenBytes);
  std::unique_ptr<PeerConnection> c = Connect(e->offer());
  ASSERT_NE(c, nullptr);
  WEIGHTD_ASSERT_OK(c->Read({{0, 0, data_.size(), 0, 0}, {0, 12345, 4097, 2, 100}}, steady_clock::now() + seconds(30)));
  EXPECT_TRUE(dest_->Bytes(0, 0, data_.size()) == data_);
  EXPECT_TRUE(dest_->Bytes(2, 100, 4097) == data_.substr(12345, 4097));
  EXPECT_EQ(dest_->Bytes(2, 0, 100), std::string(100, '\0'));  // nothing outside the range asked
  // Four threads at once share the eight pieces in flight.
  const uint64_t part = data_.size() / 4;
  std::vector<absl::Status> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      results[t] = c->Read({{0, t * part, part, 1, t * part}}, steady_clock::now() + seconds(30));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < 4; ++t) WEIGHTD_EXPECT_OK(results[t]);
  EXPECT_TRUE(dest_->Bytes(1, 0, data_.size()) == data_);
}

TEST_F(PeerHelperTest, TwoLanesAreTwoHelpersThatShareOneRead) {
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  std::unique_ptr<PeerConnection> c = Connect(e->offer(), /*lanes=*/2);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->lanes(), 2u);
  EXPECT_EQ(HelperChildren().size(), 3u);  // the seed's and two joiner lanes
  WEIGHTD_ASSERT_OK(c->Read({{0, 0, data_.size(), 0, 0}}, steady_clock::now() + seconds(30)));
  EXPECT_TRUE(dest_->Bytes(0, 0, data_.size()) == data_);
  c.reset();
  EXPECT_EQ(HelperChildren().size(), 1u);  // both lanes reaped
}

// Seed-side lanes: an export of 4 senders is 4 seed helpers, each with its
// own worker and token, and lane L of a 4-lane connection reads from sender
// L. A 10-piece read goes round the lanes (0, 1, 2, 3, 0, ...), so each
// sender counts exactly the pieces of its lane.
TEST_F(PeerHelperTest, EachLaneReadsFromASenderHelperOfItsOwn) {
  std::unique_ptr<PeerExport> e = Export(/*stall=*/false, /*senders=*/4);
  ASSERT_NE(e, nullptr);
  ASSERT_EQ(e->offer().senders(), 4u);
  EXPECT_EQ(HelperChildren().size(), 4u);
  for (uint32_t i = 1; i < 4; ++i) {
    EXPECT_NE(e->offer().sender(i).worker_address, e->offer().worker_address);
    EXPECT_NE(e->offer().sender(i).token, e->offer().token);
    EXPECT_EQ(e->offer().sender(i).token.size(), kPeerTokenBytes);
  }
  std::unique_ptr<PeerConnection> c = Connect(e->offer(), /*lanes=*/4);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(HelperChildren().size(), 8u);  // 4 seed senders, 4 joiner lanes
  WEIGHTD_ASSERT_OK(c->Read({{0, 0, data_.size(), 0, 0}}, steady_clock::now() + seconds(30)));
  EXPECT_TRUE(dest_->Bytes(0, 0, data_.size()) == data_);
  const uint64_t piece = Options().piece_bytes;
  const std::vector<uint64_t> expected = {3 * piece, 3 * piece, 2 * piece, 2 * piece};
  std::vector<uint64_t> sent;
  for (auto until = steady_clock::now() + seconds(5); steady_clock::now() < until;) {  // sends complete a moment later
    WEIGHTD_ASSERT_OK_AND_ASSIGN(sent, e->BytesSent(steady_clock::now() + seconds(5)));
    if (sent == expected) break;
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ(sent, expected);
}

TEST_F(PeerHelperTest, SenderCountsOutsideOneToEightAreRefused) {
  for (uint32_t senders : {0u, kMaxPeerLanes + 1}) {
    PeerExportOptions options;
    options.senders = senders;
    EXPECT_THAT(transport_->Export({{fd_, data_.size()}}, options),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         absl::StrCat(senders, " peer senders (must be 1..", kMaxPeerLanes, ")")));
  }
  EXPECT_TRUE(HelperChildren().empty());
}

// The rule the loader relies on: while a helper maps a destination, the
// kernel refuses to seal it; once released, the seal takes and no read
// into it is sent any more.
TEST_F(PeerHelperTest, DestinationSealsOnlyOnceEveryLaneReleasedIt) {
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  std::unique_ptr<PeerConnection> c = Connect(e->offer(), /*lanes=*/2);
  ASSERT_NE(c, nullptr);
  WEIGHTD_ASSERT_OK(c->Read({{0, 0, data_.size(), 0, 0}}, steady_clock::now() + seconds(30)));
  EXPECT_THAT(dest_->SealWrite(0), StatusIs(absl::StatusCode::kFailedPrecondition, "busy"));
  WEIGHTD_ASSERT_OK(c->Release(0, steady_clock::now() + seconds(10)));
  WEIGHTD_EXPECT_OK(dest_->SealWrite(0));
  EXPECT_TRUE(dest_->Bytes(0, 0, data_.size()) == data_);
  EXPECT_THAT(c->Read({{0, 0, 16, 0, 0}}, steady_clock::now() + seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument, "released"));
  EXPECT_THAT(c->Release(0, steady_clock::now() + seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument, "destination 0 is unknown or released"));
  EXPECT_THAT(dest_->SealWrite(1), StatusIs(absl::StatusCode::kFailedPrecondition, "busy"));  // still mapped
}

// Hostile helpers (test faults): a helper that keeps a writable mapping in
// a child it forked, and says it released, cannot get past the seal; one
// that writes a byte after reporting it done leaves bytes that only a hash
// taken after the seal can catch.
TEST_F(PeerHelperTest, HelperThatKeepsAMappingInAChildFailsTheSeal) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(transport_, MakeUcxHelperTransport(Options("keep-mapping")));
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  std::unique_ptr<PeerConnection> c = Connect(e->offer());
  ASSERT_NE(c, nullptr);
  WEIGHTD_ASSERT_OK(c->Read({{0, 0, data_.size(), 0, 0}}, steady_clock::now() + seconds(30)));
  WEIGHTD_ASSERT_OK(c->Release(0, steady_clock::now() + seconds(10)));  // a lie
  c.reset();  // the helper is killed and reaped; its child is not ours to reap
  EXPECT_THAT(dest_->SealWrite(0), StatusIs(absl::StatusCode::kFailedPrecondition, "busy"));
}

TEST_F(PeerHelperTest, HelperThatWritesAfterReportingDoneChangesExactlyOneByte) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(transport_, MakeUcxHelperTransport(Options("late-write")));
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  std::unique_ptr<PeerConnection> c = Connect(e->offer());
  ASSERT_NE(c, nullptr);
  WEIGHTD_ASSERT_OK(c->Read({{0, 0, data_.size(), 0, 0}}, steady_clock::now() + seconds(30)));
  EXPECT_TRUE(dest_->Bytes(0, 0, data_.size()) == data_);  // as reported
  WEIGHTD_ASSERT_OK(c->Release(0, steady_clock::now() + seconds(10)));
  WEIGHTD_ASSERT_OK(dest_->SealWrite(0));  // the mapping is gone: the seal takes, the bytes are fixed now
  std::string got = dest_->Bytes(0, 0, data_.size());
  size_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += got[i] != data_[i];
  EXPECT_EQ(differ, 1u);
}

TEST_F(PeerHelperTest, DestinationsThatCanBeResizedAreRefused) {
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  int fd = memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_EQ(ftruncate(fd, 4096), 0);
  PeerConnectOptions options;
  options.destinations.push_back({fd, 4096});
  EXPECT_THAT(transport_->Connect(e->offer(), steady_clock::now() + seconds(5), options),
              StatusIs(absl::StatusCode::kInvalidArgument, "peer destination 0 (fd"));
  options = dest_->Options();
  options.lanes = kMaxPeerLanes + 1;
  EXPECT_THAT(transport_->Connect(e->offer(), steady_clock::now() + seconds(5), options),
              StatusIs(absl::StatusCode::kInvalidArgument, "9 peer lanes (must be 1..8)"));
  close(fd);
  EXPECT_EQ(HelperChildren().size(), 1u);  // only the seed's
}

// Without UCX_TLS, the helpers leave out UCX's shared-memory transports
// (peers are other nodes, and the sandbox forbids their files).
TEST_F(PeerHelperTest, WorksWithoutUcxTlsSet) {
  unsetenv("UCX_TLS");  // UCX_NET_DEVICES=lo keeps it on loopback
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  std::unique_ptr<PeerConnection> c = Connect(e->offer());
  ASSERT_NE(c, nullptr);
  WEIGHTD_ASSERT_OK(c->Read({{0, 4096, 1 << 20, 2, 0}}, steady_clock::now() + seconds(30)));
  EXPECT_TRUE(dest_->Bytes(2, 0, 1 << 20) == data_.substr(4096, 1 << 20));
}

TEST_F(PeerHelperTest, ReadsOutsideTheRegionAreRefusedHereAndByTheSeed) {
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  {
    std::unique_ptr<PeerConnection> c = Connect(e->offer());
    EXPECT_THAT(c->Read({{0, data_.size() - 8, 16, 2, 0}}, steady_clock::now() + seconds(5)),
                StatusIs(absl::StatusCode::kInvalidArgument, "outside the peer's regions"));
    EXPECT_THAT(c->Read({{1, 0, 16, 2, 0}}, steady_clock::now() + seconds(5)),
                StatusIs(absl::StatusCode::kInvalidArgument, "region 1"));
    EXPECT_THAT(c->Read({{0, 0, 16, 2, (1 << 20) - 8}}, steady_clock::now() + seconds(5)),
                StatusIs(absl::StatusCode::kInvalidArgument, "of destination 2 is outside it"));
    EXPECT_THAT(c->Read({{0, 0, 16, 3, 0}}, steady_clock::now() + seconds(5)),
                StatusIs(absl::StatusCode::kInvalidArgument, "of destination 3"));
  }
  // An offer that claims more than the seed exports passes the joiner's own
  // check; the seed's helper refuses the read.
  PeerOffer lie = e->offer();
  lie.region_sizes[0] += 1 << 20;
  std::unique_ptr<PeerConnection> c = Connect(lie);
  EXPECT_THAT(c->Read({{0, data_.size() - 8, 16, 2, 0}}, steady_clock::now() + seconds(10)),
              StatusIs(absl::StatusCode::kInvalidArgument, "the seed refused a read outside its regions"));
}

TEST_F(PeerHelperTest, ReadsWithoutTheSessionTokenAreRefused) {
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  PeerOffer forged = e->offer();
  forged.token[0] ^= 1;
  std::unique_ptr<PeerConnection> c = Connect(forged);
  EXPECT_THAT(c->Read({{0, 0, 64, 2, 0}}, steady_clock::now() + seconds(10)),
              StatusIs(absl::StatusCode::kPermissionDenied, "the seed refused the session token"));
  EXPECT_EQ(dest_->Bytes(2, 0, 64), std::string(64, '\0'));
}

TEST_F(PeerHelperTest, StalledSeedEndsTheReadAtTheDeadline) {
  std::unique_ptr<PeerExport> e = Export(/*stall=*/true);
  ASSERT_NE(e, nullptr);
  std::unique_ptr<PeerConnection> c = Connect(e->offer());
  EXPECT_THAT(c->Read({{0, 0, data_.size(), 0, 0}}, steady_clock::now() + milliseconds(500)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, "deadline"));
  // The connection is broken from then on.
  EXPECT_THAT(c->Read({{0, 0, 16, 0, 0}}, steady_clock::now() + seconds(5)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, "deadline"));
  EXPECT_THAT(c->Release(0, steady_clock::now() + seconds(5)), StatusIs(absl::StatusCode::kDeadlineExceeded, "deadline"));
}

TEST_F(PeerHelperTest, SeedThatGoesAwayFailsTheRead) {
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  std::unique_ptr<PeerConnection> c = Connect(e->offer());
  WEIGHTD_ASSERT_OK(c->Read({{0, 0, 64, 2, 0}}, steady_clock::now() + seconds(30)));
  e.reset();  // the seed's helper is killed and reaped
  absl::Status st = c->Read({{0, 0, 64, 2, 0}}, steady_clock::now() + seconds(30));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
}

TEST_F(PeerHelperTest, MalformedOffersAreRefusedBeforeAnyHelperStarts) {
  PeerOffer offer{std::string(kMaxPeerWorkerAddressBytes + 1, 'x'), std::string(kPeerTokenBytes, 't'), {16}};
  EXPECT_THAT(transport_->Connect(offer, steady_clock::now() + seconds(5), dest_->Options()),
              StatusIs(absl::StatusCode::kInvalidArgument, "worker address"));
  offer.worker_address = "x";
  offer.token = "short";
  EXPECT_THAT(transport_->Connect(offer, steady_clock::now() + seconds(5), dest_->Options()),
              StatusIs(absl::StatusCode::kInvalidArgument, "session token of 5 bytes"));
  offer.token = std::string(kPeerTokenBytes, 't');
  offer.more_senders.assign(kMaxPeerLanes, {"x", std::string(kPeerTokenBytes, 't')});  // 9 senders in all
  EXPECT_THAT(transport_->Connect(offer, steady_clock::now() + seconds(5), dest_->Options()),
              StatusIs(absl::StatusCode::kInvalidArgument, "the peer offers 9 senders, at most 8"));
  offer.more_senders = {{"x", "short"}};
  EXPECT_THAT(transport_->Connect(offer, steady_clock::now() + seconds(5), dest_->Options()),
              StatusIs(absl::StatusCode::kInvalidArgument, "session token of 5 bytes (must be 16) of sender 1"));
  offer.more_senders.clear();
  offer.region_sizes.assign(kMaxPeerRegions + 1, 1);
  EXPECT_THAT(transport_->Connect(offer, steady_clock::now() + seconds(5), dest_->Options()),
              StatusIs(absl::StatusCode::kInvalidArgument, "regions, at most"));
  EXPECT_TRUE(HelperChildren().empty());
}

TEST_F(PeerHelperTest, GarbageWorkerAddressFailsInTheHelperNotHere) {
  // UCX aborts on an address it cannot unpack (ucp_address_unpack): that
  // kills the joiner's helper, not this process.
  PeerOffer offer{std::string(300, '\x7f'), std::string(kPeerTokenBytes, 't'), {16}};
  EXPECT_THAT(transport_->Connect(offer, steady_clock::now() + seconds(10), dest_->Options()),
              StatusIs(absl::StatusCode::kUnavailable, "the peer helper ended (killed by signal 6"));
  EXPECT_TRUE(HelperChildren().empty());
}

TEST_F(PeerHelperTest, HelperRunsWithoutPrivilegesSecretsOrTheDaemonsFiles) {
  std::unique_ptr<PeerExport> e = Export();
  ASSERT_NE(e, nullptr);
  std::vector<int> pids = HelperChildren();
  ASSERT_EQ(pids.size(), 1u);
  std::string status = ReadProc(absl::StrCat("/proc/", pids[0], "/status"));
  EXPECT_TRUE(absl::StrContains(status, "NoNewPrivs:\t1")) << status;
  if (geteuid() == 0) {
    EXPECT_TRUE(absl::StrContains(status, "\nUid:\t65534\t65534\t65534\t65534\n")) << status;
    EXPECT_TRUE(absl::StrContains(status, "\nGroups:\t \n")) << status;
  } else {
    GTEST_LOG_(INFO) << "not root: the helper keeps this user, so the switch to 'nobody' is not checked here";
  }
  // Only UCX_* variables reach it.
  std::string environ = ReadProc(absl::StrCat("/proc/", pids[0], "/environ"));
  for (absl::string_view var : absl::StrSplit(environ, '\0', absl::SkipEmpty())) {
    EXPECT_TRUE(absl::StartsWith(var, "UCX_")) << var;
  }
  EXPECT_TRUE(absl::StrContains(environ, "UCX_TLS=tcp"));
  // It keeps the region mapped, not open, and none of this process's files.
  DIR* d = opendir(absl::StrCat("/proc/", pids[0], "/fd").c_str());
  ASSERT_NE(d, nullptr) << "cannot list the helper's fds";
  {
    while (dirent* f = readdir(d)) {
      char target[256] = {};
      readlink(absl::StrCat("/proc/", pids[0], "/fd/", f->d_name).c_str(), target, sizeof target - 1);
      EXPECT_FALSE(absl::StrContains(target, "memfd:")) << f->d_name << " -> " << target;
      EXPECT_FALSE(absl::StrContains(target, "peer_helper_test")) << f->d_name << " -> " << target;
    }
    closedir(d);
  }
  EXPECT_TRUE(absl::StrContains(ReadProc(absl::StrCat("/proc/", pids[0], "/maps")), "memfd:peer-helper-test"));
  e.reset();
  EXPECT_TRUE(HelperChildren().empty());  // reaped, no zombie left
}

TEST_F(PeerHelperTest, UnknownHelperUserIsRefusedWhenTheTransportIsMade) {
  if (geteuid() != 0) GTEST_SKIP() << "not root: helpers switch users only when started by root";
  UcxHelperOptions options;
  options.helper_path = WEIGHTD_PEER_HELPER_PATH;
  options.user = "no-such-weightd-user";
  EXPECT_THAT(MakeUcxHelperTransport(options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "no user 'no-such-weightd-user' to run the peer helpers as (--peer-helper-user)"));
}

// The sandbox a helper enters around UCX, checked from inside, from a
// thread made before the seccomp filter (as UCX's async thread is): every
// forbidden thing is tried once (weightd-peer-helper sandbox-check).
TEST(PeerHelperSandbox, ForbidsFilesOtherProcessesUnixSocketsAndExec) {
  testing::CommandResult r = testing::RunCommand({WEIGHTD_PEER_HELPER_PATH, "sandbox-check", "/etc/passwd"});
  ASSERT_EQ(r.code, 0) << r.err;
  std::map<std::string, std::string> got;
  for (absl::string_view line : absl::StrSplit(r.out, '\n', absl::SkipEmpty())) {
    std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
    got.insert(kv);
  }
  EXPECT_EQ(got["socket_unix"], "EPERM");
  EXPECT_EQ(got["kill_parent"], "EPERM");
  EXPECT_EQ(got["ptrace_parent"], "EPERM");
  EXPECT_EQ(got["vm_read_parent"], "EPERM");
  EXPECT_EQ(got["exec"], "EPERM");
  EXPECT_EQ(got["unshare_user"], "EPERM");
  EXPECT_EQ(got["io_uring"], "EPERM");
  EXPECT_EQ(got["thread"], "ok");  // clone3 answers ENOSYS; glibc falls back to clone
  EXPECT_EQ(got["socket_inet"], "ok");  // what UCX over TCP needs
  EXPECT_EQ(got["kill_self"], "ok");    // abort() signals itself
  int landlock = 0;
  ASSERT_TRUE(absl::SimpleAtoi(got["landlock"], &landlock)) << r.out;
  if (landlock >= 1) {
    EXPECT_EQ(got["open"], "EACCES");
  } else {
    GTEST_LOG_(INFO) << "this kernel has no Landlock: file access is not restricted here";
  }
}

// Helpers that keep the daemon's uid must not be able to open its memory:
// the process that makes the transport becomes non-dumpable.
TEST(PeerHelperTransport, DaemonWhoseHelpersKeepItsUidBecomesNonDumpable) {
  ASSERT_EQ(prctl(PR_GET_DUMPABLE), 1);
  UcxHelperOptions options;
  options.helper_path = WEIGHTD_PEER_HELPER_PATH;
  options.user = geteuid() == 0 ? "nobody" : "";
  if (geteuid() == 0) {
    WEIGHTD_ASSERT_OK(MakeUcxHelperTransport(options).status());
    EXPECT_EQ(prctl(PR_GET_DUMPABLE), 1);  // root, helpers as nobody: nothing to guard against
  }
  options.user = "";
  WEIGHTD_ASSERT_OK(MakeUcxHelperTransport(options).status());
  EXPECT_EQ(prctl(PR_GET_DUMPABLE), 0);
  prctl(PR_SET_DUMPABLE, 1);
}

TEST(PeerHelperTransport, MissingOrNonExecutableHelperIsNamed) {
  UcxHelperOptions options;
  options.helper_path = "/nonexistent/weightd-peer-helper";
  EXPECT_THAT(MakeUcxHelperTransport(options), StatusIs(absl::StatusCode::kNotFound, "/nonexistent/weightd-peer-helper"));
  options.helper_path = "/etc/passwd";  // 0644
  EXPECT_THAT(MakeUcxHelperTransport(options), StatusIs(absl::StatusCode::kInvalidArgument, "not an executable file"));
}

}  // namespace
}  // namespace weightd
