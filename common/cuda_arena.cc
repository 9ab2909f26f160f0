// Daemon-side CUDA arenas: device memory that the load pipeline fills with
// asynchronous copies on the arena's own stream, then seals and exports,
// either as a POSIX fd (VMM: cuMemCreate + cuMemExportToShareableHandle) or as
// cuIpcMemHandle bytes (legacy: cuMemAlloc + cuIpcGetMemHandle).
#include <fcntl.h>

#include <map>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/cuda_internal.h"
#include "common/status.h"
#include "common/unix_socket.h"

namespace weightd {
namespace {

// cuMemAlloc has no granularity to ask for; 2 MiB is the page size of large
// device allocations, and cuIpcOpenMemHandle maps whole pages anyway.
constexpr uint64_t kLegacyGranularity = uint64_t{2} << 20;

absl::StatusOr<uint64_t> RoundUp(uint64_t size, uint64_t granularity) {
  size = std::max<uint64_t>(size, 1);
  if (size > UINT64_MAX - granularity) return absl::ResourceExhaustedError(absl::StrCat("arena of ", size, " bytes"));
  return (size + granularity - 1) / granularity * granularity;
}

// The device memory of one arena and how it is exported. Destroyed with the
// arena's context current.
class ArenaMemory {
 public:
  virtual ~ArenaMemory() = default;
  virtual CUdeviceptr base() const = 0;
  virtual uint64_t size() const = 0;
  virtual absl::Status Export() = 0;
  virtual int fd() const { return -1; }
  virtual std::string handle() const { return ""; }
};

// cuMemCreate'd physical memory, mapped read-write at a reserved address.
class VmmMemory final : public ArenaMemory {
 public:
  static absl::StatusOr<std::unique_ptr<ArenaMemory>> Create(const CudaContext& context, uint64_t size) {
    const CudaFunctions& cu = context.cu();
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = context.device();
    size_t granularity = 0;
    WEIGHTD_RETURN_IF_ERROR(
        WEIGHTD_CU(cu, MemGetAllocationGranularity, &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    WEIGHTD_ASSIGN_OR_RETURN(uint64_t rounded, RoundUp(size, granularity));
    std::unique_ptr<VmmMemory> m(new VmmMemory(cu, rounded));
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemCreate, &m->handle_, rounded, &prop, 0));
    m->created_ = true;
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemAddressReserve, &m->base_, rounded, granularity, 0, 0));
    m->reserved_ = true;
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemMap, m->base_, rounded, 0, m->handle_, 0));
    m->mapped_ = true;
    CUmemAccessDesc access = {};
    access.location = prop.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemSetAccess, m->base_, rounded, &access, 1));
    return m;
  }

  ~VmmMemory() override {
    if (mapped_) cu_.MemUnmap(base_, size_);
    if (reserved_) cu_.MemAddressFree(base_, size_);
    if (created_) cu_.MemRelease(handle_);
  }

  CUdeviceptr base() const override { return base_; }
  uint64_t size() const override { return size_; }
  int fd() const override { return fd_.get(); }

  absl::Status Export() override {
    int fd = -1;
    WEIGHTD_RETURN_IF_ERROR(
        WEIGHTD_CU(cu_, MemExportToShareableHandle, &fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    fd_ = ScopedFd(fd);
    // The fd travels only over SCM_RIGHTS; never into a child of the daemon.
    if (fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) return ErrnoToStatus("fcntl(FD_CLOEXEC) on the exported arena fd", errno);
    return absl::OkStatus();
  }

 private:
  VmmMemory(const CudaFunctions& cu, uint64_t size) : cu_(cu), size_(size) {}

  const CudaFunctions& cu_;
  uint64_t size_;
  CUmemGenericAllocationHandle handle_ = 0;
  CUdeviceptr base_ = 0;
  bool created_ = false, reserved_ = false, mapped_ = false;
  ScopedFd fd_;
};

// cuMemAlloc'd memory, exported as the 64 bytes of a CUipcMemHandle.
class LegacyMemory final : public ArenaMemory {
 public:
  static absl::StatusOr<std::unique_ptr<ArenaMemory>> Create(const CudaContext& context, uint64_t size) {
    WEIGHTD_ASSIGN_OR_RETURN(uint64_t rounded, RoundUp(size, kLegacyGranularity));
    std::unique_ptr<LegacyMemory> m(new LegacyMemory(context.cu(), rounded));
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(context.cu(), MemAlloc, &m->base_, rounded));
    return m;
  }
  ~LegacyMemory() override {
    if (base_ != 0) cu_.MemFree(base_);
  }

  CUdeviceptr base() const override { return base_; }
  uint64_t size() const override { return size_; }
  std::string handle() const override { return handle_; }

  absl::Status Export() override {
    CUipcMemHandle handle = {};
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu_, IpcGetMemHandle, &handle, base_));
    handle_.assign(handle.reserved, CU_IPC_HANDLE_SIZE);
    return absl::OkStatus();
  }

 private:
  LegacyMemory(const CudaFunctions& cu, uint64_t size) : cu_(cu), size_(size) {}

  const CudaFunctions& cu_;
  uint64_t size_;
  CUdeviceptr base_ = 0;
  std::string handle_;
};

// One non-blocking stream with its copies and fences. Calls need the
// context current; the destructor waits for the stream.
class CopyStream {
 public:
  static absl::StatusOr<std::unique_ptr<CopyStream>> Create(const CudaContext& context) {
    const CudaFunctions& cu = context.cu();
    int max_pitch = 0;
    WEIGHTD_RETURN_IF_ERROR(
        WEIGHTD_CU(cu, DeviceGetAttribute, &max_pitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, context.device()));
    std::unique_ptr<CopyStream> s(new CopyStream(cu, static_cast<uint64_t>(max_pitch)));
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, StreamCreate, &s->stream_, CU_STREAM_NON_BLOCKING));
    return s;
  }

  ~CopyStream() {
    if (stream_ == nullptr) return;
    cu_.StreamSynchronize(stream_);
    for (CUevent e : events_) cu_.EventDestroy(e);
    cu_.StreamDestroy(stream_);
  }

  absl::Status Zero(CUdeviceptr dst, uint64_t n) { return WEIGHTD_CU(cu_, MemsetD8Async, dst, 0, n, stream_); }

  // Contiguous rows become one copy; pitches the 2D engine cannot take
  // (over CU_DEVICE_ATTRIBUTE_MAX_PITCH) become one copy per row.
  absl::Status Copy(CUdeviceptr dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch, uint64_t width,
                    uint64_t rows) {
    if (rows == 0 || width == 0) return absl::OkStatus();
    if (rows == 1 || (dst_pitch == width && src_pitch == width)) {
      return WEIGHTD_CU(cu_, MemcpyHtoDAsync, dst, src, width * rows, stream_);
    }
    if (dst_pitch <= max_pitch_ && src_pitch <= max_pitch_) {
      CUDA_MEMCPY2D copy = {};
      copy.srcMemoryType = CU_MEMORYTYPE_HOST;
      copy.srcHost = src;
      copy.srcPitch = src_pitch;
      copy.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      copy.dstDevice = dst;
      copy.dstPitch = dst_pitch;
      copy.WidthInBytes = width;
      copy.Height = rows;
      return WEIGHTD_CU(cu_, Memcpy2DAsync, &copy, stream_);
    }
    for (uint64_t r = 0; r < rows; ++r) {
      WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu_, MemcpyHtoDAsync, dst + r * dst_pitch,
                                         static_cast<const char*>(src) + r * src_pitch, width, stream_));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> RecordFence() {
    std::lock_guard<std::mutex> lock(mu_);
    CUevent event = nullptr;
    if (free_.empty()) {
      WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu_, EventCreate, &event, CU_EVENT_DISABLE_TIMING));
      events_.push_back(event);
    } else {
      event = free_.back();
      free_.pop_back();
    }
    absl::Status recorded = WEIGHTD_CU(cu_, EventRecord, event, stream_);
    if (!recorded.ok()) {
      free_.push_back(event);
      return recorded;
    }
    pending_[++last_] = event;
    return last_;
  }

  // Waits without holding the lock, so another thread can record the next
  // fence meanwhile. Fences complete in order: waiting for one retires all
  // earlier ones.
  absl::Status WaitFence(uint64_t fence) {
    CUevent event = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fence <= completed_) return absl::OkStatus();
      if (fence > last_) {
        return absl::InvalidArgumentError(absl::StrCat("fence ", fence, " was never recorded (the last is ", last_, ")"));
      }
      event = pending_.at(fence);
    }
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu_, EventSynchronize, event));
    std::lock_guard<std::mutex> lock(mu_);
    while (!pending_.empty() && pending_.begin()->first <= fence) {
      free_.push_back(pending_.begin()->second);
      pending_.erase(pending_.begin());
    }
    completed_ = std::max(completed_, fence);
    return absl::OkStatus();
  }

  absl::Status Synchronize() { return WEIGHTD_CU(cu_, StreamSynchronize, stream_); }

 private:
  CopyStream(const CudaFunctions& cu, uint64_t max_pitch) : cu_(cu), max_pitch_(max_pitch) {}

  const CudaFunctions& cu_;
  const uint64_t max_pitch_;
  CUstream stream_ = nullptr;
  std::mutex mu_;
  std::vector<CUevent> events_;           // every event created, destroyed with the stream
  std::vector<CUevent> free_;             // events not pending
  std::map<uint64_t, CUevent> pending_;   // recorded fences not yet waited for
  uint64_t last_ = 0, completed_ = 0;
};

class CudaArena final : public DeviceArena {
 public:
  CudaArena(std::shared_ptr<CudaContext> context, DeviceInfo device, std::unique_ptr<ArenaMemory> memory,
            std::unique_ptr<CopyStream> stream)
      : context_(std::move(context)), device_(std::move(device)), memory_(std::move(memory)), stream_(std::move(stream)) {}

  ~CudaArena() override {
    absl::StatusOr<ScopedContext> scope = ScopedContext::Enter(*context_);
    if (!scope.ok()) {  // the driver is gone (process exit): nothing left to free
      stream_.release();
      memory_.release();
      return;
    }
    stream_.reset();  // waits for pending copies before the memory goes
    memory_.reset();
  }

  uint64_t size() const override { return memory_->size(); }
  const DeviceInfo& device() const override { return device_; }

  absl::Status CopyFromHost(uint64_t dst_offset, uint64_t dst_pitch, const void* src, uint64_t src_pitch,
                            uint64_t width, uint64_t rows) override {
    if (sealed_) return absl::FailedPreconditionError(absl::StrCat("arena on ", device_.uuid, " is sealed"));
    WEIGHTD_RETURN_IF_ERROR(CheckArenaRange(size(), dst_offset, dst_pitch, width, rows, "copy"));
    if (rows > 1 && src_pitch < width) {
      return absl::InvalidArgumentError(absl::StrCat("copy: source pitch ", src_pitch, " is less than the row width ", width));
    }
    WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context_));
    return Where(stream_->Copy(memory_->base() + dst_offset, dst_pitch, src, src_pitch, width, rows));
  }

  absl::StatusOr<uint64_t> RecordFence() override {
    WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context_));
    absl::StatusOr<uint64_t> fence = stream_->RecordFence();
    if (!fence.ok()) return Where(fence.status());
    return fence;
  }

  absl::Status WaitFence(uint64_t fence) override {
    WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context_));
    return Where(stream_->WaitFence(fence));
  }

  absl::Status CopyToHost(uint64_t offset, void* dst, uint64_t n) override {
    WEIGHTD_RETURN_IF_ERROR(CheckArenaRange(size(), offset, n, n, 1, "read"));
    if (n == 0) return absl::OkStatus();
    WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context_));
    WEIGHTD_RETURN_IF_ERROR(Where(stream_->Synchronize()));
    return Where(WEIGHTD_CU(context_->cu(), MemcpyDtoH, dst, memory_->base() + offset, n));
  }

  // The daemon keeps its own mapping read-write: clients get read-only ones,
  // and nothing in the daemon writes after the last copy.
  absl::Status Seal() override {
    if (sealed_) return absl::OkStatus();
    WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context_));
    WEIGHTD_RETURN_IF_ERROR(Where(stream_->Synchronize()));
    WEIGHTD_RETURN_IF_ERROR(Where(memory_->Export()));
    sealed_ = true;
    return absl::OkStatus();
  }

  int export_fd() const override { return memory_->fd(); }
  std::string export_handle() const override { return memory_->handle(); }

 private:
  absl::Status Where(const absl::Status& s) const {
    return Annotate(s, absl::StrCat(memory_->size(), "-byte arena on ", device_.uuid));
  }

  std::shared_ptr<CudaContext> context_;
  DeviceInfo device_;
  std::unique_ptr<ArenaMemory> memory_;
  std::unique_ptr<CopyStream> stream_;
  bool sealed_ = false;
};

using MemoryFactory = absl::StatusOr<std::unique_ptr<ArenaMemory>> (*)(const CudaContext&, uint64_t);

absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateArena(std::shared_ptr<CudaContext> context, DeviceInfo device,
                                                           uint64_t size, MemoryFactory make_memory) {
  WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context));
  const std::string where = absl::StrCat("arena of ", size, " bytes on ", device.uuid);
  absl::StatusOr<std::unique_ptr<ArenaMemory>> memory = make_memory(*context, size);
  if (!memory.ok()) return Annotate(memory.status(), where);
  absl::StatusOr<std::unique_ptr<CopyStream>> stream = CopyStream::Create(*context);
  if (!stream.ok()) return Annotate(stream.status(), where);
  // Ordered before every copy on the same stream; no need to wait here.
  absl::Status zeroed = (*stream)->Zero((*memory)->base(), (*memory)->size());
  if (!zeroed.ok()) return Annotate(zeroed, where);
  return std::make_unique<CudaArena>(std::move(context), std::move(device), std::move(*memory), std::move(*stream));
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateVmmArena(std::shared_ptr<CudaContext> context,
                                                              const DeviceInfo& device, uint64_t size) {
  return AllocateArena(std::move(context), device, size, &VmmMemory::Create);
}

absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateLegacyArena(std::shared_ptr<CudaContext> context,
                                                                 const DeviceInfo& device, uint64_t size) {
  return AllocateArena(std::move(context), device, size, &LegacyMemory::Create);
}

}  // namespace weightd
