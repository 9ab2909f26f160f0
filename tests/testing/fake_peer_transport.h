// A PeerTransport inside one process, for tests of the seeding logic: a
// "remote" region is read with memcpy from its address, and faults are
// injected by the test (the transport is shared by seed and joiner).
#ifndef WEIGHTD_TESTS_TESTING_FAKE_PEER_TRANSPORT_H_
#define WEIGHTD_TESTS_TESTING_FAKE_PEER_TRANSPORT_H_

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/peer/peer_transport.h"

namespace weightd::testing {

class FakePeerTransport final : public PeerTransport {
 public:
  // Faults, set by the test before reads happen.
  std::atomic<int64_t> fail_after_bytes{-1};  // reads past this many bytes in all fail UNAVAILABLE
  std::atomic<bool> stalled{false};           // reads never finish: DEADLINE_EXCEEDED at their deadline
  std::atomic<int64_t> corrupt_at{-1};        // flips the byte read at this offset of region 0
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<int> open_regions{0};

  std::string name() const override { return "fake"; }
  std::string worker_address() const override { return "fake-worker"; }

  absl::StatusOr<std::unique_ptr<PeerRegion>> Register(const void* base, uint64_t size) override {
    return std::unique_ptr<PeerRegion>(new Region(this, base, size));
  }

  absl::StatusOr<std::unique_ptr<PeerConnection>> Connect(const std::string& worker_address,
                                                          const std::vector<RemoteRegion>& regions) override {
    if (worker_address != "fake-worker") return absl::UnavailableError("no such fake worker");
    return std::unique_ptr<PeerConnection>(new Connection(this, regions));
  }

  void StallForTest() override { stalled = true; }

 private:
  class Region final : public PeerRegion {
   public:
    Region(FakePeerTransport* t, const void* base, uint64_t size) : t_(t), base_(base), size_(size) { ++t_->open_regions; }
    ~Region() override { --t_->open_regions; }
    RemoteRegion Describe() const override { return {reinterpret_cast<uint64_t>(base_), size_, "fake-key"}; }

   private:
    FakePeerTransport* t_;
    const void* base_;
    uint64_t size_;
  };

  class Connection final : public PeerConnection {
   public:
    Connection(FakePeerTransport* t, std::vector<RemoteRegion> regions) : t_(t), regions_(std::move(regions)) {}
    absl::Status Read(const std::vector<PeerRead>& reads, std::chrono::steady_clock::time_point deadline) override {
      for (const PeerRead& r : reads) {
        if (r.region >= regions_.size() || r.offset + r.n > regions_[r.region].size) {
          return absl::InvalidArgumentError("read outside the peer's regions");
        }
        if (t_->stalled) return absl::DeadlineExceededError("peer reads did not finish before the deadline");
        int64_t limit = t_->fail_after_bytes.load();
        if (limit >= 0 && static_cast<int64_t>(t_->bytes_read + r.n) > limit) {
          return absl::UnavailableError("peer connection failed: Connection reset by remote peer");
        }
        std::memcpy(r.dst, reinterpret_cast<const char*>(regions_[r.region].address) + r.offset, r.n);
        int64_t at = t_->corrupt_at.load();
        if (r.region == 0 && at >= static_cast<int64_t>(r.offset) && at < static_cast<int64_t>(r.offset + r.n)) {
          r.dst[at - r.offset] ^= 0x5a;
        }
        t_->bytes_read += r.n;
      }
      return absl::OkStatus();
    }

   private:
    FakePeerTransport* t_;
    std::vector<RemoteRegion> regions_;
  };
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FAKE_PEER_TRANSPORT_H_
