// The CUDA HostRegistrar and HostPinner through the real CudaDriver path,
// against the fake driver (tests/gpu/fake_libcuda.cc), which checks what
// cuda.h documents for cuMemHostRegister and reports the flags each range
// was registered with. The fake is loaded by path before anything asks for
// libcuda.so.1, so CudaDriver::Load() gets it (its soname is libcuda.so.1).
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <tuple>
#include <vector>

#include "common/memory/host_pinner.h"
#include "common/memory/host_registrar.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_cuda_driver.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;

constexpr uint64_t kPage = kPinPageBytes;
// cuda.h: CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP, and | READ_ONLY.
constexpr unsigned kPortableDevicemap = 0x01 | 0x02;
constexpr unsigned kReadOnly = 0x08;

using Registration = testing::FakeCudaRegistration;

class FakeDriver : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(driver_.Open(WEIGHTD_FAKE_CUDA_LIBRARY), "");
  }

  // The fake driver's registered host ranges: (base, bytes, flags).
  std::vector<Registration> Registrations() const { return driver_.Registrations(); }

  // A sealed host segment's mapping: a memfd mapped shared and PROT_READ.
  char* MapReadOnly(uint64_t size) {
    int fd = memfd_create("pin-test", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, size) != 0) return nullptr;
    void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    return p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }

  testing::FakeCudaDriver driver_;
};

TEST_F(FakeDriver, RegistersDeviceMappedPortableAndReadOnly) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostRegistrar> registrar, MakeCudaHostRegistrar(0));
  EXPECT_TRUE(registrar->read_only_supported());
  char* p = MapReadOnly(4 * kPage);
  ASSERT_NE(p, nullptr);
  uintptr_t at = reinterpret_cast<uintptr_t>(p);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(uint64_t device, registrar->Register(p, 3 * kPage, true));
  EXPECT_EQ(device, at);  // the fake maps registered memory at the host address
  EXPECT_THAT(Registrations(), ElementsAre(Registration(at, 3 * kPage, kPortableDevicemap | kReadOnly)));
  // Overlapping the registered range is refused with the driver's error.
  EXPECT_THAT(registrar->Register(p + 2 * kPage, 2 * kPage, true),
              StatusIs(absl::StatusCode::kInternal, "cuMemHostRegister: CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED"));
  WEIGHTD_ASSERT_OK(registrar->Unregister(p));
  EXPECT_THAT(Registrations(), IsEmpty());
  EXPECT_THAT(registrar->Unregister(p),
              StatusIs(absl::StatusCode::kInternal, "cuMemHostUnregister: CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED"));
  munmap(p, 4 * kPage);
}

TEST_F(FakeDriver, WithoutReadOnlySupportTheReadOnlyMappingIsRefusedAndTheErrorSaysWhy) {
  setenv("FAKE_CUDA_NO_READ_ONLY_HOST_REGISTER", "1", 1);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostRegistrar> registrar, MakeCudaHostRegistrar(0));
  EXPECT_FALSE(registrar->read_only_supported());
  char* p = MapReadOnly(kPage);
  ASSERT_NE(p, nullptr);
  EXPECT_THAT(registrar->Register(p, kPage, false),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "GPU 0 lacks CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED, so the read-only host "
                       "mapping was registered without CU_MEMHOSTREGISTER_READ_ONLY: cuMemHostRegister: "
                       "CUDA_ERROR_INVALID_VALUE"));
  EXPECT_THAT(Registrations(), IsEmpty());
  munmap(p, kPage);
  unsetenv("FAKE_CUDA_NO_READ_ONLY_HOST_REGISTER");
}

TEST_F(FakeDriver, AnOrdinalThisProcessDoesNotSeeIsNotFound) {
  EXPECT_THAT(MakeCudaHostRegistrar(3),
              StatusIs(absl::StatusCode::kNotFound, "no CUDA device with ordinal 3 (this process sees 1"));
}

TEST_F(FakeDriver, APinnerRegistersItsChunksAndUnregistersThemOnStop) {
  char* p = MapReadOnly(8 * kPage);
  ASSERT_NE(p, nullptr);
  uintptr_t at = reinterpret_cast<uintptr_t>(p);
  PinInput input;
  input.segment_bases = {p};
  input.segment_sizes = {8 * kPage};
  input.tensors = {{"a", 0, 0, 2 * kPage}, {"b", 0, 2 * kPage, 10}, {"c", 0, 5 * kPage, 100}};
  input.chunk_bytes = 2 * kPage;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostPinner> pinner,
                               HostPinner::Start(input, [] { return MakeCudaHostRegistrar(0); }));
  WEIGHTD_ASSERT_OK(pinner->Wait(absl::Seconds(30)));
  EXPECT_THAT(Registrations(), ElementsAre(Registration(at, 2 * kPage, kPortableDevicemap | kReadOnly),
                                           Registration(at + 2 * kPage, kPage, kPortableDevicemap | kReadOnly),
                                           Registration(at + 5 * kPage, kPage, kPortableDevicemap | kReadOnly)));
  EXPECT_EQ(pinner->DevicePointer(1), at + 2 * kPage);
  EXPECT_EQ(pinner->progress().device_ordinal, 0);
  pinner->Stop();
  EXPECT_THAT(Registrations(), IsEmpty());
  munmap(p, 8 * kPage);
}

TEST_F(FakeDriver, RunningOutOfLockableMemoryFailsThePinAndLeavesNothingRegistered) {
  setenv("FAKE_CUDA_HOST_REGISTER_LIMIT", "8192", 1);
  char* p = MapReadOnly(4 * kPage);
  ASSERT_NE(p, nullptr);
  PinInput input;
  input.segment_bases = {p};
  input.segment_sizes = {4 * kPage};
  input.tensors = {{"table", 0, 0, 4 * kPage}};
  input.chunk_bytes = kPage;  // one tensor larger than the bound: one registration of 4 pages
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostPinner> pinner,
                               HostPinner::Start(input, [] { return MakeCudaHostRegistrar(0); }));
  EXPECT_THAT(pinner->Wait(absl::Seconds(30)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "pinning segment 0 bytes [0, 16384) holding 'table': cuMemHostRegister: "
                       "CUDA_ERROR_OUT_OF_MEMORY"));
  EXPECT_THAT(Registrations(), IsEmpty());
  unsetenv("FAKE_CUDA_HOST_REGISTER_LIMIT");
  munmap(p, 4 * kPage);
}

}  // namespace
}  // namespace weightd
