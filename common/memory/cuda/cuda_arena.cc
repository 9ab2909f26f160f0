// Daemon-side CUDA arenas: device memory that the load pipeline fills with
// asynchronous copies on the arena's own stream, then seals and exports,
// either as a POSIX fd (VMM: cuMemCreate + cuMemExportToShareableHandle) or as
// cuIpcMemHandle bytes (legacy: cuMemAlloc + cuIpcGetMemHandle).
#include <fcntl.h>

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/memory/cuda/cuda_internal.h"
#include "common/base/align.h"
#include "common/base/status.h"
#include "common/base/scoped_fd.h"

namespace weightd {
namespace {

// cuMemAlloc has no granularity to ask for; 2 MiB is the page size of large
// device allocations, and cuIpcOpenMemHandle maps whole pages anyway.
constexpr uint64_t kLegacyGranularity = uint64_t{2} << 20;

absl::StatusOr<uint64_t> RoundUp(uint64_t size, uint64_t granularity) {
  std::optional<uint64_t> rounded = CheckedAlignUp(std::max<uint64_t>(size, 1), granularity);
  if (!rounded) return absl::ResourceExhaustedError(absl::StrCat("arena of ", size, " bytes"));
  return *rounded;
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
    CUmemAllocationProp prop = Prop(context);
    size_t granularity = 0;
    WEIGHTD_RETURN_IF_ERROR(
        WEIGHTD_CU(cu, MemGetAllocationGranularity, &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    WEIGHTD_ASSIGN_OR_RETURN(uint64_t rounded, RoundUp(size, granularity));
    std::unique_ptr<VmmMemory> m(new VmmMemory(cu, rounded));
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemCreate, &m->handle_, rounded, &prop, 0));
    m->created_ = true;
    WEIGHTD_RETURN_IF_ERROR(m->MapReadWrite(granularity, prop.location));
    return m;
  }

  // The allocation an earlier daemon process exported as `fd` (kept by the
  // fd store), imported and mapped read-write at a new address; `fd` stays
  // its export. cuMemMap refuses a size that is not the allocation's.
  static absl::StatusOr<std::unique_ptr<ArenaMemory>> Adopt(const CudaContext& context, ScopedFd fd, uint64_t size) {
    const CudaFunctions& cu = context.cu();
    CUmemAllocationProp prop = Prop(context);
    size_t granularity = 0;
    WEIGHTD_RETURN_IF_ERROR(
        WEIGHTD_CU(cu, MemGetAllocationGranularity, &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    if (size == 0 || size % granularity != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("arena size ", size, " is not a positive multiple of the granularity ", granularity));
    }
    std::unique_ptr<VmmMemory> m(new VmmMemory(cu, size));
    // For POSIX fds the handle argument is the fd itself, cast to a pointer.
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemImportFromShareableHandle, &m->handle_,
                                       reinterpret_cast<void*>(static_cast<uintptr_t>(fd.get())),
                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
    m->created_ = true;
    WEIGHTD_RETURN_IF_ERROR(m->MapReadWrite(granularity, prop.location));
    m->fd_ = std::move(fd);
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

  // Pinned device memory on the context's GPU, exportable as a POSIX fd.
  static CUmemAllocationProp Prop(const CudaContext& context) {
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = context.device();
    return prop;
  }

  // Reserves an address range for handle_, maps it and allows read-write
  // access from `location`; the destructor undoes what succeeded.
  absl::Status MapReadWrite(size_t granularity, const CUmemLocation& location) {
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu_, MemAddressReserve, &base_, size_, granularity, 0, 0));
    reserved_ = true;
    WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu_, MemMap, base_, size_, 0, handle_, 0));
    mapped_ = true;
    CUmemAccessDesc access = {};
    access.location = location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return WEIGHTD_CU(cu_, MemSetAccess, base_, size_, &access, 1);
  }

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

class CudaArena final : public DeviceArena {
 public:
  CudaArena(std::shared_ptr<CudaContext> context, DeviceInfo device, std::unique_ptr<ArenaMemory> memory,
            std::unique_ptr<CopyStream> stream, bool sealed = false)
      : context_(std::move(context)), device_(std::move(device)), memory_(std::move(memory)), stream_(std::move(stream)),
        sealed_(sealed) {}

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

absl::StatusOr<std::unique_ptr<DeviceArena>> AdoptVmmArena(std::shared_ptr<CudaContext> context, const DeviceInfo& device,
                                                           ScopedFd fd, uint64_t size) {
  WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context));
  const std::string where = absl::StrCat("adopting a ", size, "-byte arena on ", device.uuid);
  absl::StatusOr<std::unique_ptr<ArenaMemory>> memory = VmmMemory::Adopt(*context, std::move(fd), size);
  if (!memory.ok()) return Annotate(memory.status(), where);
  absl::StatusOr<std::unique_ptr<CopyStream>> stream = CopyStream::Create(*context);
  if (!stream.ok()) return Annotate(stream.status(), where);
  return std::make_unique<CudaArena>(std::move(context), device, std::move(*memory), std::move(*stream), /*sealed=*/true);
}

absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateLegacyArena(std::shared_ptr<CudaContext> context,
                                                                 const DeviceInfo& device, uint64_t size) {
  return AllocateArena(std::move(context), device, size, &LegacyMemory::Create);
}

}  // namespace weightd
