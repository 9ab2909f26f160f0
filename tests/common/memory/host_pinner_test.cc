// HostPinner (common/memory/host_pinner.h) against the recording registrar
// (tests/testing/fake_host_registrar.h): registrations on its own thread in
// plan order, read-only where the device supports it, progress, readiness,
// device pointers only once ready, errors naming the chunk, and everything
// unregistered on stop, including in the middle.
#include "common/memory/host_pinner.h"

#include <sys/mman.h>

#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/fake_host_registrar.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using testing::FakeRegistry;
using testing::kFakeDeviceOffset;
using testing::RegistrarCall;

constexpr uint64_t kPage = kPinPageBytes;

// A read-only anonymous mapping standing in for a host segment.
class Mapping {
 public:
  explicit Mapping(uint64_t size) : size_(size) {
    void* p = mmap(nullptr, size, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : static_cast<char*>(p);
  }
  ~Mapping() {
    if (base_ != nullptr) munmap(base_, size_);
  }
  char* base() const { return base_; }
  uintptr_t at(uint64_t offset) const { return reinterpret_cast<uintptr_t>(base_) + offset; }

 private:
  char* base_;
  uint64_t size_;
};

// Four one-page tensors, one page apart from each other's neighbours: with
// a one-page bound, four chunks of one page each, at pages 0, 1, 2 and 4.
PinInput FourChunks(const Mapping& m) {
  PinInput input;
  input.segment_bases = {m.base()};
  input.segment_sizes = {8 * kPage};
  input.tensors = {{"t0", 0, 0, kPage}, {"t1", 0, kPage, 100}, {"t2", 0, 2 * kPage + 8, 64}, {"t3", 0, 4 * kPage, kPage}};
  input.chunk_bytes = kPage;
  return input;
}

std::vector<std::pair<RegistrarCall::Kind, uintptr_t>> KindsAndBases(const std::vector<RegistrarCall>& calls) {
  std::vector<std::pair<RegistrarCall::Kind, uintptr_t>> out;
  for (const RegistrarCall& c : calls) out.emplace_back(c.kind, c.base);
  return out;
}

TEST(HostPinner, RegistersEachChunkReadOnlyOnItsOwnThread) {
  Mapping m(8 * kPage);
  auto registry = std::make_shared<FakeRegistry>();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostPinner> pinner, HostPinner::Start(FourChunks(m), registry->Factory()));
  WEIGHTD_ASSERT_OK(pinner->Wait(absl::Seconds(10)));
  std::vector<RegistrarCall> calls = registry->calls();
  ASSERT_EQ(calls.size(), 4u);
  const uint64_t offsets[] = {0, kPage, 2 * kPage, 4 * kPage};
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(calls[i].kind, RegistrarCall::kRegister);
    EXPECT_EQ(calls[i].base, m.at(offsets[i])) << i;
    EXPECT_EQ(calls[i].bytes, kPage) << i;
    EXPECT_TRUE(calls[i].read_only) << i;
    EXPECT_NE(calls[i].thread, std::this_thread::get_id()) << "registration ran on the attaching thread";
  }
  PinProgress p = pinner->progress();
  EXPECT_EQ(p.state, PinState::kReady);
  EXPECT_EQ(p.bytes_done, 4 * kPage);
  EXPECT_EQ(p.bytes_total, 4 * kPage);
  EXPECT_EQ(p.chunks_done, 4u);
  EXPECT_EQ(p.tensors, 4u);
  EXPECT_TRUE(p.read_only);
  EXPECT_EQ(p.device_ordinal, 0);
}

TEST(HostPinner, WithoutDeviceSupportRegistersWithoutTheReadOnlyFlag) {
  Mapping m(8 * kPage);
  auto registry = std::make_shared<FakeRegistry>();
  registry->read_only_supported = false;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostPinner> pinner, HostPinner::Start(FourChunks(m), registry->Factory()));
  WEIGHTD_ASSERT_OK(pinner->Wait(absl::Seconds(10)));
  for (const RegistrarCall& c : registry->calls()) EXPECT_FALSE(c.read_only);
  EXPECT_FALSE(pinner->progress().read_only);
}

TEST(HostPinner, DevicePointersAppearOnlyOnceEveryChunkIsRegistered) {
  Mapping m(8 * kPage);
  auto registry = std::make_shared<FakeRegistry>();
  registry->HoldAt(2);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostPinner> pinner, HostPinner::Start(FourChunks(m), registry->Factory()));
  ASSERT_TRUE(registry->WaitHeld());
  // Two chunks registered, the third in flight: progress says so, no pointer yet.
  PinProgress p = pinner->progress();
  EXPECT_EQ(p.state, PinState::kRegistering);
  EXPECT_EQ(p.bytes_done, 2 * kPage);
  EXPECT_EQ(p.chunks_done, 2u);
  EXPECT_EQ(p.chunks_total, 4u);
  EXPECT_EQ(pinner->DevicePointer(0), 0u);
  EXPECT_THAT(pinner->Wait(absl::Milliseconds(10)),
              StatusIs(absl::StatusCode::kDeadlineExceeded, "8192 of 16384 bytes registered (2 of 4 chunks)"));
  registry->Release();
  WEIGHTD_ASSERT_OK(pinner->Wait(absl::Seconds(10)));
  // Chunk device base + the tensor's distance from the chunk's first byte.
  EXPECT_EQ(pinner->DevicePointer(0), m.at(0) + kFakeDeviceOffset);
  EXPECT_EQ(pinner->DevicePointer(1), m.at(kPage) + kFakeDeviceOffset);
  EXPECT_EQ(pinner->DevicePointer(2), m.at(2 * kPage + 8) + kFakeDeviceOffset);
  EXPECT_EQ(pinner->DevicePointer(3), m.at(4 * kPage) + kFakeDeviceOffset);
  EXPECT_EQ(pinner->DevicePointer(4), 0u);  // no such tensor
}

TEST(HostPinner, StopUnregistersEverythingInReverseOrder) {
  Mapping m(8 * kPage);
  auto registry = std::make_shared<FakeRegistry>();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostPinner> pinner, HostPinner::Start(FourChunks(m), registry->Factory()));
  WEIGHTD_ASSERT_OK(pinner->Wait(absl::Seconds(10)));
  pinner.reset();  // as a detach does
  std::vector<RegistrarCall> calls = registry->calls();
  ASSERT_EQ(calls.size(), 8u);
  EXPECT_THAT(KindsAndBases({calls.begin() + 4, calls.end()}),
              ElementsAre(std::pair(RegistrarCall::kUnregister, m.at(4 * kPage)),
                          std::pair(RegistrarCall::kUnregister, m.at(2 * kPage)),
                          std::pair(RegistrarCall::kUnregister, m.at(kPage)),
                          std::pair(RegistrarCall::kUnregister, m.at(0))));
  EXPECT_EQ(calls.back().thread, std::this_thread::get_id());
  EXPECT_THAT(registry->registered(), IsEmpty());
}

TEST(HostPinner, StopInTheMiddleFinishesTheChunkInFlightThenUnregisters) {
  Mapping m(8 * kPage);
  auto registry = std::make_shared<FakeRegistry>();
  registry->HoldAt(1);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostPinner> pinner, HostPinner::Start(FourChunks(m), registry->Factory()));
  ASSERT_TRUE(registry->WaitHeld());
  pinner->RequestStop();  // the detach starts while chunk 1 is being registered
  registry->Release();
  pinner->Stop();
  EXPECT_THAT(KindsAndBases(registry->calls()),
              ElementsAre(std::pair(RegistrarCall::kRegister, m.at(0)), std::pair(RegistrarCall::kRegister, m.at(kPage)),
                          std::pair(RegistrarCall::kUnregister, m.at(kPage)),
                          std::pair(RegistrarCall::kUnregister, m.at(0))));
  EXPECT_THAT(registry->registered(), IsEmpty());
  EXPECT_EQ(pinner->progress().state, PinState::kStopped);
  EXPECT_THAT(pinner->Wait(absl::Seconds(1)), StatusIs(absl::StatusCode::kCancelled, "pinning stopped: detached"));
  EXPECT_EQ(pinner->DevicePointer(0), 0u);
}

TEST(HostPinner, AFailedRegistrationNamesTheChunkAndRollsBack) {
  Mapping m(8 * kPage);
  auto registry = std::make_shared<FakeRegistry>();
  registry->FailAt(2, absl::ResourceExhaustedError("cuMemHostRegister: CUDA_ERROR_OUT_OF_MEMORY: out of memory"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostPinner> pinner, HostPinner::Start(FourChunks(m), registry->Factory()));
  EXPECT_THAT(pinner->Wait(absl::Seconds(10)),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "pinning segment 0 bytes [8192, 12288) holding 't2': cuMemHostRegister: "
                       "CUDA_ERROR_OUT_OF_MEMORY: out of memory"));
  EXPECT_THAT(KindsAndBases(registry->calls()),
              ElementsAre(std::pair(RegistrarCall::kRegister, m.at(0)), std::pair(RegistrarCall::kRegister, m.at(kPage)),
                          std::pair(RegistrarCall::kRegister, m.at(2 * kPage)),
                          std::pair(RegistrarCall::kUnregister, m.at(kPage)),
                          std::pair(RegistrarCall::kUnregister, m.at(0))));
  EXPECT_THAT(registry->registered(), IsEmpty());
  EXPECT_EQ(pinner->progress().state, PinState::kFailed);
  EXPECT_EQ(pinner->DevicePointer(0), 0u);
  pinner.reset();
  EXPECT_EQ(registry->calls().size(), 5u) << "nothing is unregistered twice";
}

TEST(HostPinner, ADriverThatCannotLoadIsTheError) {
  Mapping m(8 * kPage);
  auto registry = std::make_shared<FakeRegistry>();
  registry->factory_error = absl::UnavailableError("libcuda.so.1 not found: no NVIDIA driver on this machine");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostPinner> pinner, HostPinner::Start(FourChunks(m), registry->Factory()));
  EXPECT_THAT(pinner->Wait(absl::Seconds(10)),
              StatusIs(absl::StatusCode::kUnavailable,
                       "pinning host tensors: libcuda.so.1 not found: no NVIDIA driver on this machine"));
  EXPECT_THAT(registry->calls(), IsEmpty());
}

TEST(HostPinner, TensorsWithoutAHostMappingAreRefusedBeforeAnyThread) {
  auto registry = std::make_shared<FakeRegistry>();
  PinInput input;
  input.segment_bases = {nullptr};
  input.segment_sizes = {kPage};
  input.tensors = {{"w", 0, 0, 8}};
  EXPECT_THAT(HostPinner::Start(input, registry->Factory()),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "pinned tensor 'w' is in segment 0, which is not a page-aligned host mapping of this process"));
}

}  // namespace
}  // namespace weightd
