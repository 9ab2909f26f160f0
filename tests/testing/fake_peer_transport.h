// A PeerTransport inside one process, for tests of the seeding logic: an
// export maps its region fds read-only, a connection maps its destinations
// writable (as a joiner's helper does) and copies with memcpy; faults are
// injected by the test (the transport is shared by seed and joiner).
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
  std::atomic<bool> keep_mappings{false};     // Release() says it released, and keeps the mapping
  std::atomic<bool> write_on_release{false};  // Release() flips the first byte of the destination first
  std::atomic<uint64_t> bytes_read{0};
  std::atomic<int> open_exports{0};
  std::atomic<uint32_t> senders_asked{0};     // PeerExportOptions::senders of the last export

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
    senders_asked = options.senders;
    absl::MutexLock lock(&mu_);
    e->offer_.worker_address = absl::StrCat("fake-worker-", next_++);
    e->offer_.token = std::string(kPeerTokenBytes, 't');
    exports_[e->offer_.worker_address] = e.get();
    return std::unique_ptr<PeerExport>(std::move(e));
  }

  absl::StatusOr<std::unique_ptr<PeerConnection>> Connect(const PeerOffer& offer, std::chrono::steady_clock::time_point,
                                                          const PeerConnectOptions& options) override {
    absl::MutexLock lock(&mu_);
    auto it = exports_.find(offer.worker_address);
    if (it == exports_.end()) return absl::UnavailableError("no such fake worker");
    if (offer.token != it->second->offer_.token) return absl::PermissionDeniedError("the seed refused the session token");
    auto c = std::make_unique<Connection>(this, offer.worker_address, offer.region_sizes, options.lanes);
    for (const PeerDestination& d : options.destinations) {
      void* p = d.size == 0 ? nullptr : mmap(nullptr, d.size, PROT_READ | PROT_WRITE, MAP_SHARED, d.fd, 0);
      if (p == MAP_FAILED) return absl::InvalidArgumentError(absl::StrCat("cannot map destination fd ", d.fd));
      c->destinations.push_back({static_cast<char*>(p), d.size});
    }
    lanes_used = options.lanes;
    return std::unique_ptr<PeerConnection>(std::move(c));
  }
  std::atomic<uint32_t> lanes_used{0};

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
    // One sender, whatever PeerExportOptions::senders asked (the fake has no processes).
    absl::StatusOr<std::vector<uint64_t>> BytesSent(std::chrono::steady_clock::time_point) override {
      absl::MutexLock lock(&t->mu_);
      return std::vector<uint64_t>{sent};
    }
    FakePeerTransport* t;
    PeerOffer offer_;
    uint64_t sent = 0;  // under t->mu_
    std::vector<std::pair<const char*, uint64_t>> maps;
  };

  class Connection final : public PeerConnection {
   public:
    Connection(FakePeerTransport* t, std::string worker, std::vector<uint64_t> sizes, uint32_t lanes)
        : t_(t), worker_(std::move(worker)), sizes_(std::move(sizes)), lanes_(lanes) {}
    ~Connection() override {
      for (auto& [p, n] : destinations) {
        if (p != nullptr) munmap(p, n);
      }
      for (auto& [p, n] : kept_) munmap(p, n);  // as a killed helper's mappings go
    }
    uint32_t lanes() const override { return lanes_; }
    absl::Status Release(uint32_t d, std::chrono::steady_clock::time_point) override {
      if (d >= destinations.size() || destinations[d].first == nullptr) {
        return absl::InvalidArgumentError("destination unknown or released");
      }
      if (t_->write_on_release && destinations[d].second > 0) destinations[d].first[0] ^= 0x5a;
      if (t_->keep_mappings) {
        kept_.push_back(destinations[d]);
      } else {
        munmap(destinations[d].first, destinations[d].second);
      }
      destinations[d].first = nullptr;
      return absl::OkStatus();
    }
    absl::Status Read(const std::vector<PeerRead>& reads, std::chrono::steady_clock::time_point deadline) override {
      for (const PeerRead& r : reads) {
        if (r.region >= sizes_.size() || r.offset + r.n > sizes_[r.region]) {
          return absl::InvalidArgumentError("read outside the peer's regions");
        }
        if (r.destination >= destinations.size() || destinations[r.destination].first == nullptr ||
            r.at + r.n > destinations[r.destination].second) {
          return absl::InvalidArgumentError("read outside its destination");
        }
        char* dst = destinations[r.destination].first + r.at;
        if (t_->stalled) return absl::DeadlineExceededError("peer reads did not finish before the deadline");
        int64_t limit = t_->fail_after_bytes.load();
        if (limit >= 0 && static_cast<int64_t>(t_->bytes_read + r.n) > limit) {
          return absl::UnavailableError("peer connection failed: Connection reset by remote peer");
        }
        absl::MutexLock lock(&t_->mu_);
        auto it = t_->exports_.find(worker_);
        if (it == t_->exports_.end()) return absl::UnavailableError("the fake seed is gone");
        std::memcpy(dst, it->second->maps[r.region].first + r.offset, r.n);
        it->second->sent += r.n;
        int64_t at = t_->corrupt_at.load();
        if (r.region == 0 && at >= static_cast<int64_t>(r.offset) && at < static_cast<int64_t>(r.offset + r.n)) {
          dst[at - r.offset] ^= 0x5a;
        }
        t_->bytes_read += r.n;
      }
      return absl::OkStatus();
    }

    std::vector<std::pair<char*, uint64_t>> destinations;  // null once released

   private:
    FakePeerTransport* t_;
    std::string worker_;
    std::vector<uint64_t> sizes_;
    uint32_t lanes_;
    std::vector<std::pair<char*, uint64_t>> kept_;  // keep_mappings: "released", still mapped
  };

  absl::Mutex mu_;
  std::map<std::string, Export_*> exports_;
  int next_ = 0;
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_FAKE_PEER_TRANSPORT_H_
