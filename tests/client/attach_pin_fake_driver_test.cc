// Pinned host tables through Client::Attach (AttachOptions::pin) against the
// fake driver (tests/gpu/fake_libcuda.cc, loaded by path before anything asks
// for libcuda.so.1, so that CudaDriver::Load() gets it): device pointers for
// the pinned tensors, the flags and ranges they were registered with, and
// their unregistration on detach, also in the middle of pinning.
#include <dlpack/dlpack.h>

#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/pin_fixture.h"
#include "tests/testing/fake_cuda_driver.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using testing::AttachPinTest;
using testing::kPage;

constexpr unsigned kPortableDevicemapReadOnly = 0x01 | 0x02 | 0x08;  // cuda.h CU_MEMHOSTREGISTER_*

// The same daemon and model, with the fake driver in this process.
class AttachPinFakeDriverTest : public AttachPinTest {
 protected:
  using Registration = testing::FakeCudaRegistration;

  void SetUp() override {
    ASSERT_EQ(driver_.Open(WEIGHTD_FAKE_CUDA_LIBRARY), "");
    WEIGHTD_ASSERT_OK(load_);
  }
  std::vector<Registration> Registrations() const { return driver_.Registrations(); }
  testing::FakeCudaDriver driver_;
};

TEST_F(AttachPinFakeDriverTest, PinnedHostTensorsGetDevicePointersUntilDetach) {
  AttachOptions options;
  options.pin = {{"table.b"}, 2 * kPage};  // its pages exceed the bound: one registration of their own
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel model, client_->Attach("m", 0, options));
  WEIGHTD_ASSERT_OK(model.WaitPinned(absl::Seconds(30)));
  const TensorView& b = *model.Find("table.b");
  const TensorView& a = *model.Find("table.a");
  uintptr_t b_at = reinterpret_cast<uintptr_t>(b.data);
  // The fake maps registered memory at the host address; the range is
  // table.b's pages, read-only, device-mapped and portable.
  EXPECT_EQ(model.device_ptr(b), b_at);
  EXPECT_EQ(model.device_ptr(a), 0u);  // not pinned
  EXPECT_EQ(model.device_ptr(*model.Find("dev")), 0u);
  uintptr_t first = b_at / kPage * kPage;
  uint64_t pages = ((b_at + b.nbytes + kPage - 1) / kPage * kPage) - first;
  EXPECT_THAT(Registrations(), ElementsAre(Registration(first, pages, kPortableDevicemapReadOnly)));
  PinStatus status = model.pin_status();
  EXPECT_EQ(status.state, "READY");
  EXPECT_EQ(status.bytes_total, pages);
  EXPECT_EQ(status.bytes_done, pages);
  EXPECT_EQ(status.chunks_total, 1u);
  EXPECT_EQ(status.tensors, 1u);
  EXPECT_TRUE(status.read_only);
  EXPECT_EQ(status.device_ordinal, 0);
  // A GPU view of the pinned pages keeps them registered after the model goes.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(DLManagedTensor * view, model.ToPinnedDLPack(b));
  EXPECT_EQ(view->dl_tensor.device.device_type, kDLCUDA);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(view->dl_tensor.data), b_at);
  EXPECT_THAT(model.ToPinnedDLPack(a), StatusIs(absl::StatusCode::kFailedPrecondition,
                                                "tensor 'table.a' has no device pointer: it is not pinned"));
  { MappedModel gone = std::move(model); }  // a move keeps the pin; the end of `gone` is the detach
  EXPECT_EQ(Registrations().size(), 1u);
  view->deleter(view);
  EXPECT_THAT(Registrations(), IsEmpty());
}

TEST_F(AttachPinFakeDriverTest, EveryHostTensorIsPinnedAndNeighboursSharingAPageTogether) {
  AttachOptions options;
  options.pin = PinOptions::AllHostTensors();
  options.pin.chunk_bytes = 2 * kPage;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel model, client_->Attach("m", 0, options));
  WEIGHTD_ASSERT_OK(model.WaitPinned(absl::Seconds(30)));
  // table.a ends in the page where table.b starts (the daemon packs host
  // tensors 64 bytes apart), so one registration holds both, past the bound.
  uintptr_t a_at = reinterpret_cast<uintptr_t>(model.Find("table.a")->data);
  const TensorView& b = *model.Find("table.b");
  uintptr_t b_end = reinterpret_cast<uintptr_t>(b.data) + b.nbytes;
  uintptr_t first = a_at / kPage * kPage;
  EXPECT_THAT(Registrations(), ElementsAre(Registration(first, (b_end + kPage - 1) / kPage * kPage - first,
                                                        kPortableDevicemapReadOnly)));
  EXPECT_EQ(model.pin_status().tensors, 2u);
  for (const char* name : {"table.a", "table.b"}) {
    const TensorView& t = *model.Find(name);
    EXPECT_EQ(model.device_ptr(t), reinterpret_cast<uintptr_t>(t.data)) << name;
  }
}

TEST_F(AttachPinFakeDriverTest, DetachingWhilePinningUnregistersWhatWasRegistered) {
  AttachOptions options;
  options.pin = PinOptions::AllHostTensors();
  options.pin.chunk_bytes = kPage;
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel model, client_->Attach("m", 0, options));
  }  // destroyed at once, whatever the pinning thread had reached
  EXPECT_THAT(Registrations(), IsEmpty());
}

}  // namespace
}  // namespace weightd
