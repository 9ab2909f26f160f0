// The CUDA driver, loaded at run time: dlopen("libcuda.so.1"), then every
// driver symbol resolved with cuGetProcAddress at the CUDA 12.0 ABI. weightd
// links nothing from CUDA, so one binary runs on nodes with and without GPUs
// and says which it found.
//
// This header is free of CUDA headers. The typed table of driver functions
// (CudaFunctions) is defined in common/memory/cuda/cuda_internal.h, which includes
// <cuda.h> and is meant only for the CUDA implementation files
// (common/cuda_*.cc) and the GPU check program (tests/gpu/).
#ifndef WEIGHTD_COMMON_MEMORY_CUDA_CUDA_DRIVER_H_
#define WEIGHTD_COMMON_MEMORY_CUDA_CUDA_DRIVER_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace weightd {

struct CudaFunctions;

// The driver's version number for CUDA 12.0 (1000 * major + 10 * minor).
// Symbols are resolved at this ABI: any driver from 12.0 on provides it, and
// the function signatures cannot change under us when a newer driver is
// installed.
inline constexpr int kCudaAbiVersion = 12000;

class CudaDriver {
 public:
  // The process-wide driver: opens "libcuda.so.1" and calls cuInit(0) on the
  // first call; every later call returns the same result, success or error
  // (thread-safe). The driver is never unloaded. UNAVAILABLE when the library
  // is absent ("libcuda.so.1 not found: no NVIDIA driver on this machine"),
  // older than CUDA 12.0, lacks a symbol, or cuInit fails (for instance "no
  // CUDA device").
  static absl::StatusOr<CudaDriver*> Load();

  // Opens `library` (a soname or a path) without caching: for tests, which
  // point it at a missing file or at the toolkit's stub library. The library
  // handle is never closed (libcuda does not support being unloaded).
  static absl::StatusOr<std::unique_ptr<CudaDriver>> Open(const std::string& library);

  ~CudaDriver();
  CudaDriver(const CudaDriver&) = delete;
  CudaDriver& operator=(const CudaDriver&) = delete;

  // The resolved driver functions; valid as long as this object.
  const CudaFunctions& fn() const { return *fn_; }
  // cuDriverGetVersion as "12.4".
  const std::string& version() const { return version_; }

  // "api: CUDA_ERROR_OUT_OF_MEMORY: out of memory" with a status code chosen
  // by what the caller can do (see CudaToStatus); OK for CUDA_SUCCESS.
  absl::Status ToStatus(const char* api, int result) const;

 private:
  CudaDriver();

  std::unique_ptr<CudaFunctions> fn_;
  std::string version_;
};

// `result` (a CUresult) as a status naming `api` and carrying the driver's
// error name and text (when no driver is loaded, the name from a built-in
// table or the number). Codes: out of memory -> RESOURCE_EXHAUSTED; no device,
// not initialised, driver/device unavailable -> UNAVAILABLE; invalid value,
// device or handle -> INVALID_ARGUMENT; not permitted -> PERMISSION_DENIED;
// not supported -> UNIMPLEMENTED; anything else -> INTERNAL. CUDA_SUCCESS is OK.
// Thread-safe.
absl::Status CudaToStatus(const char* api, int result);

}  // namespace weightd

#endif  // WEIGHTD_COMMON_MEMORY_CUDA_CUDA_DRIVER_H_
