// Client-side CUDA imports: an arena exported by the daemon, mapped into this
// process. VMM: cuMemImportFromShareableHandle on the received fd, reserve,
// map, and read-only access where the driver grants it. Legacy:
// cuIpcOpenMemHandle on the handle bytes.
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "common/memory/cuda/cuda_internal.h"
#include "common/base/log.h"
#include "common/base/status.h"

namespace weightd {
namespace {

// One imported mapping; `unmap` undoes it with the context current.
class CudaImport final : public ImportedArena {
 public:
  using Unmap = void (*)(const CudaFunctions&, CUdeviceptr, uint64_t);

  CudaImport(std::shared_ptr<CudaContext> context, CUdeviceptr base, uint64_t size, bool read_only, Unmap unmap)
      : context_(std::move(context)), base_(base), size_(size), read_only_(read_only), unmap_(unmap) {}
  // Waits for the work queued in this process's context on the device, then
  // unmaps: cuMemUnmap and cuIpcCloseMemHandle do not wait for kernels that
  // still read the arena (PyTorch's expandable segments synchronise before
  // unmapping for the same reason), and a kernel that faults on an unmapped
  // address kills the whole context. Like cudaFree, so a DLPack deleter
  // called while kernels are queued is safe.
  ~CudaImport() override {
    absl::StatusOr<ScopedContext> scope = ScopedContext::Enter(*context_);
    if (!scope.ok()) return;
    context_->cu().CtxSynchronize();
    unmap_(context_->cu(), base_, size_);
  }

  const void* device_pointer() const override { return reinterpret_cast<const void*>(static_cast<uintptr_t>(base_)); }
  int device_ordinal() const override { return context_->ordinal(); }
  uint64_t size() const override { return size_; }
  bool read_only() const override { return read_only_; }

  absl::Status CopyToHost(uint64_t offset, void* dst, uint64_t n) const override {
    WEIGHTD_RETURN_IF_ERROR(CheckArenaRange(size_, offset, n, n, 1, "read of an imported arena"));
    if (n == 0) return absl::OkStatus();
    WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context_));
    return WEIGHTD_CU(context_->cu(), MemcpyDtoH, dst, base_ + offset, n);
  }

 private:
  std::shared_ptr<CudaContext> context_;
  CUdeviceptr base_;
  uint64_t size_;
  bool read_only_;
  Unmap unmap_;
};

void UnmapVmm(const CudaFunctions& cu, CUdeviceptr base, uint64_t size) {
  cu.MemUnmap(base, size);
  cu.MemAddressFree(base, size);
}

void CloseIpc(const CudaFunctions& cu, CUdeviceptr base, uint64_t) { cu.IpcCloseMemHandle(base); }

// Read-only access first; when the driver refuses it, read-write, said once
// per process in the log.
absl::StatusOr<bool> SetAccess(const CudaContext& context, CUdeviceptr base, uint64_t size) {
  CUmemAccessDesc access = {};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = context.device();
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
  absl::Status read_only = WEIGHTD_CU(context.cu(), MemSetAccess, base, size, &access, 1);
  if (read_only.ok()) {
    // Reported read-only only when the driver says the range is: PROT_READ on
    // device memory is not documented either way (cuMemSetAccess).
    // A failed query keeps the protection that was set (and says so once).
    unsigned long long granted = 0;
    absl::Status query = WEIGHTD_CU(context.cu(), MemGetAccess, &granted, &access.location, base);
    if (!query.ok()) {
      static std::once_flag logged_query;
      std::call_once(logged_query, [&] {
        LogWarning(absl::StrCat("cannot confirm the read-only mapping of a weightd arena (", query.message(),
                                "); it stays PROT_READ as set"));
      });
      return true;
    }
    if (granted == CU_MEM_ACCESS_FLAGS_PROT_READ) return true;
    read_only = absl::UnimplementedError(
        absl::StrCat("cuMemGetAccess reports access flags ", granted, " after a PROT_READ cuMemSetAccess"));
  }
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(context.cu(), MemSetAccess, base, size, &access, 1));
  static std::once_flag logged;
  std::call_once(logged, [&] {
    LogWarning(absl::StrCat("the CUDA driver did not grant a read-only mapping of a weightd arena (", read_only.message(),
                            "); device arenas are mapped read-write in this process"));
  });
  return false;
}

// Releases an imported allocation handle unless the mapping took it over.
struct AllocationHandle {
  const CudaFunctions& cu;
  CUmemGenericAllocationHandle handle = 0;
  bool held = false;
  ~AllocationHandle() {
    if (held) cu.MemRelease(handle);
  }
};

absl::StatusOr<std::unique_ptr<ImportedArena>> MapVmm(std::shared_ptr<CudaContext> context, int fd, uint64_t size) {
  const CudaFunctions& cu = context->cu();
  CUmemAllocationProp prop = {};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = context->device();
  size_t granularity = 0;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemGetAllocationGranularity, &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  if (size == 0 || size % granularity != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("arena size ", size, " is not a positive multiple of the mapping granularity ", granularity));
  }
  AllocationHandle allocation{cu};
  // For POSIX fds the handle argument is the fd itself, cast to a pointer.
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemImportFromShareableHandle, &allocation.handle,
                                     reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  allocation.held = true;
  CUdeviceptr base = 0;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(cu, MemAddressReserve, &base, size, granularity, 0, 0));
  absl::Status s = WEIGHTD_CU(cu, MemMap, base, size, 0, allocation.handle, 0);
  if (!s.ok()) {
    cu.MemAddressFree(base, size);
    return s;
  }
  // The mapping now holds the memory; the handle is released on return.
  absl::StatusOr<bool> read_only = SetAccess(*context, base, size);
  if (!read_only.ok()) {
    UnmapVmm(cu, base, size);
    return read_only.status();
  }
  return std::make_unique<CudaImport>(std::move(context), base, size, *read_only, &UnmapVmm);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ImportedArena>> ImportVmmArena(std::shared_ptr<CudaContext> context,
                                                              ArenaExport exported) {
  const std::string where = absl::StrCat("importing a ", exported.size, "-byte arena on ", exported.gpu_uuid);
  if (!exported.fd.valid()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a cuda arena is imported from its fd, and none was received"));
  }
  WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context));
  absl::StatusOr<std::unique_ptr<ImportedArena>> imported = MapVmm(std::move(context), exported.fd.get(), exported.size);
  if (!imported.ok()) return Annotate(imported.status(), where);
  return imported;
}

absl::StatusOr<std::unique_ptr<ImportedArena>> ImportLegacyArena(std::shared_ptr<CudaContext> context,
                                                                 ArenaExport exported) {
  const std::string where = absl::StrCat("importing a ", exported.size, "-byte cuda-legacy-ipc arena on ", exported.gpu_uuid);
  if (exported.handle.size() != CU_IPC_HANDLE_SIZE) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": the IPC handle has ", exported.handle.size(), " bytes, expected ", CU_IPC_HANDLE_SIZE));
  }
  CUipcMemHandle handle = {};
  std::memcpy(handle.reserved, exported.handle.data(), CU_IPC_HANDLE_SIZE);
  const CudaFunctions& cu = context->cu();
  WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context));
  CUdeviceptr base = 0;
  absl::Status s = WEIGHTD_CU(cu, IpcOpenMemHandle, &base, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
  if (!s.ok()) return Annotate(s, where);
  // The handle names the whole allocation; its size bounds the claimed one.
  CUdeviceptr start = 0;
  size_t actual = 0;
  s = WEIGHTD_CU(cu, MemGetAddressRange, &start, &actual, base);
  if (s.ok() && exported.size > actual) {
    s = absl::InvalidArgumentError(absl::StrCat("the allocation behind the handle has only ", actual, " bytes"));
  }
  if (!s.ok()) {
    cu.IpcCloseMemHandle(base);
    return Annotate(s, where);
  }
  return std::make_unique<CudaImport>(std::move(context), base, exported.size, /*read_only=*/false, &CloseIpc);
}

}  // namespace weightd
