// The seeding logic without a network: a seed (PeerSeed over a real
// registry) and a joiner (SeedFromDescription over the same checkpoint
// files) joined by a FakePeerTransport that injects faults.
#include "server/peer/peer_seeding.h"

#include "gtest/gtest.h"
#include "server/peer/peer_join.h"
#include "server/peer/peer_seed.h"
#include "server/registry/registry.h"
#include "tests/testing/checkpoint_builder.h"
#include "common/base/status.h"
#include "tests/testing/fake_peer_transport.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::Bytes;
using ::weightd::testing::FakePeerTransport;
using ::weightd::testing::SafetensorsBuilder;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;

class PeerSeedingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = tmp_.path();
    // Two files, one tensor spanning two read blocks: several pulls per segment.
    WriteFile(dir_ + "/a.safetensors", SafetensorsBuilder()
                                           .Add("a.big", "U8", {kReadBlockBytes + 4096}, Bytes(kReadBlockBytes + 4096, 1))
                                           .Add("a.small", "F32", {3}, Bytes(12, 2))
                                           .Build());
    WriteFile(dir_ + "/b.safetensors", SafetensorsBuilder().Add("b.w", "BF16", {8, 8}, Bytes(128, 3)).Build());
    RegistryOptions options;
    options.model_roots = {dir_};
    options.loader.mlock = false;
    registry_ = std::make_unique<ModelRegistry>(options, nullptr);
    LoadRequest request = Request();
    request.checkpoint_path = dir_;
    WEIGHTD_ASSERT_OK(registry_->Load(request, nullptr).status());
    seed_ = std::make_unique<PeerSeed>(registry_.get(), &transport_, PeerSeedOptions{}, nullptr);
  }

  static LoadRequest Request() {
    LoadRequest request;
    request.name = "m";
    return request;
  }
  static LoaderOptions Loader() {
    LoaderOptions loader;
    loader.mlock = false;
    loader.threads = 2;
    return loader;
  }

  // The joiner's half, against the reply of an open session.
  absl::StatusOr<std::unique_ptr<ModelGeneration>> Join(const v1::PeerTransferReply& reply,
                                                        std::chrono::milliseconds deadline = std::chrono::seconds(30),
                                                        SourceHashing hashing = SourceHashing::kPerSegment) {
    WEIGHTD_ASSIGN_OR_RETURN(Catalog catalog, BuildCatalog(dir_));
    PeerPull pull("10.0.0.1:7000", transport_, std::chrono::steady_clock::now() + deadline, nullptr);
    pull.set_hashing(hashing);
    WEIGHTD_ASSIGN_OR_RETURN(PlannedLoad planned, PlanLoad(catalog, Request(), Loader()));
    auto gen = SeedFromDescription(reply, catalog, Request(), planned, Loader(), nullptr, pull);
    pulled_ = pull.bytes_read();
    return gen;
  }

  v1::PeerTransferReply Describe(const PeerSeed::Session& session) {
    v1::PeerTransferReply reply;
    seed_->Describe(session, &reply);
    return reply;
  }

  TempDir tmp_;
  std::string dir_;
  FakePeerTransport transport_;
  std::unique_ptr<ModelRegistry> registry_;
  std::unique_ptr<PeerSeed> seed_;
  uint64_t pulled_ = 0;
};

TEST_F(PeerSeedingTest, JoinerGetsTheSeedsBytesVerified) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  v1::PeerTransferReply reply = Describe(*session);
  EXPECT_EQ(reply.transport(), "fake");
  EXPECT_EQ(reply.files_size(), 2);
  EXPECT_EQ(reply.host_segments_size(), 2);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ModelGeneration> gen, Join(reply));
  const ModelGeneration& seed = session->model();
  EXPECT_EQ(gen->source, "peer 10.0.0.1:7000");
  EXPECT_EQ(gen->fingerprint, seed.fingerprint);
  EXPECT_EQ(gen->bytes_read, 0u);  // every tensor is host-placed: nothing from storage
  EXPECT_EQ(pulled_, kReadBlockBytes + 4096 + 12 + 128);
  ASSERT_EQ(gen->host_segments.size(), seed.host_segments.size());
  for (size_t i = 0; i < seed.host_segments.size(); ++i) {
    ASSERT_EQ(gen->host_segments[i]->size(), seed.host_segments[i]->size());
    EXPECT_EQ(std::memcmp(gen->host_segments[i]->data(), seed.host_segments[i]->data(), seed.host_segments[i]->size()),
              0);
    EXPECT_TRUE(gen->host_segments[i]->sealed());
  }
}

TEST_F(PeerSeedingTest, TransferFailureIsAnErrorWithItsReason) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  transport_.fail_after_bytes = kReadBlockBytes / 2;
  absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = Join(Describe(*session));
  EXPECT_THAT(gen, StatusIs(absl::StatusCode::kUnavailable, "Connection reset"));
  EXPECT_EQ(PeerFallbackReason(gen.status()), "transfer_failed");
}

TEST_F(PeerSeedingTest, StalledSeedEndsAtTheDeadline) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  transport_.stalled = true;
  absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = Join(Describe(*session));
  EXPECT_THAT(gen, StatusIs(absl::StatusCode::kDeadlineExceeded, "deadline"));
  EXPECT_EQ(PeerFallbackReason(gen.status()), "deadline");
}

TEST_F(PeerSeedingTest, CorruptedByteFailsTheHashCheck) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  transport_.corrupt_at = 100;
  absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = Join(Describe(*session));
  EXPECT_THAT(gen, StatusIs(absl::StatusCode::kDataLoss, "tensor 'a.big': the bytes received hash to"));
  EXPECT_EQ(PeerFallbackReason(gen.status()), "hash_mismatch");
}

// A transfer helper is no more trusted than its peer: one that says it let
// go of a segment but still maps it fails the seal; one that writes after
// its reads were done fails the hashes taken after the seal.
TEST_F(PeerSeedingTest, HelperThatKeepsAMappingFailsTheSeal) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  transport_.keep_mappings = true;
  absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = Join(Describe(*session));
  EXPECT_THAT(gen, StatusIs(absl::StatusCode::kFailedPrecondition,
                            "after its transfer: the memfd is still mapped writable"));
  EXPECT_EQ(PeerFallbackReason(gen.status()), "seal_refused");
}

TEST_F(PeerSeedingTest, HelperThatWritesAfterItsReadsFailsTheHashCheck) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  transport_.write_on_release = true;
  absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = Join(Describe(*session));
  EXPECT_THAT(gen, StatusIs(absl::StatusCode::kDataLoss, "the bytes received hash to"));
  EXPECT_EQ(PeerFallbackReason(gen.status()), "hash_mismatch");
}

// --peer-verify per-transfer: both a byte the seed's transport changed and
// one the joiner's helper wrote after its reads fail the hashes taken after
// the last byte, as they fail those taken per segment.
TEST_F(PeerSeedingTest, PerTransferHashingCatchesWhatPerSegmentCatches) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ModelGeneration> gen,
                               Join(Describe(*session), std::chrono::seconds(30), SourceHashing::kPerTransfer));
  EXPECT_EQ(gen->fingerprint, session->model().fingerprint);
  transport_.corrupt_at = 100;
  absl::StatusOr<std::unique_ptr<ModelGeneration>> corrupt =
      Join(Describe(*session), std::chrono::seconds(30), SourceHashing::kPerTransfer);
  EXPECT_THAT(corrupt, StatusIs(absl::StatusCode::kDataLoss, "tensor 'a.big': the bytes received hash to"));
  EXPECT_EQ(PeerFallbackReason(corrupt.status()), "hash_mismatch");
  transport_.corrupt_at = -1;
  transport_.write_on_release = true;
  absl::StatusOr<std::unique_ptr<ModelGeneration>> late =
      Join(Describe(*session), std::chrono::seconds(30), SourceHashing::kPerTransfer);
  EXPECT_THAT(late, StatusIs(absl::StatusCode::kDataLoss, "the bytes received hash to"));
  EXPECT_EQ(PeerFallbackReason(late.status()), "hash_mismatch");
}

// Seed-side lanes: a session asks its transport for one sender per lane of
// the joiner (0 counts as 1); more than kMaxPeerLanes is refused before a
// slot or a sender is taken.
TEST_F(PeerSeedingTest, SeedStartsASenderPerLaneAndRefusesMoreThanEight) {
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2", 3));
    EXPECT_EQ(transport_.senders_asked.load(), 3u);
  }
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2", 0));
    EXPECT_EQ(transport_.senders_asked.load(), 1u);
  }
  transport_.senders_asked = 0;
  EXPECT_THAT(seed_->Open("m", "10.0.0.2", kMaxPeerLanes + 1),
              StatusIs(absl::StatusCode::kInvalidArgument, "the joiner asks for 9 lanes, at most 8 (--peer-lanes)"));
  EXPECT_EQ(transport_.senders_asked.load(), 0u);
  EXPECT_EQ(seed_->joiners(), 0);
  EXPECT_EQ(transport_.open_exports.load(), 0);
}

// A seed's reply names at most kMaxPeerLanes senders: a joiner refuses more
// before it starts anything.
TEST_F(PeerSeedingTest, ReplyWithMoreThanEightSendersIsRefused) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  v1::PeerTransferReply reply = Describe(*session);
  for (uint32_t i = 0; i < kMaxPeerLanes; ++i) reply.add_more_senders()->set_worker_address("x");
  absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = Join(reply);
  EXPECT_THAT(gen, StatusIs(absl::StatusCode::kInvalidArgument, "the peer offers 9 senders, at most 8"));
  EXPECT_EQ(PeerFallbackReason(gen.status()), "other");
  EXPECT_EQ(pulled_, 0u);
  reply.mutable_more_senders()->RemoveLast();
  WEIGHTD_EXPECT_OK(OfferOf(reply).status());
  EXPECT_EQ(OfferOf(reply)->senders(), 8u);
}

TEST_F(PeerSeedingTest, LanesFollowTheConfigElseSizeAndCores) {
  EXPECT_EQ(ChoosePeerLanes(10ull << 30, 3, 2), 3u);
  EXPECT_EQ(ChoosePeerLanes(10ull << 30, 100, 2), kMaxPeerLanes);
  EXPECT_EQ(ChoosePeerLanes(100 << 20, 0, 64), 1u);        // small: one lane
  EXPECT_EQ(ChoosePeerLanes(2500ull << 20, 0, 1), 1u);     // one core: one lane
  EXPECT_EQ(ChoosePeerLanes(2500ull << 20, 0, 2), 2u);     // one per core
  EXPECT_EQ(ChoosePeerLanes(2500ull << 20, 0, 64), 4u);    // at most kMaxAutoPeerLanes
  EXPECT_EQ(ChoosePeerLanes(600ull << 20, 0, 64), 2u);     // one per 256 MiB
}

TEST_F(PeerSeedingTest, SeedHashThatLiesIsCaught) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  v1::PeerTransferReply reply = Describe(*session);
  reply.mutable_tensors(2)->set_content_hash(reply.tensors(2).content_hash() ^ 1);
  EXPECT_THAT(Join(reply), StatusIs(absl::StatusCode::kDataLoss, "tensor 'b.w'"));
  reply = Describe(*session);
  reply.set_fingerprint("00000000000000000000000000000000");
  EXPECT_THAT(Join(reply), StatusIs(absl::StatusCode::kDataLoss, "fingerprint"));
}

TEST_F(PeerSeedingTest, DifferentCheckpointOrLayoutIsRefusedBeforeAnyRead) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  v1::PeerTransferReply reply = Describe(*session);
  reply.mutable_files(1)->set_header_hash(reply.files(1).header_hash() + 1);
  absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = Join(reply);
  EXPECT_THAT(gen, StatusIs(absl::StatusCode::kFailedPrecondition, "file 1"));
  EXPECT_EQ(PeerFallbackReason(gen.status()), "different_checkpoint");
  reply = Describe(*session);
  reply.mutable_tensors(1)->set_host_offset(reply.tensors(1).host_offset() + 64);
  EXPECT_THAT(Join(reply), StatusIs(absl::StatusCode::kFailedPrecondition, "placed differently"));
  reply = Describe(*session);
  reply.mutable_host_segments()->RemoveLast();
  EXPECT_THAT(Join(reply), StatusIs(absl::StatusCode::kFailedPrecondition, "1 host segments there, 2 here"));
  reply = Describe(*session);
  reply.add_tensors();
  EXPECT_THAT(Join(reply), StatusIs(absl::StatusCode::kFailedPrecondition, "4 tensors there, 3 here"));
  EXPECT_EQ(transport_.bytes_read.load(), 0u);
}

TEST_F(PeerSeedingTest, SeedRefusesJoinersPastItsLimit) {
  PeerSeedOptions limit;
  limit.max_joiners = 2;
  PeerSeed seed(registry_.get(), &transport_, limit, nullptr);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto one, seed.Open("m", "a"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto two, seed.Open("m", "b"));
  EXPECT_THAT(seed.Open("m", "c"), StatusIs(absl::StatusCode::kUnavailable, "--peer-max-joiners"));
  EXPECT_EQ(seed.joiners(), 2);
  two.reset();
  EXPECT_EQ(seed.joiners(), 1);
  WEIGHTD_EXPECT_OK(seed.Open("m", "c"));
  EXPECT_THAT(seed.Open("nope", "d"), StatusIs(absl::StatusCode::kNotFound, "no model named 'nope'"));
  EXPECT_EQ(seed.joiners(), 1);  // a refused open gives its slot back
}

TEST_F(PeerSeedingTest, SessionHoldsALeaseSoUnloadDrains) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto session, seed_->Open("m", "10.0.0.2"));
  EXPECT_EQ(transport_.open_exports.load(), 1);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::UnloadResult unloaded, registry_->Unload("m", false));
  EXPECT_FALSE(unloaded.freed);
  EXPECT_EQ(unloaded.model->state.load(), ModelState::kDraining);
  WEIGHTD_ASSERT_OK(Join(Describe(*session)).status());  // still readable while draining
  session.reset();
  EXPECT_EQ(transport_.open_exports.load(), 0);
  EXPECT_TRUE(registry_->List().empty());
}

TEST(PeerList, BoundsAndShape) {
  WEIGHTD_EXPECT_OK(ValidatePeerList({"node-1:7070", "[::1]:7070", "10.0.0.1:1"}, "peers"));
  EXPECT_THAT(ValidatePeerList({"node-1"}, "peers"), StatusIs(absl::StatusCode::kInvalidArgument, "'node-1' is not HOST:PORT"));
  EXPECT_THAT(ValidatePeerList({"node-1:0"}, "peers"), StatusIs(absl::StatusCode::kInvalidArgument, "not HOST:PORT"));
  EXPECT_THAT(ValidatePeerList({std::string(300, 'a') + ":1"}, "peers"),
              StatusIs(absl::StatusCode::kInvalidArgument, "at most 256 bytes"));
  EXPECT_THAT(ValidatePeerList(std::vector<std::string>(65, "a:1"), "peers"),
              StatusIs(absl::StatusCode::kInvalidArgument, "65 peers, at most 64"));
}

TEST(PeerJoiner, PeersExpandNamesToAddressesWithoutRepeats) {
  PeerJoinOptions options;
  options.peers = {"localhost:7070", "10.0.0.9:1"};
  PeerJoiner joiner(options);
  LoadRequest request;
  request.peers = {"127.0.0.1:7070"};
  std::vector<std::string> peers = joiner.PeersFor(request);
  ASSERT_GE(peers.size(), 2u);
  EXPECT_EQ(peers.front(), "127.0.0.1:7070");  // the request's own first
  EXPECT_EQ(std::count(peers.begin(), peers.end(), "127.0.0.1:7070"), 1);  // localhost adds no repeat
  EXPECT_EQ(peers.back(), "10.0.0.9:1");
}

}  // namespace
}  // namespace weightd
