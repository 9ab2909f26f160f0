// SourceFill (server/load/source_fill.h): segments filled by a HostSource
// are sealed when reported, and hashed only from the sealed bytes.
#include "server/load/source_fill.h"

#include <sys/mman.h>

#include <cstring>

#include "common/base/status.h"
#include "common/format/content_hash.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

// Writes `byte` over each range, optionally one more byte at `stray`, and
// optionally maps each segment writable itself and keeps the mapping.
class ScriptedSource final : public HostSource {
 public:
  char byte = 7;
  int64_t stray = -1;
  bool keep_mapping = false;
  absl::Status fail;
  // When set: what it says when the source returns (after the last report).
  const SourceFill* watch = nullptr;
  uint64_t hashed_when_done = ~0ull;
  bool sealed_when_done = false;

  absl::Status Fill(const std::vector<HostSegment*>& segments, const std::vector<std::vector<Range>>& ranges,
                    const std::function<absl::Status(uint32_t)>& filled) override {
    if (!fail.ok()) return fail;
    for (uint32_t i = 0; i < segments.size(); ++i) {
      char* map = static_cast<char*>(
          mmap(nullptr, segments[i]->size(), PROT_READ | PROT_WRITE, MAP_SHARED, segments[i]->fd(), 0));
      if (map == MAP_FAILED) return absl::InternalError("mmap");
      for (const Range& r : ranges[i]) std::memset(map + r.offset, byte, r.n);
      if (stray >= 0) map[stray] = 1;
      if (keep_mapping) {
        kept_.push_back({map, segments[i]->size()});
      } else {
        munmap(map, segments[i]->size());
      }
      WEIGHTD_RETURN_IF_ERROR(filled(i));
    }
    if (watch != nullptr) {
      hashed_when_done = watch->bytes_hashed();
      sealed_when_done = segments[0]->sealed() && segments.back()->sealed();
    }
    return absl::OkStatus();
  }
  ~ScriptedSource() override {
    for (auto& [p, n] : kept_) munmap(p, n);
  }

 private:
  std::vector<std::pair<char*, uint64_t>> kept_;
};

class SourceFillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (uint64_t size : {uint64_t{4096}, uint64_t{20ull << 20}}) {
      WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> s, HostSegment::Create("source-fill-test", size));
      WEIGHTD_ASSERT_OK(s->SealSize());
      segments_.push_back(std::move(s));
    }
    // Segment 0: tensor 0 at [0, 100), a gap, tensor 1 at [128, 4000);
    // segment 1: tensor 2 of 20 MiB minus one byte (two hash blocks).
    tensors_ = {{{0, 0, 100}, {1, 128, 3872}}, {{2, 0, (20ull << 20) - 1}}};
    hashes_ = {{0}, {0}, {0, 0}};
  }
  absl::Status Run(ScriptedSource& source, const std::atomic<bool>* cancel = nullptr,
                   SourceHashing hashing = SourceHashing::kPerSegment) {
    std::vector<HostSegment*> raw = {segments_[0].get(), segments_[1].get()};
    SourceFill fill(source, raw, tensors_, hashes_);
    fill.set_cancel(cancel);
    fill.set_hashing(hashing);
    source.watch = &fill;
    fill.Start(2);
    absl::Status st = fill.Wait();
    bytes_hashed_ = fill.bytes_hashed();
    return st;
  }

  std::vector<std::unique_ptr<HostSegment>> segments_;
  std::vector<std::vector<SegmentTensor>> tensors_;
  std::vector<std::vector<uint64_t>> hashes_;
  uint64_t bytes_hashed_ = 0;
};

TEST_F(SourceFillTest, SealsEverySegmentAndHashesTheSealedBytes) {
  ScriptedSource source;
  WEIGHTD_ASSERT_OK(Run(source));
  EXPECT_TRUE(segments_[0]->sealed());
  EXPECT_TRUE(segments_[1]->sealed());
  std::string t0(100, 7), t1(3872, 7), t2((20ull << 20) - 1, 7);
  EXPECT_EQ(CombineBlockHashes(hashes_[0]), TensorContentHash(t0.data(), t0.size()));
  EXPECT_EQ(CombineBlockHashes(hashes_[1]), TensorContentHash(t1.data(), t1.size()));
  EXPECT_EQ(CombineBlockHashes(hashes_[2]), TensorContentHash(t2.data(), t2.size()));
  EXPECT_EQ(bytes_hashed_, 100u + 3872u + (20ull << 20) - 1);
}

// --peer-verify per-transfer: every segment is sealed as it is reported,
// none is hashed before the source returns, and then all of them are.
TEST_F(SourceFillTest, PerTransferHashesNothingBeforeTheLastSegmentIsIn) {
  ScriptedSource source;
  WEIGHTD_ASSERT_OK(Run(source, nullptr, SourceHashing::kPerTransfer));
  EXPECT_TRUE(source.sealed_when_done);
  EXPECT_EQ(source.hashed_when_done, 0u);
  std::string t2((20ull << 20) - 1, 7);
  EXPECT_EQ(CombineBlockHashes(hashes_[2]), TensorContentHash(t2.data(), t2.size()));
  EXPECT_EQ(bytes_hashed_, 100u + 3872u + (20ull << 20) - 1);
}

TEST_F(SourceFillTest, PerTransferStillFindsAByteWrittenBetweenTensors) {
  ScriptedSource source;
  source.stray = 120;
  EXPECT_THAT(Run(source, nullptr, SourceHashing::kPerTransfer),
              StatusIs(absl::StatusCode::kDataLoss, "host segment 0: byte 120 lies outside every tensor and is not zero"));
  EXPECT_EQ(source.hashed_when_done, 0u);
}

TEST_F(SourceFillTest, AByteWrittenBetweenTensorsIsDataLossNamingIt) {
  ScriptedSource source;
  source.stray = 120;
  EXPECT_THAT(Run(source), StatusIs(absl::StatusCode::kDataLoss,
                                    "host segment 0: byte 120 lies outside every tensor and is not zero"));
}

TEST_F(SourceFillTest, AByteWrittenPastTheLastTensorIsDataLoss) {
  ScriptedSource source;
  source.stray = 4000;
  EXPECT_THAT(Run(source), StatusIs(absl::StatusCode::kDataLoss, "host segment 0: byte 4000 lies outside"));
}

TEST_F(SourceFillTest, ASourceThatStillMapsASegmentFailsItsSeal) {
  ScriptedSource source;
  source.keep_mapping = true;
  EXPECT_THAT(Run(source), StatusIs(absl::StatusCode::kFailedPrecondition,
                                    "sealing host segment 0 after its transfer: the memfd is still mapped writable"));
  EXPECT_FALSE(segments_[0]->sealed());
}

TEST_F(SourceFillTest, ACancelledLoadRefusesTheNextSegmentAndStopsTheSource) {
  ScriptedSource source;
  std::atomic<bool> cancel{true};
  EXPECT_THAT(Run(source, &cancel), StatusIs(absl::StatusCode::kUnavailable, "load cancelled: weightd is shutting down"));
  EXPECT_FALSE(segments_[0]->sealed());
}

TEST_F(SourceFillTest, TheSourcesErrorIsTheFillsError) {
  ScriptedSource source;
  source.fail = absl::UnavailableError("peer gone");
  EXPECT_THAT(Run(source), StatusIs(absl::StatusCode::kUnavailable, "peer gone"));
}

}  // namespace
}  // namespace weightd
