// The UCX transport between two workers of one process, over TCP on the
// loopback device (UCX_TLS=tcp, UCX_NET_DEVICES=lo), the path two nodes use.
#include <cstdlib>
#include <numeric>

#include "common/peer/peer_transport.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using std::chrono::steady_clock;

class UcxTransportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("UCX_TLS", "tcp", 1);
    setenv("UCX_NET_DEVICES", "lo", 1);
    data_.resize(10 << 20);
    for (size_t i = 0; i < data_.size(); ++i) data_[i] = static_cast<char>((i * 131) ^ (i >> 13));
    WEIGHTD_ASSERT_OK_AND_ASSIGN(seed_, MakeUcxTransport());
    WEIGHTD_ASSERT_OK_AND_ASSIGN(joiner_, MakeUcxTransport());
    WEIGHTD_ASSERT_OK_AND_ASSIGN(region_, seed_->Register(data_.data(), data_.size()));
  }

  std::string data_;
  std::unique_ptr<PeerTransport> seed_, joiner_;
  std::unique_ptr<PeerRegion> region_;
};

TEST_F(UcxTransportTest, ReadsRangesOfARegisteredRegion) {
  EXPECT_EQ(seed_->name(), "ucx");
  RemoteRegion remote = region_->Describe();
  EXPECT_EQ(remote.size, data_.size());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeerConnection> c, joiner_->Connect(seed_->worker_address(), {remote}));
  std::string whole(data_.size(), '\0'), middle(4097, '\0');
  // The whole region (several pieces in flight) and an odd range at an odd offset.
  WEIGHTD_ASSERT_OK(c->Read({{0, 0, whole.size(), whole.data()}, {0, 12345, middle.size(), middle.data()}},
                            steady_clock::now() + seconds(30)));
  EXPECT_TRUE(whole == data_);
  EXPECT_TRUE(middle == data_.substr(12345, 4097));
}

TEST_F(UcxTransportTest, ReadOutsideTheRegionIsRefused) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeerConnection> c,
                               joiner_->Connect(seed_->worker_address(), {region_->Describe()}));
  std::string buf(16, '\0');
  EXPECT_THAT(c->Read({{0, data_.size() - 8, 16, buf.data()}}, steady_clock::now() + seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument, "outside the peer's regions"));
  EXPECT_THAT(c->Read({{1, 0, 16, buf.data()}}, steady_clock::now() + seconds(5)),
              StatusIs(absl::StatusCode::kInvalidArgument, "region 1"));
}

TEST_F(UcxTransportTest, StalledSeedEndsTheReadAtTheDeadline) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeerConnection> c,
                               joiner_->Connect(seed_->worker_address(), {region_->Describe()}));
  seed_->StallForTest();
  std::string buf(data_.size(), '\0');
  EXPECT_THAT(c->Read({{0, 0, buf.size(), buf.data()}}, steady_clock::now() + milliseconds(500)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, "deadline"));
  // The connection is broken from then on.
  EXPECT_THAT(c->Read({{0, 0, 16, buf.data()}}, steady_clock::now() + seconds(5)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, "deadline"));
}

TEST_F(UcxTransportTest, SeedThatGoesAwayFailsTheRead) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<PeerConnection> c,
                               joiner_->Connect(seed_->worker_address(), {region_->Describe()}));
  std::string buf(64, '\0');
  WEIGHTD_ASSERT_OK(c->Read({{0, 0, buf.size(), buf.data()}}, steady_clock::now() + seconds(30)));
  region_.reset();
  seed_.reset();
  absl::Status st = c->Read({{0, 0, buf.size(), buf.data()}}, steady_clock::now() + seconds(30));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
}

TEST_F(UcxTransportTest, OversizedPeerBytesAreRefused) {
  EXPECT_THAT(joiner_->Connect(std::string(kMaxPeerWorkerAddressBytes + 1, 'x'), {}),
              StatusIs(absl::StatusCode::kInvalidArgument, "worker address"));
  RemoteRegion bad = region_->Describe();
  bad.key = std::string(kMaxPeerRemoteKeyBytes + 1, 'k');
  EXPECT_THAT(joiner_->Connect(seed_->worker_address(), {bad}),
              StatusIs(absl::StatusCode::kInvalidArgument, "remote key 0"));
}

}  // namespace
}  // namespace weightd
