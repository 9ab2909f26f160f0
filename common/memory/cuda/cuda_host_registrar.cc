// The CUDA HostRegistrar (common/memory/host_registrar.h). The rules it
// follows, from the CUDA Driver API reference (cuMemHostRegister,
// cuMemHostGetDevicePointer, cuMemHostUnregister, CUdevice_attribute):
//   - CU_MEMHOSTREGISTER_DEVICEMAP maps the range into the CUDA address space;
//     cuMemHostGetDevicePointer (flags 0) then gives its device address,
//     which may differ from the host address where a visible device lacks
//     CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, so it is
//     always asked for, never assumed.
//   - CU_MEMHOSTREGISTER_PORTABLE makes the range pinned for every context,
//     so a process using several GPUs reads it from each.
//   - CU_MEMHOSTREGISTER_READ_ONLY "is required in order to register memory
//     mapped to the CPU as read-only" (weightd's sealed host mappings are
//     PROT_READ) and may only be used where the current context's device
//     reports CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED.
//   - Ranges may not overlap a registered one
//     (CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED); pointers and sizes are
//     page-aligned, as CUDA 4.0 required and the plan guarantees.
//   - Registration needs a current context: the device's primary context
//     (the one frameworks use) is pushed for each call and popped after.
#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "common/memory/cuda/cuda_internal.h"
#include "common/memory/host_registrar.h"

namespace weightd {
namespace {

class CudaHostRegistrar final : public HostRegistrar {
 public:
  CudaHostRegistrar(std::shared_ptr<CudaContext> context, bool read_only_supported)
      : context_(std::move(context)), read_only_supported_(read_only_supported) {}

  bool read_only_supported() const override { return read_only_supported_; }
  int device_ordinal() const override { return context_->ordinal(); }

  absl::StatusOr<uint64_t> Register(const void* base, uint64_t bytes, bool read_only) override {
    const CudaFunctions& cu = context_->cu();
    WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context_));
    unsigned flags = CU_MEMHOSTREGISTER_DEVICEMAP | CU_MEMHOSTREGISTER_PORTABLE;
    if (read_only && read_only_supported_) flags |= CU_MEMHOSTREGISTER_READ_ONLY;
    void* p = const_cast<void*>(base);
    absl::Status registered = WEIGHTD_CU(cu, MemHostRegister, p, bytes, flags);
    if (!registered.ok()) {
      if (read_only_supported_) return registered;
      return Annotate(registered, absl::StrCat("GPU ", context_->ordinal(),
                                               " lacks CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, so the "
                                               "read-only host mapping was registered without "
                                               "CU_MEMHOSTREGISTER_READ_ONLY"));
    }
    CUdeviceptr device = 0;
    absl::Status mapped = WEIGHTD_CU(cu, MemHostGetDevicePointer, &device, p, 0);
    if (!mapped.ok()) {
      cu.MemHostUnregister(p);
      return mapped;
    }
    return static_cast<uint64_t>(device);
  }

  // cuMemHostUnregister does not wait for kernels still reading the range
  // (as cuMemUnmap does not, cuda_import.cc): the context's queued work is
  // finished first, as cudaFree does.
  absl::Status Unregister(const void* base) override {
    const CudaFunctions& cu = context_->cu();
    WEIGHTD_ASSIGN_OR_RETURN(ScopedContext scope, ScopedContext::Enter(*context_));
    absl::Status synced = WEIGHTD_CU(cu, CtxSynchronize);
    absl::Status unregistered = WEIGHTD_CU(cu, MemHostUnregister, const_cast<void*>(base));
    return unregistered.ok() ? synced : unregistered;
  }

 private:
  std::shared_ptr<CudaContext> context_;
  const bool read_only_supported_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<HostRegistrar>> MakeCudaHostRegistrar(int ordinal) {
  WEIGHTD_ASSIGN_OR_RETURN(CudaDriver * driver, CudaDriver::Load());
  int count = 0;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(driver->fn(), DeviceGetCount, &count));
  if (count == 0) return absl::UnavailableError(absl::StrCat("no CUDA device: driver ", driver->version(), " reports 0 GPUs"));
  if (ordinal < 0 || ordinal >= count) {
    return absl::NotFoundError(absl::StrCat("no CUDA device with ordinal ", ordinal, " (this process sees ", count,
                                            "; check CUDA_VISIBLE_DEVICES)"));
  }
  WEIGHTD_ASSIGN_OR_RETURN(std::shared_ptr<CudaContext> context, CudaContext::Retain(*driver, ordinal));
  int read_only = 0;
  WEIGHTD_RETURN_IF_ERROR(WEIGHTD_CU(driver->fn(), DeviceGetAttribute, &read_only,
                                     CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, context->device()));
  return std::unique_ptr<HostRegistrar>(new CudaHostRegistrar(std::move(context), read_only != 0));
}

}  // namespace weightd
