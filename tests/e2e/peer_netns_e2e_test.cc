// Peer seeding between two network namespaces joined by a veth pair, as
// between two nodes: the seed and the joiner share no loopback and no
// interface, and UCX runs over the veth (UCX_TLS=tcp, UCX_NET_DEVICES=<veth>).
// The test makes the namespaces itself, so it needs root and `ip`; without
// them it skips. Their addresses exist only inside them, with no route out.
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::DaemonProcess;

constexpr char kModel[] = "m";

std::string IpBinary() {
  for (const char* path : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (access(path, X_OK) == 0) return path;
  }
  return "";
}

// Namespaces A and B, named after this process, joined by a veth pair made
// inside them (so none is ever left in the caller's namespace), with lo up.
// The destructor deletes the namespaces, which deletes the veth; processes
// still inside keep theirs alive until they exit. One thread.
class NetnsPair {
 public:
  struct Side {
    std::string ns, veth, ip;
  };

  // The first `ip` command that failed, with its output, as the error.
  static absl::StatusOr<std::unique_ptr<NetnsPair>> Create() {
    std::string ip = IpBinary();
    if (ip.empty()) return absl::FailedPreconditionError("no `ip` binary in /usr/sbin, /sbin, /usr/bin or /bin");
    std::string pid = std::to_string(getpid());
    // The addresses live only in this pair's namespaces: concurrent tests
    // cannot collide on them, and nothing outside can reach or be reached.
    auto side = [&](const std::string& x, const char* address) {
      return Side{"weightd-test-" + pid + "-" + x, "wd" + pid + x, address};
    };
    std::unique_ptr<NetnsPair> pair(new NetnsPair(ip, side("a", "10.231.0.1"), side("b", "10.231.0.2")));
    WEIGHTD_RETURN_IF_ERROR(pair->Build());
    return pair;
  }
  ~NetnsPair() {
    for (const std::string& ns : made_) testing::RunCommand({ip_, "netns", "del", ns});
  }

  const Side& a() const { return a_; }
  const Side& b() const { return b_; }
  // `argv` run in `side`'s namespace, with UCX on its veth only. `ip netns
  // exec` execs (the pid is argv's) and remounts /sys, where UCX looks for
  // the namespace's interfaces.
  std::vector<std::string> In(const Side& side, const std::vector<std::string>& argv = {}) const {
    std::vector<std::string> out = {
        ip_, "netns", "exec", side.ns, "env", "UCX_TLS=tcp", "UCX_NET_DEVICES=" + side.veth};
    out.insert(out.end(), argv.begin(), argv.end());
    return out;
  }

 private:
  NetnsPair(std::string ip, Side a, Side b) : ip_(std::move(ip)), a_(std::move(a)), b_(std::move(b)) {}

  absl::Status Build() {
    for (const Side* s : {&a_, &b_}) {
      // A namespace of this name is left by a killed run whose pid we now have.
      testing::RunCommand({ip_, "netns", "del", s->ns});
      WEIGHTD_RETURN_IF_ERROR(Ip({"netns", "add", s->ns}));
      made_.push_back(s->ns);
    }
    WEIGHTD_RETURN_IF_ERROR(
        Ip({"-n", a_.ns, "link", "add", a_.veth, "type", "veth", "peer", "name", b_.veth, "netns", b_.ns}));
    for (const Side* s : {&a_, &b_}) {
      WEIGHTD_RETURN_IF_ERROR(Ip({"-n", s->ns, "addr", "add", s->ip + "/24", "dev", s->veth}));
      WEIGHTD_RETURN_IF_ERROR(Ip({"-n", s->ns, "link", "set", "lo", "up"}));
      WEIGHTD_RETURN_IF_ERROR(Ip({"-n", s->ns, "link", "set", s->veth, "up"}));
    }
    for (const Side* s : {&a_, &b_}) WEIGHTD_RETURN_IF_ERROR(AwaitRunning(*s));
    // What the daemons are started with; it also mounts, which a container may refuse.
    return Run(In(a_, {"true"}));
  }
  // The kernel sets IFF_RUNNING (operstate UP) a while after `link set up`
  // (up to a second, batched); UCX passes over an interface without it and
  // the helper's ucp_init fails with "No such device".
  absl::Status AwaitRunning(const Side& s) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    std::vector<std::string> show = {ip_, "-n", s.ns, "-o", "link", "show", "dev", s.veth};
    CommandResult r = testing::RunCommand(show);
    while (r.out.find(" state UP ") == std::string::npos && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      r = testing::RunCommand(show);
    }
    if (r.out.find(" state UP ") != std::string::npos) return absl::OkStatus();
    return absl::DeadlineExceededError(absl::StrCat(s.veth, " in ", s.ns, " is not running after 5 s: ", r.out, r.err));
  }
  absl::Status Ip(std::vector<std::string> args) {
    args.insert(args.begin(), ip_);
    return Run(args);
  }
  static absl::Status Run(const std::vector<std::string>& argv) {
    CommandResult r = testing::RunCommand(argv);
    if (r.code == 0) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("`", absl::StrJoin(argv, " "), "` exited ", r.code, ": ",
                                                      absl::StripTrailingAsciiWhitespace(r.err)));
  }

  std::string ip_;
  Side a_, b_;
  std::vector<std::string> made_;  // namespaces to delete
};

class PeerNetnsE2e : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces (euid " << geteuid() << ")";
    absl::StatusOr<std::unique_ptr<NetnsPair>> net = NetnsPair::Create();
    if (!net.ok()) GTEST_SKIP() << "cannot make two network namespaces joined by a veth: " << net.status().message();
    net_ = *std::move(net);
  }

  // A daemon in `side`'s namespace with the tiny demo checkpoint under its
  // model root. Its socket is a path, reachable from this namespace.
  std::unique_ptr<DaemonProcess> Node(const NetnsPair::Side& side, std::vector<std::string> extra = {}) {
    extra.insert(extra.end(), {"--mlock", "false"});
    auto d = std::make_unique<DaemonProcess>(extra, net_->In(side));
    CommandResult demo = d->Ctl({"make-demo", d->models_dir() + "/demo", "--preset", "tiny"});
    EXPECT_EQ(demo.code, 0) << demo.err << d->process().Stderr();
    return d;
  }
  static void ExpectVerifies(DaemonProcess& d) {
    CommandResult attach = d.Ctl({"attach", kModel, "--verify", d.models_dir() + "/demo", "--json"});
    ASSERT_EQ(attach.code, 0) << attach.err;
    EXPECT_EQ(json::parse(attach.out)["verified"], true);
  }

  std::unique_ptr<NetnsPair> net_;  // outlives the daemons, which are the tests' locals
};

TEST_F(PeerNetnsE2e, JoinerSeedsFromThePeerAcrossTheVethAndVerifies) {
  auto seed = Node(net_->a(), {"--peer-address", net_->a().ip + ":0"});
  auto joiner = Node(net_->b());
  ASSERT_EQ(seed->Ctl({"load", kModel, "demo"}).code, 0) << seed->process().Stderr();
  int port = seed->LoggedPort("peer listener on ", net_->a().ip);
  ASSERT_GT(port, 0) << seed->process().Stderr();
  std::string peer = absl::StrCat(net_->a().ip, ":", port);

  CommandResult load = joiner->Ctl({"load", kModel, "demo", "--peer", peer, "--json"});
  ASSERT_EQ(load.code, 0) << load.err << joiner->process().Stderr();
  json seeded = json::parse(load.out);
  EXPECT_EQ(seeded["source"], "peer " + peer) << joiner->process().Stderr();
  EXPECT_EQ(seeded["fingerprint"], json::parse(seed->Ctl({"ls", "--json"}).out)["models"][0]["fingerprint"]);
  ExpectVerifies(*joiner);
}

TEST_F(PeerNetnsE2e, SeedOnlyOnItsOwnLoopbackIsUnavailableToTheJoinerWhichLoadsFromStorage) {
  auto seed = Node(net_->a(), {"--peer-address", "127.0.0.1:0"});
  auto joiner = Node(net_->b());
  ASSERT_EQ(seed->Ctl({"load", kModel, "demo"}).code, 0) << seed->process().Stderr();
  int port = seed->LoggedPort("peer listener on ");
  ASSERT_GT(port, 0) << seed->process().Stderr();
  std::string peer = absl::StrCat("127.0.0.1:", port);
  // The seed answers there from inside its namespace...
  CommandResult health =
      testing::RunCommand(net_->In(net_->a(), {testing::WeightctlBinary(), "--socket", peer, "health"}));
  ASSERT_EQ(health.out, "SERVING\n") << health.err;

  // ...but 127.0.0.1 in the joiner's namespace is the joiner's own loopback.
  CommandResult load = joiner->Ctl({"load", kModel, "demo", "--peer", peer, "--json"});
  ASSERT_EQ(load.code, 0) << load.err << joiner->process().Stderr();
  EXPECT_EQ(json::parse(load.out)["source"], "storage");
  EXPECT_NE(joiner->process().Stderr().find("peer " + peer + " did not seed 'm' (unavailable)"), std::string::npos)
      << joiner->process().Stderr();
  ExpectVerifies(*joiner);
}

}  // namespace
}  // namespace weightd
