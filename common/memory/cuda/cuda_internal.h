// Internals shared by the CUDA implementation files (common/cuda_*.cc) and
// the GPU check program (tests/gpu/). This header includes <cuda.h>: nothing
// outside those files may include it (the rest of weightd sees only
// common/memory/device.h and common/memory/cuda/cuda_driver.h).
#ifndef WEIGHTD_COMMON_MEMORY_CUDA_CUDA_INTERNAL_H_
#define WEIGHTD_COMMON_MEMORY_CUDA_CUDA_INTERNAL_H_

#include <cuda.h>
#include <cudaTypedefs.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/memory/cuda/cuda_driver.h"
#include "common/memory/device.h"
#include "absl/synchronization/mutex.h"

namespace weightd {

// Every driver function weightd calls, as X(Name, ABI): the member `Name` has
// the type PFN_cu<Name>_v<ABI> from <cudaTypedefs.h> and is resolved as
// "cu<Name>" at kCudaAbiVersion. ABI is the version of the function's
// signature that CUDA 12.0 exports (cuMemAlloc is cuMemAlloc_v2 = 3020).
#define WEIGHTD_CUDA_FUNCTIONS(X)    \
  X(GetErrorName, 6000)              \
  X(GetErrorString, 6000)            \
  X(Init, 2000)                      \
  X(DeviceGet, 2000)                 \
  X(DeviceGetCount, 2000)            \
  X(DeviceGetName, 2000)             \
  X(DeviceTotalMem, 3020)            \
  X(DeviceGetUuid, 11040)            \
  X(DeviceGetAttribute, 2000)        \
  X(DevicePrimaryCtxRetain, 7000)    \
  X(DevicePrimaryCtxRelease, 11000)  \
  X(CtxPushCurrent, 4000)            \
  X(CtxPopCurrent, 4000)             \
  X(CtxSynchronize, 2000)            \
  X(StreamCreate, 2000)              \
  X(StreamDestroy, 4000)             \
  X(StreamSynchronize, 2000)         \
  X(EventCreate, 2000)               \
  X(EventRecord, 2000)               \
  X(EventSynchronize, 2000)          \
  X(EventDestroy, 4000)              \
  X(MemGetInfo, 3020)                \
  X(MemGetAllocationGranularity, 10020) \
  X(MemCreate, 10020)                \
  X(MemRelease, 10020)               \
  X(MemExportToShareableHandle, 10020) \
  X(MemImportFromShareableHandle, 10020) \
  X(MemAddressReserve, 10020)        \
  X(MemAddressFree, 10020)           \
  X(MemMap, 10020)                   \
  X(MemUnmap, 10020)                 \
  X(MemSetAccess, 10020)             \
  X(MemGetAccess, 10020)             \
  X(MemAlloc, 3020)                  \
  X(MemGetAddressRange, 3020)        \
  X(MemFree, 3020)                   \
  X(MemsetD8, 3020)                  \
  X(MemsetD8Async, 3020)             \
  X(MemcpyHtoD, 3020)                \
  X(MemcpyHtoDAsync, 3020)           \
  X(MemcpyDtoH, 3020)                \
  X(MemcpyDtoDAsync, 3020)           \
  X(Memcpy2DAsync, 3020)             \
  X(MemHostAlloc, 2020)              \
  X(MemFreeHost, 2000)               \
  X(MemHostRegister, 6050)           \
  X(MemHostUnregister, 4000)         \
  X(MemHostGetDevicePointer, 3020)   \
  X(IpcGetMemHandle, 4010)           \
  X(IpcOpenMemHandle, 11000)         \
  X(IpcCloseMemHandle, 4010)

struct CudaFunctions {
#define WEIGHTD_CUDA_DECLARE_(name, abi) PFN_cu##name##_v##abi name = nullptr;
  WEIGHTD_CUDA_FUNCTIONS(WEIGHTD_CUDA_DECLARE_)
#undef WEIGHTD_CUDA_DECLARE_
};

// fns.Name(args...) as a status naming "cuName" (OK on CUDA_SUCCESS).
#define WEIGHTD_CU(fns, name, ...) ::weightd::CudaToStatus("cu" #name, (fns).name(__VA_ARGS__))

// "GPU-8f3c0b7e-...": a device UUID formatted as nvidia-smi prints it.
std::string FormatGpuUuid(const CUuuid& uuid);

// A retained primary context of one device (the context the runtime API and
// frameworks such as PyTorch use, so device pointers are valid in theirs),
// released on destruction. Shared by a backend and every arena, buffer and
// import made on that device, so it outlives all of them. Thread-safe.
class CudaContext {
 public:
  static absl::StatusOr<std::shared_ptr<CudaContext>> Retain(const CudaDriver& driver, int ordinal);
  ~CudaContext();
  CudaContext(const CudaContext&) = delete;
  CudaContext& operator=(const CudaContext&) = delete;

  const CudaFunctions& cu() const { return driver_.fn(); }
  CUcontext get() const { return context_; }
  CUdevice device() const { return device_; }
  int ordinal() const { return ordinal_; }

 private:
  CudaContext(const CudaDriver& driver, int ordinal, CUdevice device, CUcontext context)
      : driver_(driver), ordinal_(ordinal), device_(device), context_(context) {}

  const CudaDriver& driver_;
  int ordinal_;
  CUdevice device_;
  CUcontext context_;
};

// Makes a context current on this thread for one scope, then restores the
// thread's previous context (push/pop), so a client's own current context is
// left as it was. Move-only; use on one thread.
class ScopedContext {
 public:
  static absl::StatusOr<ScopedContext> Enter(const CudaContext& context);
  ScopedContext(ScopedContext&& other) noexcept;
  ScopedContext& operator=(ScopedContext&&) = delete;
  ~ScopedContext();

 private:
  explicit ScopedContext(const CudaFunctions* cu) : cu_(cu) {}
  const CudaFunctions* cu_;  // null once moved from
};

// The stream of one daemon-side arena, with its copies and fences. Every
// call needs the arena's context current (the destructor too, which waits for
// the stream). Copy is called by one thread at a time; RecordFence and
// WaitFence may be called from different threads.
class CopyStream {
 public:
  static absl::StatusOr<std::unique_ptr<CopyStream>> Create(const CudaContext& context);
  ~CopyStream();
  CopyStream(const CopyStream&) = delete;
  CopyStream& operator=(const CopyStream&) = delete;

  // Enqueues a zero fill of `n` bytes at `dst`.
  absl::Status Zero(CUdeviceptr dst, uint64_t n);
  // Enqueues `rows` rows of `width` bytes (pitches as DeviceArena::CopyFromHost;
  // the caller has checked the bounds). Contiguous rows become one copy;
  // pitches over CU_DEVICE_ATTRIBUTE_MAX_PITCH become one copy per row.
  absl::Status Copy(CUdeviceptr dst, uint64_t dst_pitch, const void* src, uint64_t src_pitch, uint64_t width,
                    uint64_t rows);
  // Fences complete in order: waiting for one retires all earlier ones.
  // INVALID_ARGUMENT for a fence never recorded.
  absl::StatusOr<uint64_t> RecordFence();
  absl::Status WaitFence(uint64_t fence);
  absl::Status Synchronize();

 private:
  CopyStream(const CudaFunctions& cu, uint64_t max_pitch) : cu_(cu), max_pitch_(max_pitch) {}

  const CudaFunctions& cu_;
  const uint64_t max_pitch_;
  CUstream stream_ = nullptr;
  absl::Mutex mu_;
  std::vector<CUevent> events_ ABSL_GUARDED_BY(mu_);           // every event created; destroyed with the stream
  std::vector<CUevent> free_ ABSL_GUARDED_BY(mu_);             // events not pending
  std::map<uint64_t, CUevent> pending_ ABSL_GUARDED_BY(mu_);   // recorded fences not yet waited for
  uint64_t last_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t completed_ ABSL_GUARDED_BY(mu_) = 0;
};

// Daemon side (common/cuda_arena.cc). A zero-filled arena of at least `size`
// bytes on the context's device: VMM (cuMemCreate, exportable as a POSIX fd)
// or legacy (cuMemAlloc, exportable as cuIpcGetMemHandle bytes).
absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateVmmArena(std::shared_ptr<CudaContext> context,
                                                              const DeviceInfo& device, uint64_t size);
absl::StatusOr<std::unique_ptr<DeviceArena>> AllocateLegacyArena(std::shared_ptr<CudaContext> context,
                                                                 const DeviceInfo& device, uint64_t size);
// A VMM arena exported as `fd` by an earlier daemon process (the fd store),
// imported, mapped, and sealed: its export is `fd` again.
absl::StatusOr<std::unique_ptr<DeviceArena>> AdoptVmmArena(std::shared_ptr<CudaContext> context, const DeviceInfo& device,
                                                           ScopedFd fd, uint64_t size);

// Client side (common/cuda_import.cc). Maps an exported arena into this
// process on the context's device.
absl::StatusOr<std::unique_ptr<ImportedArena>> ImportVmmArena(std::shared_ptr<CudaContext> context,
                                                              ArenaExport exported);
absl::StatusOr<std::unique_ptr<ImportedArena>> ImportLegacyArena(std::shared_ptr<CudaContext> context,
                                                                 ArenaExport exported);

// The checks shared by every copy to or from an arena: OUT_OF_RANGE unless
// `rows` rows of `width` bytes, `pitch` apart from `offset`, fit in `size`
// (overflow-safe); INVALID_ARGUMENT when rows overlap (pitch < width).
absl::Status CheckArenaRange(uint64_t size, uint64_t offset, uint64_t pitch, uint64_t width, uint64_t rows,
                             const char* what);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_MEMORY_CUDA_CUDA_INTERNAL_H_
