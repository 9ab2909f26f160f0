// End-to-end peer seeding (issue 16): real weightd processes on one
// machine seed each other over real UCX, on loopback TCP only. The test
// sets UCX_TLS=tcp and UCX_NET_DEVICES=lo for the daemons it starts, so
// UCX takes the network path (not shared memory) as between two nodes.
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <regex>
#include <cstdlib>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/scoped_fd.h"
#include "common/peer/peer_transport.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/pki.h"
#include "tests/testing/process.h"
#include "tests/testing/scrape.h"
#include "tests/testing/shared_inputs.h"
#include "weightd/v1/peer.grpc.pb.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::DaemonProcess;

constexpr char kModel[] = "m";

class PeerE2e : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);  // inherited by the daemons this test starts
    setenv("UCX_NET_DEVICES", "lo", 1);
  }

  // A daemon serving peers on a loopback port, with metrics, and the tiny
  // demo checkpoint (identical bytes on every "node") under its model root.
  std::unique_ptr<DaemonProcess> Node(std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--peer-address", "127.0.0.1:0", "--metrics-address", "127.0.0.1:0",
                                     "--mlock", "false"};
    args.insert(args.end(), extra.begin(), extra.end());
    auto d = std::make_unique<DaemonProcess>(args);
    CommandResult demo = d->Ctl({"make-demo", d->models_dir() + "/demo", "--preset", "tiny"});
    EXPECT_EQ(demo.code, 0) << demo.err;
    return d;
  }
  static std::string PeerOf(DaemonProcess& d) {
    int port = d.LoggedPort("peer listener on ");
    EXPECT_GT(port, 0) << d.process().Stderr();
    return absl::StrCat("127.0.0.1:", port);
  }
  static json Ls(DaemonProcess& d) {
    CommandResult ls = d.Ctl({"ls", "--json"});
    EXPECT_EQ(ls.code, 0) << ls.err;
    return json::parse(ls.out)["models"][0];
  }
  static double Metric(DaemonProcess& d, const std::string& series) {
    absl::StatusOr<std::string> body = testing::HttpGet(d.LoggedPort("metrics on http://"), "/metrics");
    if (!body.ok()) return -1;
    return testing::SampleValue(*body, series).value_or(-1);
  }
  // Polls until `series` of `d` reads `value` (20 s at most).
  static bool AwaitMetric(DaemonProcess& d, const std::string& series, double value) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < deadline) {
      if (Metric(d, series) == value) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }
  // A transfer session opened by hand, as a joiner that then holds it.
  struct Session {
    std::unique_ptr<v1::Peer::Stub> stub;
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientReaderWriter<v1::PeerTransferRequest, v1::PeerTransferReply>> stream;
    v1::PeerTransferReply reply;
    bool opened = false;  // the seed described its generation
  };
  static std::unique_ptr<Session> OpenSession(DaemonProcess& seed, uint32_t lanes = 0) {
    auto s = std::make_unique<Session>();
    s->stub = v1::Peer::NewStub(grpc::CreateChannel(PeerOf(seed), grpc::InsecureChannelCredentials()));
    s->stream = s->stub->Transfer(&s->context);
    v1::PeerTransferRequest ask;
    ask.set_name(kModel);
    ask.set_lanes(lanes);
    s->opened = s->stream->Write(ask) && s->stream->Read(&s->reply);
    return s;
  }
  static void ExpectVerifies(DaemonProcess& d) {
    CommandResult attach = d.Ctl({"attach", kModel, "--verify", d.models_dir() + "/demo", "--json"});
    ASSERT_EQ(attach.code, 0) << attach.err;
    EXPECT_EQ(json::parse(attach.out)["verified"], true);
  }

  // Loads the model on `joiner` from `seed`, which serves it: the joiner's
  // copy came from that peer, has the seed's fingerprint and verifies
  // against the files.
  static void ExpectSeededFrom(DaemonProcess& seed, DaemonProcess& joiner) {
    std::string peer = PeerOf(seed);
    CommandResult load = joiner.Ctl({"load", kModel, "demo", "--peer", peer});
    ASSERT_EQ(load.code, 0) << load.err << joiner.process().Stderr();
    EXPECT_EQ(Ls(joiner)["source"], "peer " + peer);
    EXPECT_EQ(Ls(joiner)["fingerprint"], Ls(seed)["fingerprint"]);
    ExpectVerifies(joiner);
  }

  // Loads the model on a joiner whose transfer helper runs `fault`
  // (--peer-test-fault), seeded by a node that serves it: the joiner gives
  // the peer up for `reason` and ends READY from storage with verified
  // bytes. Returns the joiner's log.
  std::string ExpectStorageServesDespiteTheHelper(const std::string& fault, const std::string& reason,
                                                  const std::string& verify = "per-segment") {
    auto a = Node(), b = Node({"--peer-test-fault", fault, "--peer-verify", verify});
    EXPECT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
    std::string peer = PeerOf(*a);
    CommandResult load = b->Ctl({"load", kModel, "demo", "--peer", peer});
    EXPECT_EQ(load.code, 0) << load.err << b->process().Stderr();
    EXPECT_EQ(Ls(*b)["state"], "READY");
    EXPECT_EQ(Ls(*b)["source"], "storage");
    EXPECT_EQ(Ls(*b)["fingerprint"], Ls(*a)["fingerprint"]);
    ExpectVerifies(*b);
    std::string log = b->process().Stderr();
    EXPECT_NE(log.find("peer " + peer + " did not seed 'm' (" + reason + "): "), std::string::npos) << log;
    EXPECT_EQ(Metric(*b, "weightd_peer_fallbacks_total{reason=\"" + reason + "\"}"), 1);
    return log;
  }
};

TEST_F(PeerE2e, ChainSeedsEachNodeFromThePreviousAndVerifies) {
  auto a = Node(), b = Node(), c = Node();
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  json from_storage = Ls(*a);
  EXPECT_EQ(from_storage["source"], "storage");

  CommandResult load_b = b->Ctl({"load", kModel, "demo", "--peer", PeerOf(*a), "--json"});
  ASSERT_EQ(load_b.code, 0) << load_b.err << b->process().Stderr();
  json seeded = Ls(*b);
  EXPECT_EQ(seeded["state"], "READY");
  EXPECT_EQ(seeded["source"], "peer " + PeerOf(*a));
  EXPECT_EQ(seeded["fingerprint"], from_storage["fingerprint"]);
  ExpectVerifies(*b);
  uint64_t host_bytes = seeded["host_bytes"];
  EXPECT_EQ(Metric(*b, absl::StrCat("weightd_peer_bytes_received_total{peer=\"", PeerOf(*a), "\"}")),
            static_cast<double>(host_bytes));
  EXPECT_TRUE(AwaitMetric(*a, "weightd_peer_joiners", 0));
  // The seed counts what its own helper sent, once the session has ended.
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  std::string joiner = std::string(host).substr(0, 64);
  EXPECT_EQ(Metric(*a, absl::StrCat("weightd_peer_bytes_sent_total{peer=\"", joiner, "\"}")),
            static_cast<double>(host_bytes));
  EXPECT_NE(a->process().Stderr().find(absl::StrCat("peer ", joiner, " ended its transfer of 'm' generation 1: this seed sent ",
                                                    host_bytes, " bytes (by sender: ", host_bytes,
                                                    "); the joiner reports it read ", host_bytes,
                                                    " bytes, verified (its claim)")),
            std::string::npos)
      << a->process().Stderr();

  // Fan-out: B, seeded, is a seed in turn.
  CommandResult load_c = c->Ctl({"load", kModel, "demo", "--peer", PeerOf(*b)});
  ASSERT_EQ(load_c.code, 0) << load_c.err << c->process().Stderr();
  EXPECT_EQ(Ls(*c)["source"], "peer " + PeerOf(*b));
  EXPECT_EQ(Ls(*c)["fingerprint"], from_storage["fingerprint"]);
  ExpectVerifies(*c);
}

TEST_F(PeerE2e, SeedKilledMidTransferFallsBackToStorage) {
  auto a = Node({"--peer-test-fault", "stall"}), b = Node();
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  std::string peer = PeerOf(*a);
  testing::TempDir out;
  testing::Process load(b->CtlArgv({"load", kModel, "demo", "--peer", peer}), out.path());
  ASSERT_TRUE(AwaitMetric(*a, "weightd_peer_joiners", 1)) << a->process().Stderr();
  // The joiner has the seed's description once its transfer helper runs.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (testing::ChildrenNamed(b->pid(), "wd-peer-helper").empty() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(testing::ChildrenNamed(b->pid(), "wd-peer-helper").size(), 1u) << b->process().Stderr();
  a->process().Signal(SIGKILL);  // the seed dies with the transfer stalled half-way
  ASSERT_EQ(load.Wait(), 0) << load.Stderr() << b->process().Stderr();
  EXPECT_EQ(Ls(*b)["source"], "storage");
  ExpectVerifies(*b);
  EXPECT_NE(b->process().Stderr().find("peer " + peer + " did not seed 'm' (transfer_failed)"), std::string::npos)
      << b->process().Stderr();
  EXPECT_EQ(Metric(*b, "weightd_peer_fallbacks_total{reason=\"transfer_failed\"}"), 1);
}

TEST_F(PeerE2e, CorruptedByteIsCaughtByTheHashAndRefused) {
  auto a = Node({"--peer-test-fault", "corrupt"}), b = Node();
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  std::string peer = PeerOf(*a);
  CommandResult load = b->Ctl({"load", kModel, "demo", "--peer", peer});
  ASSERT_EQ(load.code, 0) << load.err << b->process().Stderr();
  EXPECT_EQ(Ls(*b)["source"], "storage");
  EXPECT_EQ(Ls(*b)["fingerprint"], Ls(*a)["fingerprint"]);
  ExpectVerifies(*b);
  EXPECT_NE(b->process().Stderr().find("peer " + peer + " did not seed 'm' (hash_mismatch)"), std::string::npos)
      << b->process().Stderr();
  EXPECT_EQ(Metric(*b, "weightd_peer_fallbacks_total{reason=\"hash_mismatch\"}"), 1);
  EXPECT_TRUE(AwaitMetric(*a, "weightd_peer_joiners", 0));
  EXPECT_NE(a->process().Stderr().find("NOT verified"), std::string::npos) << a->process().Stderr();
}

// The joiner's own transfer helper, taken over (test faults of
// weightd-peer-helper): one that leaves a writable mapping of a received
// segment in a child it forked cannot get past the seal; one that writes a
// byte after reporting its reads done cannot get past the hashes taken
// after the seal. Either way the node ends READY from storage, verified.
TEST_F(PeerE2e, JoinerHelperThatKeepsAWritableMappingFailsTheSealAndStorageServes) {
  std::string log = ExpectStorageServesDespiteTheHelper("helper-keeps-mapping", "seal_refused");
  EXPECT_NE(log.find("F_SEAL_WRITE refused with EBUSY"), std::string::npos) << log;
}

TEST_F(PeerE2e, JoinerHelperThatWritesAfterItsReadsFailsTheHashAndStorageServes) {
  ExpectStorageServesDespiteTheHelper("helper-writes-late", "hash_mismatch");
}

// --peer-verify per-transfer: the same checks, all after the last byte.
TEST_F(PeerE2e, JoinerHelperThatWritesAfterItsReadsFailsTheHashPerTransferToo) {
  ExpectStorageServesDespiteTheHelper("helper-writes-late", "hash_mismatch", "per-transfer");
}

// Seed-side lanes: a joiner with 2 lanes is answered by 2 sender helpers of
// the seed, each of which sends part of the bytes; together exactly the
// host bytes the joiner received.
TEST_F(PeerE2e, SeedsOverSeveralLanesEachServedByASenderOfItsOwn) {
  auto a = Node(), b = Node({"--peer-lanes", "2"});
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  ASSERT_NO_FATAL_FAILURE(ExpectSeededFrom(*a, *b));
  EXPECT_NE(b->process().Stderr().find("over 2 lane(s), received into the segments, "), std::string::npos)
      << b->process().Stderr();
  EXPECT_NE(b->process().Stderr().find(", hashed per segment, "), std::string::npos) << b->process().Stderr();
  ASSERT_TRUE(AwaitMetric(*a, "weightd_peer_joiners", 0));
  const std::string log = a->process().Stderr();
  EXPECT_NE(log.find(" (" + std::to_string(Ls(*a)["host_bytes"].get<uint64_t>()) +
                     " host bytes) over 2 lane(s), served by 2 sender(s)"),
            std::string::npos)
      << log;
  uint64_t sent = 0, first = 0, second = 0;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex(R"(this seed sent (\d+) bytes \(by sender: (\d+) \+ (\d+)\))")))
      << log;
  ASSERT_TRUE(absl::SimpleAtoi(m[1].str(), &sent) && absl::SimpleAtoi(m[2].str(), &first) &&
              absl::SimpleAtoi(m[3].str(), &second));
  EXPECT_EQ(sent, Ls(*b)["host_bytes"].get<uint64_t>());
  EXPECT_EQ(first + second, sent);
  EXPECT_GT(first, 0u);
  EXPECT_GT(second, 0u);
}

TEST_F(PeerE2e, SeedsWithHashingPerTransferAndVerifies) {
  auto a = Node(), b = Node({"--peer-verify", "per-transfer"});
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  ASSERT_NO_FATAL_FAILURE(ExpectSeededFrom(*a, *b));
  EXPECT_NE(b->process().Stderr().find(", hashed per transfer, "), std::string::npos) << b->process().Stderr();
}

// A joiner's lane count is bounded: more than kMaxPeerLanes is refused with
// one clear error, no helper starts, and the seed goes on serving.
TEST_F(PeerE2e, JoinerAskingForMoreThanEightLanesIsRefused) {
  auto a = Node();
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  std::unique_ptr<Session> greedy = OpenSession(*a, kMaxPeerLanes + 1);
  EXPECT_FALSE(greedy->opened);
  grpc::Status st = greedy->stream->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(st.error_message(), "the joiner asks for 9 lanes, at most 8 (--peer-lanes)");
  EXPECT_TRUE(AwaitMetric(*a, "weightd_peer_joiners", 0));
  std::unique_ptr<Session> fair = OpenSession(*a, 3);
  ASSERT_TRUE(fair->opened) << a->process().Stderr();
  EXPECT_EQ(fair->reply.more_senders_size(), 2);
  EXPECT_EQ(Ls(*a)["state"], "READY");
}

TEST_F(PeerE2e, SeedAtItsJoinerLimitSendsTheJoinerToTheNextPeer) {
  auto full = Node({"--peer-max-joiners", "1"}), other = Node(), b = Node();
  ASSERT_EQ(full->Ctl({"load", kModel, "demo"}).code, 0);
  ASSERT_EQ(other->Ctl({"load", kModel, "demo"}).code, 0);
  // Another joiner holds the only session of `full`.
  std::unique_ptr<Session> holder = OpenSession(*full);
  ASSERT_TRUE(holder->opened);
  EXPECT_EQ(holder->reply.model(), kModel);
  EXPECT_EQ(Metric(*full, "weightd_peer_joiners"), 1);

  CommandResult load = b->Ctl({"load", kModel, "demo", "--peer", PeerOf(*full), "--peer", PeerOf(*other)});
  ASSERT_EQ(load.code, 0) << load.err << b->process().Stderr();
  EXPECT_EQ(Ls(*b)["source"], "peer " + PeerOf(*other));
  ExpectVerifies(*b);
  EXPECT_NE(b->process().Stderr().find("peer " + PeerOf(*full) + " did not seed 'm' (unavailable)"),
            std::string::npos)
      << b->process().Stderr();
  holder->context.TryCancel();
  (void)holder->stream->Finish();
  EXPECT_TRUE(AwaitMetric(*full, "weightd_peer_joiners", 0));
}

// A joiner's report of what it read is its claim: a seed's bytes-sent
// counter and log line say what the seed's helper sent.
TEST_F(PeerE2e, SeedCountsWhatItSentNotWhatTheJoinerClaims) {
  auto a = Node();
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  std::unique_ptr<Session> session = OpenSession(*a);
  ASSERT_TRUE(session->opened) << a->process().Stderr();
  v1::PeerTransferRequest done;
  done.set_done(true);
  done.set_bytes_read(UINT64_MAX);  // read nothing, claim everything
  done.set_verified(true);
  ASSERT_TRUE(session->stream->Write(done));
  session->stream->WritesDone();
  v1::PeerTransferReply ignored;
  while (session->stream->Read(&ignored)) {
  }
  EXPECT_TRUE(session->stream->Finish().ok());
  ASSERT_TRUE(AwaitMetric(*a, "weightd_peer_joiners", 0));
  EXPECT_EQ(Metric(*a, "weightd_peer_bytes_sent_total{peer=\"unnamed\"}"), 0);
  EXPECT_NE(a->process().Stderr().find("peer unnamed ended its transfer of 'm' generation 1: this seed sent 0 bytes (by sender: 0); "
                                       "the joiner reports it read 18446744073709551615 bytes, verified (its claim)"),
            std::string::npos)
      << a->process().Stderr();
}

TEST_F(PeerE2e, UnloadDrainsUntilTheTransferSessionEnds) {
  auto a = Node();
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  std::unique_ptr<Session> session = OpenSession(*a);
  ASSERT_TRUE(session->opened);
  CommandResult unload = a->Ctl({"unload", kModel});
  ASSERT_EQ(unload.code, 0) << unload.err;
  EXPECT_EQ(Ls(*a)["state"], "DRAINING");
  v1::PeerTransferRequest done;
  done.set_done(true);
  ASSERT_TRUE(session->stream->Write(done));
  session->stream->WritesDone();
  EXPECT_TRUE(session->stream->Finish().ok());
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline && json::parse(a->Ctl({"ls", "--json"}).out)["models"].size() > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(json::parse(a->Ctl({"ls", "--json"}).out)["models"].size(), 0u);
}

// A joiner that never finishes (hung, or gone without its connection
// closing) cannot hold the lease: the session ends at the seed's limit.
TEST_F(PeerE2e, SessionOfAJoinerThatNeverFinishesExpires) {
  auto a = Node({"--peer-deadline-seconds", "1"});
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  std::unique_ptr<Session> session = OpenSession(*a);
  ASSERT_TRUE(session->opened);
  EXPECT_EQ(session->reply.session_seconds(), 1);
  EXPECT_EQ(Ls(*a)["leases"], 1);
  EXPECT_FALSE(session->stream->Read(&session->reply));  // returns when the seed ends the session
  grpc::Status ended = session->stream->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << ended.error_message();
  EXPECT_TRUE(AwaitMetric(*a, "weightd_peer_joiners", 0));
  EXPECT_EQ(Ls(*a)["leases"], 0);
}

TEST_F(PeerE2e, PeerPortServesNothingButThePeerServiceAndHealth) {
  auto a = Node();
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  auto weightd = v1::Weightd::NewStub(grpc::CreateChannel(PeerOf(*a), grpc::InsecureChannelCredentials()));
  {
    grpc::ClientContext context;
    v1::ListModelsResponse models;
    EXPECT_EQ(weightd->ListModels(&context, v1::ListModelsRequest(), &models).error_code(),
              grpc::StatusCode::UNIMPLEMENTED);
  }
  {
    grpc::ClientContext context;
    v1::UnloadModelRequest unload;
    unload.set_name(kModel);
    v1::UnloadModelResponse response;
    EXPECT_EQ(weightd->UnloadModel(&context, unload, &response).error_code(), grpc::StatusCode::UNIMPLEMENTED);
  }
  EXPECT_EQ(Ls(*a)["state"], "READY");
  CommandResult health = testing::RunCommand({testing::WeightctlBinary(), "--socket", PeerOf(*a), "health"});
  EXPECT_EQ(health.out, "SERVING\n") << health.err;
}

// Mutual TLS on the peer port: only a joiner holding a certificate of the
// fleet's CA gets a session (and so its transfer token); the others fall
// back to storage.
TEST_F(PeerE2e, MutualTlsSeedsOnlyJoinersWithTheFleetsCertificate) {
  if (access(testing::kOpenssl, X_OK) != 0) GTEST_SKIP() << testing::kOpenssl << " is absent: apt-get install openssl";
  testing::TempDir pki;
  std::string log;
  ASSERT_TRUE(testing::MakeCertificates(pki, &log)) << log;
  auto tls = [&](const std::string& node) {
    return std::vector<std::string>{"--peer-tls-cert", pki.Join(node + ".pem"), "--peer-tls-key",
                                    pki.Join(node + ".key"), "--peer-tls-ca", pki.Join("ca.pem")};
  };
  std::vector<std::string> a_args = tls("node-a");
  a_args.insert(a_args.end(), {"--grpc-first-bytes-timeout-seconds", "1"});
  auto a = Node(a_args), b = Node(tls("node-b")), plain = Node(), rogue = Node(tls("rogue-node"));
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  std::string peer = PeerOf(*a);
  EXPECT_NE(a->process().Stderr().find("(weightd.v1.Peer, read-only, mutual TLS;"), std::string::npos)
      << a->process().Stderr();

  CommandResult load = b->Ctl({"load", kModel, "demo", "--peer", peer});
  ASSERT_EQ(load.code, 0) << load.err << b->process().Stderr();
  EXPECT_EQ(Ls(*b)["source"], "peer " + peer);
  ExpectVerifies(*b);

  for (DaemonProcess* joiner : {plain.get(), rogue.get()}) {
    load = joiner->Ctl({"load", kModel, "demo", "--peer", peer});
    ASSERT_EQ(load.code, 0) << load.err << joiner->process().Stderr();
    EXPECT_EQ(Ls(*joiner)["source"], "storage");
    EXPECT_NE(joiner->process().Stderr().find("peer " + peer + " did not seed 'm' (unavailable)"), std::string::npos)
        << joiner->process().Stderr();
  }
  EXPECT_TRUE(AwaitMetric(*a, "weightd_peer_joiners", 0));
  // Only B's session was ever opened.
  std::string seed_log = a->process().Stderr();
  size_t opened = 0;
  for (size_t at = seed_log.find("opened a transfer of 'm'"); at != std::string::npos;
       at = seed_log.find("opened a transfer of 'm'", at + 1)) {
    ++opened;
  }
  EXPECT_EQ(opened, 1u) << seed_log;

  // A connection that never finishes its TLS handshake is closed after
  // --grpc-first-bytes-timeout-seconds (gRPC's own listener serves TLS).
  ScopedFd silent = testing::ConnectLoopback(a->LoggedPort("peer listener on "));
  ASSERT_TRUE(silent.valid());
  timeval five{5, 0};
  setsockopt(silent.get(), SOL_SOCKET, SO_RCVTIMEO, &five, sizeof five);
  auto start = std::chrono::steady_clock::now();
  char byte;
  EXPECT_EQ(recv(silent.get(), &byte, 1, 0), 0) << "the seed closed the silent connection";
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
}

// Checkpoints written by other tools (../shared/real-checkpoints): a
// sharded one (six files, six host segments), a single file and a LoRA
// adapter, each seeded from a peer and verified byte for byte.
TEST_F(PeerE2e, RealCheckpointsSeedFromAPeerAndVerify) {
  WEIGHTD_REQUIRE_SHARED(shared);
  auto a = Node(), b = Node();
  std::string real = shared + "/real-checkpoints/";
  for (const auto& [name, path] : std::vector<std::pair<std::string, std::string>>{
           {"flux-sharded", real + "fluxml-sharded"},
           {"flux", real + "fluxml-nonsharded/model.safetensors"},
           {"lora", real + "gpt2-tigrinya-lora"}}) {
    CommandResult from_storage = a->Ctl({"load", name, path, "--json"});
    ASSERT_EQ(from_storage.code, 0) << from_storage.err;
    CommandResult seeded = b->Ctl({"load", name, path, "--peer", PeerOf(*a), "--json"});
    ASSERT_EQ(seeded.code, 0) << seeded.err << b->process().Stderr();
    EXPECT_EQ(json::parse(seeded.out)["source"], "peer " + PeerOf(*a)) << name;
    EXPECT_EQ(json::parse(seeded.out)["fingerprint"], json::parse(from_storage.out)["fingerprint"]) << name;
    CommandResult attach = b->Ctl({"attach", name, "--verify", path, "--json"});
    ASSERT_EQ(attach.code, 0) << attach.err;
    EXPECT_EQ(json::parse(attach.out)["verified"], true) << name;
  }
}

// The node's own transport is checked at start when it seeds or has
// configured peers: a helper user that does not exist stops the start.
TEST_F(PeerE2e, UnknownHelperUserStopsTheStartOfANodeWithPeers) {
  if (geteuid() != 0) GTEST_SKIP() << "not root: helpers switch users only when started by root";
  testing::TempDir dir;
  CommandResult r = testing::RunCommand({testing::WeightdBinary(), "--socket", dir.Join("w.sock"), "--metrics-address",
                                         "", "--peers", "127.0.0.1:9", "--peer-helper-user", "no-such-weightd-user"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("no user 'no-such-weightd-user' to run the peer helpers as (--peer-helper-user)"),
            std::string::npos)
      << r.err;
}

// A node whose own transport cannot start (its helper is missing) asks no
// peer and reads storage, saying so once, as reason `local`.
TEST_F(PeerE2e, JoinerWithoutItsHelperReadsStorageAndSaysWhy) {
  auto a = Node(), b = Node({"--peer-address", "", "--peer-helper", "/nonexistent/weightd-peer-helper"});
  ASSERT_EQ(a->Ctl({"load", kModel, "demo"}).code, 0);
  CommandResult load = b->Ctl({"load", kModel, "demo", "--peer", PeerOf(*a)});
  ASSERT_EQ(load.code, 0) << load.err << b->process().Stderr();
  EXPECT_EQ(Ls(*b)["source"], "storage");
  EXPECT_NE(b->process().Stderr().find("cannot seed 'm' from peers: this node's peer transport cannot start: "
                                       "opening the peer helper '/nonexistent/weightd-peer-helper'"),
            std::string::npos)
      << b->process().Stderr();
  EXPECT_EQ(Metric(*b, "weightd_peer_fallbacks_total{reason=\"local\"}"), 1);
}

// A peer that accepts TCP connections and never speaks costs the joiner
// kPeerConnectTimeout (5 s), not gRPC's 20 s.
TEST_F(PeerE2e, PeerThatNeverAnswersIsGivenUpAfterFiveSeconds) {
  ScopedFd listener(socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(listener.get(), 16), 0);  // connections complete in the backlog; nothing is ever said
  socklen_t len = sizeof addr;
  getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  std::string mute = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  auto b = Node();
  auto start = std::chrono::steady_clock::now();
  CommandResult load = b->Ctl({"load", kModel, "demo", "--peer", mute});
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(load.code, 0) << load.err << b->process().Stderr();
  EXPECT_EQ(Ls(*b)["source"], "storage");
  EXPECT_NE(b->process().Stderr().find("peer " + mute + " did not seed 'm' (unavailable): no connection within 5 s"),
            std::string::npos)
      << b->process().Stderr();
  EXPECT_GE(seconds, 4.5);
  EXPECT_LT(seconds, 15);
}

}  // namespace
}  // namespace weightd
