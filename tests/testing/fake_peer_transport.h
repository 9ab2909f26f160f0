// A PeerTransport inside one process, for tests of the seeding logic: an
// export maps its region fds read-only and a connection reads them with
// memcpy; faults are injected by the test (the transport is shared by seed
// and joiner).
#ifndef WEIGHTD_TESTS_TESTING_FAKE_PEER_TRANSPORT_H_
#define WEIGHTD_TESTS_TESTING_FAKE_PEER_TRANSPORT_H_

#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/peer/peer_transport.h"

namespace weightd::testing {

class FakePeerTransport final : public PeerTransport {
 public:
  // Faults, set by the test before reads happen.
  std::atomic<int64_t> fail_after_bytes{-1};  // reads past this many bytes in all fail UNAVAILABLE
  std::atomic<bool> stalled{false};           // reads never finish: DEADLINE_EXCEEDED at their deadline
  std::atomic<int64_t> corrupt_at{-1};        // flips the byte read at this offset of region 0
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<int> open_exports{0};

  std::string name() const override { return "fake"; }

  absl::StatusOr<std::unique_ptr<PeerExport>> Export(const std::vector<PeerExportRegion>& regions,
                                                     const PeerExportOptions& options) override {
    auto e = std::make_unique<Export_>(this);
    for (const PeerExportRegion& r : regions) {
      void* p = r.size == 0 ? nullptr : mmap(nullptr, r.size, PROT_READ, MAP_SHARED, r.fd, 0);
      if (p == MAP_FAILED) return absl::InvalidArgumentError(absl::StrCat("cannot map export fd ", r.fd));
      e->maps.push_back({static_cast<const char*>(p), r.size});
      e->offer_.region_sizes.push_back(r.size);
    }
    if (options.stall_for_test) stalled = true;
    absl::MutexLock lock(&mu_);
    e->offer_.worker_address = absl::StrCat("fake-worker-", next_++);
    e->offer_.token = std::string(kPeerTokenBytes, 't');
    exports_[e->offer_.worker_address] = e.get();
    return std::unique_ptr<PeerExport>(std::move(e));
  }

  absl::StatusOr<std::unique_ptr<PeerConnection>> Connect(const PeerOffer& offer,
                                                          std::chrono::steady_clock::time_point) override {
    absl::MutexLock lock(&mu_);
    auto it = exports_.find(offer.worker_address);
    if (it == exports_.end()) return absl::UnavailableError("no such fake worker");
    if (offer.token != it->second->offer_.token) return absl::PermissionDeniedError("the seed refused the session token");
    return std::unique_ptr<PeerConnection>(new Connection(this, offer.worker_address, offer.region_sizes));
  }

 private:
  struct Export_ final : PeerExport {
    explicit Export_(FakePeerTransport* t) : t(t) { ++t->open_exports; }
    ~Export_() override {
      {
        absl::MutexLock lock(&t->mu_);
        t->exports_.erase(offer_.worker_address);
      }
      for (auto& [p, n] : maps) {
        if (p != nullptr) munmap(const_cast<char*>(p), n);
      }
      --t->open_exports;
    }
    const PeerOffer& offer() const override { return offer_; }
    absl::StatusOr<uint64_t> BytesSent(std::chrono::steady_clock::time_point) override {
      absl::MutexLock lock(&t->mu_);
      return sent;
    }
    FakePeerTransport* t;
    PeerOffer offer_;
    uint64_t sent = 0;  // under t->mu_
    std::vector<std::pair<const char*, uint64_t>> maps;
  };

  class Connection final : public PeerConnection {
   public:
    Connection(FakePeerTransport* t, std::string worker, std::vector<uint64_t> sizes)
        : t_(t), worker_(std::move(worker)), sizes_(std::move(sizes)) {}
    absl::Status Read(const std::vector<PeerRead>& reads, std::chrono::steady_clock::time_point deadline) override {
      for (const PeerRead& r : reads) {
        if (r.region >= sizes_.size() || r.offset + r.n > sizes_[r.region]) {
          return absl::InvalidArgumentError("read outside the peer's regions");
        }
        if (t_->stalled) return absl::DeadlineExceededError("peer reads did not finish before the deadline");
        int64_t limit = t_->fail_after_bytes.load();
        if (limit >= 0 && static_cast<int64_t>(t_->bytes_read + r.n) > limit) {
          return absl::UnavailableError("peer connection failed: Connection reset by remote peer");
        }
        absl::MutexLock lock(&t_->mu_);
        auto it = t_->exports_.find(worker_);
        if (it == t_->exports_.end()) return absl::UnavailableError("the fake seed is gone");
        std::memcpy(r.dst, it->second->maps[r.region].first + r.offset, r.n);
        it->second->sent += r.n;
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
    std::string worker_;
    std::vector<uint64_t> sizes_;
  };

  absl::Mutex mu_;
  std::map<std::string, Export_*> exports_;
  int next_ = 0;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FAKE_PEER_TRANSPORT_H_
