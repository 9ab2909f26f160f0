// The emulated device backend: "device memory" is a memfd, copies are
// memcpy, and export/import go through the same fd path as CUDA VMM, so the
// whole device flow (placement, TP slices, staging, fd passing, client
// import, verification) runs on machines without a GPU.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/memory/device.h"
#include "common/memory/host_segment.h"
#include "common/base/status.h"

namespace weightd {
namespace {

constexpr char kUuidPrefix[] = "GPU-emulated-";

class EmulatedArena final : public DeviceArena {
 public:
  EmulatedArena(DeviceInfo device, std::unique_ptr<HostSegment> memory)
      : device_(std::move(device)), memory_(std::move(memory)) {}

  uint64_t size() const override { return memory_->size(); }
  const DeviceInfo& device() const override { return device_; }

  absl::Status CopyFromHost(uint64_t dst_offset, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                            uint64_t width, uint64_t rows) override {
    if (memory_->sealed()) return absl::FailedPreconditionError("arena is sealed");
    if (rows > 0 && dst_offset + (rows - 1) * dst_pitch + width > size()) {
      return absl::OutOfRangeError(absl::StrCat("copy of ", rows, " x ", width, " bytes at ", dst_offset,
                                                " overruns a ", size(), "-byte arena"));
    }
    for (uint64_t r = 0; r < rows; ++r) {
      std::memcpy(memory_->writable() + dst_offset + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
    }
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> RecordFence() override { return ++fences_; }
  absl::Status WaitFence(uint64_t) override { return absl::OkStatus(); }  // copies are synchronous
  absl::Status CopyToHost(uint64_t offset, void* dst, uint64_t n) override {
    if (offset + n > size()) return absl::OutOfRangeError("read past the arena");
    const char* base = memory_->sealed() ? memory_->data() : memory_->writable();
    std::memcpy(dst, base + offset, n);
    return absl::OkStatus();
  }
  absl::Status Seal() override { return memory_->sealed() ? absl::OkStatus() : memory_->Seal(/*lock=*/false); }
  int export_fd() const override { return memory_->fd(); }
  std::string export_handle() const override { return ""; }

 private:
  DeviceInfo device_;
  std::unique_ptr<HostSegment> memory_;
  uint64_t fences_ = 0;
};

class AlignedBuffer final : public PinnedBuffer {
 public:
  AlignedBuffer(char* data, uint64_t size) : data_(data), size_(size) {}
  ~AlignedBuffer() override { std::free(data_); }
  char* data() override { return data_; }
  uint64_t size() const override { return size_; }

 private:
  char* data_;
  uint64_t size_;
};

class EmulatedImport final : public ImportedArena {
 public:
  EmulatedImport(void* base, uint64_t size, int ordinal, bool writable)
      : base_(base), size_(size), ordinal_(ordinal), writable_(writable) {}
  ~EmulatedImport() override {
    if (base_ != nullptr) munmap(base_, size_);
  }
  const void* device_pointer() const override { return base_; }
  int device_ordinal() const override { return ordinal_; }
  uint64_t size() const override { return size_; }
  bool read_only() const override { return !writable_; }
  absl::Status CopyToHost(uint64_t offset, void* dst, uint64_t n) const override {
    if (offset + n > size_) return absl::OutOfRangeError("read past the imported arena");
    std::memcpy(dst, static_cast<const char*>(base_) + offset, n);
    return absl::OkStatus();
  }

 private:
  void* base_;
  uint64_t size_;
  int ordinal_;
  bool writable_;  // a copy-on-write mapping
};

class EmulatedBackend final : public DeviceBackend {
 public:
  explicit EmulatedBackend(int count) {
    for (int i = 0; i < count; ++i) devices_.push_back({i, absl::StrCat(kUuidPrefix, i), "emulated", 0});
  }
  SegmentBackend segment_backend() const override { return SegmentBackend::kEmulated; }
  absl::StatusOr<std::vector<DeviceInfo>> Devices() override { return devices_; }

  absl::StatusOr<std::unique_ptr<DeviceArena>> Allocate(const DeviceInfo& device, uint64_t size) override {
    WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<HostSegment> memory,
                             HostSegment::Create(absl::StrCat("arena:", device.uuid), size));
    return std::make_unique<EmulatedArena>(device, std::move(memory));
  }

  absl::StatusOr<std::unique_ptr<DeviceArena>> Adopt(const DeviceInfo& device, ScopedFd fd, uint64_t size) override {
    WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<HostSegment> memory, HostSegment::Adopt(std::move(fd), size, false));
    return std::make_unique<EmulatedArena>(device, std::move(memory));
  }

  absl::StatusOr<std::unique_ptr<PinnedBuffer>> AllocatePinned(uint64_t size) override {
    void* p = nullptr;
    if (posix_memalign(&p, 4096, std::max<uint64_t>(size, 1)) != 0) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot allocate a ", size, "-byte staging buffer"));
    }
    return std::make_unique<AlignedBuffer>(static_cast<char*>(p), size);
  }

  absl::StatusOr<std::unique_ptr<ImportedArena>> Import(ArenaExport exported) override {
    int ordinal = -1;
    if (!absl::StartsWith(exported.gpu_uuid, kUuidPrefix) ||
        !absl::SimpleAtoi(exported.gpu_uuid.substr(sizeof(kUuidPrefix) - 1), &ordinal)) {
      return absl::InvalidArgumentError(absl::StrCat("'", exported.gpu_uuid, "' is not an emulated device"));
    }
    if (!exported.fd.valid()) return absl::InvalidArgumentError("emulated arena import needs its fd");
    WEIGHTD_RETURN_IF_ERROR(CheckCopyOnWrite(segment_backend(), exported));
    void* base = nullptr;
    if (exported.size > 0) {
      absl::StatusOr<char*> mapped = MapSegmentFd(exported.fd.get(), exported.size, exported.copy_on_write);
      if (!mapped.ok()) return Annotate(mapped.status(), "emulated arena");
      base = *mapped;
    }
    return std::make_unique<EmulatedImport>(base, exported.size, ordinal, exported.copy_on_write);
  }

 private:
  std::vector<DeviceInfo> devices_;
};

}  // namespace

std::unique_ptr<DeviceBackend> MakeEmulatedBackend(int device_count) {
  return std::make_unique<EmulatedBackend>(device_count);
}

}  // namespace weightd
