#include "common/memory/cuda/cuda_driver.h"

#include <dlfcn.h>

#include <atomic>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/memory/cuda/cuda_internal.h"
#include "common/base/status.h"

namespace weightd {
namespace {

// Set once Load() succeeds, so CudaToStatus can ask the driver for its text.
std::atomic<const CudaDriver*> g_loaded{nullptr};

// Names for the codes CudaToStatus distinguishes, for errors reported before
// (or without) a driver that can name them: the stub library names nothing.
const char* FallbackName(int result) {
  switch (result) {
    case CUDA_ERROR_INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case CUDA_ERROR_OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case CUDA_ERROR_NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case CUDA_ERROR_DEINITIALIZED: return "CUDA_ERROR_DEINITIALIZED";
    case CUDA_ERROR_STUB_LIBRARY: return "CUDA_ERROR_STUB_LIBRARY: the toolkit's stub libcuda was loaded, not the driver";
    case CUDA_ERROR_DEVICE_UNAVAILABLE: return "CUDA_ERROR_DEVICE_UNAVAILABLE";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected";
    case CUDA_ERROR_INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case CUDA_ERROR_INVALID_HANDLE: return "CUDA_ERROR_INVALID_HANDLE";
    case CUDA_ERROR_NOT_PERMITTED: return "CUDA_ERROR_NOT_PERMITTED";
    case CUDA_ERROR_NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case CUDA_ERROR_SYSTEM_NOT_READY: return "CUDA_ERROR_SYSTEM_NOT_READY";
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: return "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH";
    default: return nullptr;
  }
}

absl::StatusCode CodeFor(int result) {
  switch (result) {
    case CUDA_ERROR_OUT_OF_MEMORY:
      return absl::StatusCode::kResourceExhausted;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_NOT_INITIALIZED:
    case CUDA_ERROR_DEINITIALIZED:
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_DEVICE_UNAVAILABLE:
    case CUDA_ERROR_SYSTEM_NOT_READY:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
      return absl::StatusCode::kUnavailable;
    case CUDA_ERROR_INVALID_VALUE:
    case CUDA_ERROR_INVALID_DEVICE:
    case CUDA_ERROR_INVALID_HANDLE:
      return absl::StatusCode::kInvalidArgument;
    case CUDA_ERROR_NOT_PERMITTED:
      return absl::StatusCode::kPermissionDenied;
    case CUDA_ERROR_NOT_SUPPORTED:
      return absl::StatusCode::kUnimplemented;
    default:
      return absl::StatusCode::kInternal;
  }
}

// "CUDA_ERROR_X: text" from the driver, else the fallback name or the number.
std::string ErrorText(const CudaFunctions* fn, int result) {
  const char* name = nullptr;
  const char* text = nullptr;
  if (fn != nullptr && fn->GetErrorName != nullptr &&
      fn->GetErrorName(static_cast<CUresult>(result), &name) == CUDA_SUCCESS && name != nullptr) {
    if (fn->GetErrorString(static_cast<CUresult>(result), &text) == CUDA_SUCCESS && text != nullptr) {
      return absl::StrCat(name, ": ", text);
    }
    return name;
  }
  if (const char* fallback = FallbackName(result)) return fallback;
  return absl::StrCat("CUDA error ", result);
}

absl::Status MakeStatus(const CudaFunctions* fn, const char* api, int result) {
  if (result == CUDA_SUCCESS) return absl::OkStatus();
  return absl::Status(CodeFor(result), absl::StrCat(api, ": ", ErrorText(fn, result)));
}

}  // namespace

CudaDriver::CudaDriver() : fn_(std::make_unique<CudaFunctions>()) {}
CudaDriver::~CudaDriver() = default;

absl::Status CudaDriver::ToStatus(const char* api, int result) const { return MakeStatus(fn_.get(), api, result); }

absl::StatusOr<std::unique_ptr<CudaDriver>> CudaDriver::Open(const std::string& library) {
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::UnavailableError(
        absl::StrCat(library, " not found: no NVIDIA driver on this machine (", dlerror(), ")"));
  }
  // Both exist in every driver since CUDA 12.0; the version tells an old
  // driver from a broken library.
  auto get_version = reinterpret_cast<PFN_cuDriverGetVersion_v2020>(dlsym(lib, "cuDriverGetVersion"));
  auto get_proc = reinterpret_cast<PFN_cuGetProcAddress_v12000>(dlsym(lib, "cuGetProcAddress_v2"));
  int version = 0;
  if (get_version == nullptr || get_version(&version) != CUDA_SUCCESS) version = 0;
  if (version != 0 && version < kCudaAbiVersion) {
    return absl::UnavailableError(absl::StrFormat("%s is the driver of CUDA %d.%d; weightd needs CUDA 12.0 or newer",
                                                  library, version / 1000, version % 1000 / 10));
  }
  if (get_proc == nullptr) {
    return absl::UnavailableError(absl::StrCat(library, " has no cuGetProcAddress_v2: not a CUDA 12+ driver"));
  }
  std::unique_ptr<CudaDriver> driver(new CudaDriver());
  driver->version_ = absl::StrFormat("%d.%d", version / 1000, version % 1000 / 10);
  CudaFunctions& fn = *driver->fn_;
  // Resolves one symbol; GetErrorName comes first, so later failures have text.
  auto resolve = [&](const char* symbol, void** slot) -> absl::Status {
    CUdriverProcAddressQueryResult found = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CUresult r = get_proc(symbol, slot, kCudaAbiVersion, CU_GET_PROC_ADDRESS_LEGACY_STREAM, &found);
    if (r != CUDA_SUCCESS) {
      return Annotate(MakeStatus(&fn, "cuGetProcAddress", r), absl::StrCat(library, ": resolving ", symbol));
    }
    if (*slot == nullptr || found != CU_GET_PROC_ADDRESS_SUCCESS) {
      *slot = nullptr;
      return absl::UnavailableError(absl::StrCat(library, " (driver ", driver->version_, ") does not provide ", symbol,
                                                 found == CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
                                                     ? " at the CUDA 12.0 ABI"
                                                     : ""));
    }
    return absl::OkStatus();
  };
#define WEIGHTD_CUDA_RESOLVE_(name, abi) \
  WEIGHTD_RETURN_IF_ERROR(resolve("cu" #name, reinterpret_cast<void**>(&fn.name)));
  WEIGHTD_CUDA_FUNCTIONS(WEIGHTD_CUDA_RESOLVE_)
#undef WEIGHTD_CUDA_RESOLVE_
  CUresult r = fn.Init(0);
  if (r == CUDA_ERROR_NO_DEVICE) {
    return absl::UnavailableError(
        absl::StrCat("no CUDA device: driver ", driver->version_, " found no GPU (", ErrorText(&fn, r), ")"));
  }
  if (r != CUDA_SUCCESS) return Annotate(MakeStatus(&fn, "cuInit", r), absl::StrCat(library, " ", driver->version_));
  return driver;
}

absl::StatusOr<CudaDriver*> CudaDriver::Load() {
  static const absl::StatusOr<CudaDriver*>* const loaded = [] {
    absl::StatusOr<std::unique_ptr<CudaDriver>> opened = Open("libcuda.so.1");
    if (!opened.ok()) return new absl::StatusOr<CudaDriver*>(opened.status());
    CudaDriver* driver = opened->release();  // lives until the process exits
    g_loaded.store(driver, std::memory_order_release);
    return new absl::StatusOr<CudaDriver*>(driver);
  }();
  return *loaded;
}

absl::Status CudaToStatus(const char* api, int result) {
  const CudaDriver* driver = g_loaded.load(std::memory_order_acquire);
  return MakeStatus(driver != nullptr ? &driver->fn() : nullptr, api, result);
}

}  // namespace weightd
