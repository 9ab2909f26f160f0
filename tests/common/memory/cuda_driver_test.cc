// The CUDA driver loader and backends on machines without an NVIDIA driver
// (built only with the CUDA toolkit). With a driver, the tests that need its
// absence skip; tests/gpu/ covers that case.
#include "common/memory/cuda/cuda_driver.h"

#include <dlfcn.h>
#include <unistd.h>

#include <cstdio>

#include "common/memory/device.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;

bool DriverInstalled() {
  void* lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (lib == nullptr) return false;
  dlclose(lib);
  return true;
}

TEST(CudaDriver, MissingLibraryIsUnavailableAndNamed) {
  absl::StatusOr<std::unique_ptr<CudaDriver>> driver = CudaDriver::Open("libweightd-no-such-driver.so.1");
  EXPECT_THAT(driver, StatusIs(absl::StatusCode::kUnavailable,
                               "libweightd-no-such-driver.so.1 not found: no NVIDIA driver on this machine"));
}

TEST(CudaDriver, ToolkitStubLibraryIsUnavailable) {
  const char* stub = "/usr/local/cuda/lib64/stubs/libcuda.so";
  if (access(stub, R_OK) != 0) GTEST_SKIP() << "no toolkit stub at " << stub;
  // In a child process: the stub's soname is libcuda.so.1, so once loaded it
  // would answer every later dlopen("libcuda.so.1") of this process.
  EXPECT_EXIT(
      {
        absl::StatusOr<std::unique_ptr<CudaDriver>> driver = CudaDriver::Open(stub);
        fprintf(stderr, "%s\n", driver.status().ToString().c_str());
        bool named = !driver.ok() && std::string(driver.status().message()).find(stub) != std::string::npos;
        _exit(named && driver.status().code() == absl::StatusCode::kUnavailable ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "UNAVAILABLE: .*CUDA_ERROR_STUB_LIBRARY");
}

TEST(CudaDriver, LoadWithoutDriverSaysSo) {
  if (DriverInstalled()) GTEST_SKIP() << "libcuda.so.1 is installed here";
  absl::StatusOr<CudaDriver*> driver = CudaDriver::Load();
  EXPECT_THAT(driver, StatusIs(absl::StatusCode::kUnavailable,
                               "libcuda.so.1 not found: no NVIDIA driver on this machine"));
  // The failure is remembered, not retried.
  EXPECT_EQ(CudaDriver::Load().status(), driver.status());
}

TEST(CudaBackend, WithoutDriverIsUnavailable) {
  if (DriverInstalled()) GTEST_SKIP() << "libcuda.so.1 is installed here";
  for (bool legacy_ipc : {false, true}) {
    absl::StatusOr<std::unique_ptr<DeviceBackend>> backend = MakeCudaBackend(legacy_ipc);
    ASSERT_FALSE(backend.ok());
    EXPECT_EQ(backend.status().code(), absl::StatusCode::kUnavailable) << backend.status();
    EXPECT_THAT(std::string(backend.status().message()), AnyOf(HasSubstr("libcuda"), HasSubstr("no CUDA device")));
  }
}

TEST(CudaBackend, AutoFallsBackToHostOnlyWithoutDriver) {
  if (DriverInstalled()) GTEST_SKIP() << "libcuda.so.1 is installed here";
  std::string chosen;
  absl::StatusOr<std::unique_ptr<DeviceBackend>> backend = MakeDeviceBackend("auto", &chosen);
  WEIGHTD_ASSERT_OK(backend);
  EXPECT_EQ(*backend, nullptr);
  EXPECT_THAT(chosen, HasSubstr("libcuda.so.1"));
}

TEST(CudaToStatus, SuccessIsOk) { WEIGHTD_EXPECT_OK(CudaToStatus("cuMemCreate", 0)); }

TEST(CudaToStatus, NamesTheApiAndChoosesTheCode) {
  // Without a loaded driver the names come from the built-in table.
  if (DriverInstalled()) GTEST_SKIP() << "libcuda.so.1 is installed here: the driver's own text applies";
  EXPECT_EQ(CudaToStatus("cuMemCreate", 2),  // CUDA_ERROR_OUT_OF_MEMORY
            absl::ResourceExhaustedError("cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY"));
  EXPECT_EQ(CudaToStatus("cuInit", 100),  // CUDA_ERROR_NO_DEVICE
            absl::UnavailableError("cuInit: CUDA_ERROR_NO_DEVICE: no CUDA-capable device is detected"));
  EXPECT_EQ(CudaToStatus("cuMemSetAccess", 1),  // CUDA_ERROR_INVALID_VALUE
            absl::InvalidArgumentError("cuMemSetAccess: CUDA_ERROR_INVALID_VALUE"));
  EXPECT_EQ(CudaToStatus("cuMemExportToShareableHandle", 801),  // CUDA_ERROR_NOT_SUPPORTED
            absl::UnimplementedError("cuMemExportToShareableHandle: CUDA_ERROR_NOT_SUPPORTED"));
  EXPECT_EQ(CudaToStatus("cuMemcpyDtoH", 700),  // CUDA_ERROR_ILLEGAL_ADDRESS: not in the table
            absl::InternalError("cuMemcpyDtoH: CUDA error 700"));
}

}  // namespace
}  // namespace weightd
