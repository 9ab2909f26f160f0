// A DeviceBackend for tests: the emulated backend, wrapped to count the
// arenas alive, fail a chosen Allocate, and optionally export every arena by
// handle bytes with no fd, as cuda-legacy-ipc arenas are.
#ifndef WEIGHTD_TESTS_TESTING_COUNTING_BACKEND_H_
#define WEIGHTD_TESTS_TESTING_COUNTING_BACKEND_H_

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "common/memory/device.h"
#include "common/base/status.h"

namespace weightd::testing {

class CountingBackend final : public DeviceBackend {
 public:
  struct Options {
    int devices = 2;               // emulated GPUs "GPU-emulated-0".."-N-1"
    int fail_allocation = -1;      // the 0-based Allocate call that fails (RESOURCE_EXHAUSTED), or -1
    bool export_by_handle = false;  // export_fd() -1 and 64 handle bytes, like cuda-legacy-ipc
  };
  CountingBackend() : CountingBackend(Options{}) {}
  explicit CountingBackend(Options options) : options_(options), inner_(MakeEmulatedBackend(options.devices)) {}

  SegmentBackend segment_backend() const override { return SegmentBackend::kEmulated; }
  absl::StatusOr<std::vector<DeviceInfo>> Devices() override { return inner_->Devices(); }
  absl::StatusOr<std::unique_ptr<DeviceArena>> Allocate(const DeviceInfo& d, uint64_t size) override {
    if (allocations_++ == options_.fail_allocation) return absl::ResourceExhaustedError("out of device memory (injected)");
    WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<DeviceArena> arena, inner_->Allocate(d, size));
    return std::unique_ptr<DeviceArena>(new Counted(std::move(arena), &live_, options_.export_by_handle));
  }
  absl::StatusOr<std::unique_ptr<PinnedBuffer>> AllocatePinned(uint64_t size) override {
    return inner_->AllocatePinned(size);
  }
  absl::StatusOr<std::unique_ptr<ImportedArena>> Import(ArenaExport e) override { return inner_->Import(std::move(e)); }

  int live() const { return live_.load(); }  // arenas allocated and not yet destroyed
  int allocations() const { return allocations_; }

 private:
  class Counted final : public DeviceArena {
   public:
    Counted(std::unique_ptr<DeviceArena> inner, std::atomic<int>* live, bool by_handle)
        : inner_(std::move(inner)), live_(live), by_handle_(by_handle) {
      ++*live_;
    }
    ~Counted() override { --*live_; }
    uint64_t size() const override { return inner_->size(); }
    const DeviceInfo& device() const override { return inner_->device(); }
    absl::Status CopyFromHost(uint64_t a, uint64_t b, const void* c, uint64_t d, uint64_t e, uint64_t f) override {
      return inner_->CopyFromHost(a, b, c, d, e, f);
    }
    absl::StatusOr<uint64_t> RecordFence() override { return inner_->RecordFence(); }
    absl::Status WaitFence(uint64_t f) override { return inner_->WaitFence(f); }
    absl::Status CopyToHost(uint64_t o, void* d, uint64_t n) override { return inner_->CopyToHost(o, d, n); }
    absl::Status Seal() override { return inner_->Seal(); }
    int export_fd() const override { return by_handle_ ? -1 : inner_->export_fd(); }
    std::string export_handle() const override { return by_handle_ ? std::string(64, 'h') : inner_->export_handle(); }

   private:
    std::unique_ptr<DeviceArena> inner_;
    std::atomic<int>* live_;
    bool by_handle_;
  };

  Options options_;
  std::unique_ptr<DeviceBackend> inner_;
  int allocations_ = 0;
  std::atomic<int> live_{0};
};

}  // namespace weightd::testing

#endif  // WEIGHTD_TESTS_TESTING_COUNTING_BACKEND_H_
