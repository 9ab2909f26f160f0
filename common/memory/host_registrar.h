// HostRegistrar: the seam between pinning host tables (host_pinner.h) and the
// CUDA driver. It registers a range of this process's host memory so GPUs
// can read it directly, and says at what device address. The CUDA
// implementation is cuMemHostRegister / cuMemHostGetDevicePointer /
// cuMemHostUnregister on one device's primary context
// (common/memory/cuda/cuda_host_registrar.cc); tests use a fake that records
// its calls (tests/testing/fake_host_registrar.h).
//
// Thread-safety: Register and Unregister may be called from any thread, one
// call at a time per range.
#ifndef WEIGHTD_COMMON_MEMORY_HOST_REGISTRAR_H_
#define WEIGHTD_COMMON_MEMORY_HOST_REGISTRAR_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace weightd {

class HostRegistrar {
 public:
  virtual ~HostRegistrar() = default;

  // Whether Register can mark ranges read-only for the device (CUDA:
  // CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED of the device).
  virtual bool read_only_supported() const = 0;
  // This process's CUDA ordinal of the device whose context registers.
  virtual int device_ordinal() const = 0;
  // Page-locks [base, base + bytes) (page-aligned, inside one mapping of this
  // process, overlapping no registered range) and maps it for every GPU;
  // `read_only` (only when read_only_supported()) tells the driver the
  // device will not write it, which a PROT_READ mapping needs. Returns the
  // device address of `base`, valid in every context of this process until
  // Unregister. The caller keeps the memory mapped until then. Errors keep
  // the driver's (cuMemHostRegister: CUDA_ERROR_OUT_OF_MEMORY as
  // RESOURCE_EXHAUSTED, ...); nothing stays registered after an error.
  virtual absl::StatusOr<uint64_t> Register(const void* base, uint64_t bytes, bool read_only) = 0;
  // Ends the registration that starts at `base`, after the work queued on
  // the registering device (which may still read it) has finished.
  virtual absl::Status Unregister(const void* base) = 0;
};

// The CUDA registrar on this process's device `ordinal`: loads the driver
// (CudaDriver::Load: libcuda.so.1) and retains the device's primary context.
// UNAVAILABLE naming libcuda.so.1 without a driver, or "no CUDA device";
// NOT_FOUND for an ordinal this process does not see; UNIMPLEMENTED in
// builds without the CUDA toolkit. May take as long as cuInit (seconds on
// some machines): call it off the attach path.
absl::StatusOr<std::unique_ptr<HostRegistrar>> MakeCudaHostRegistrar(int ordinal);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_MEMORY_HOST_REGISTRAR_H_
