// Pinned host tables through Client::Attach (AttachOptions::pin) in a
// process without a CUDA driver: what is refused before a lease is kept,
// and the clear error pinning reports while the attach itself works. The
// fake-driver half is attach_pin_fake_driver_test.cc (a separate program:
// CudaDriver::Load() remembers its first answer for the whole process).
#include <dlfcn.h>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/pin_fixture.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using testing::AttachPinTest;

TEST_F(AttachPinTest, PinWithCopyOnWriteIsRefusedBeforeAnyLease) {
  WEIGHTD_ASSERT_OK(load_);
  AttachOptions options{.copy_on_write = true};
  options.pin = PinOptions::AllHostTensors();
  EXPECT_THAT(client_->Attach("m", 0, options),
              StatusIs(absl::StatusCode::kInvalidArgument, "pin cannot be combined with copy_on_write"));
  options = {};
  options.pin = {{"table"}, 100};
  EXPECT_THAT(client_->Attach("m", 0, options),
              StatusIs(absl::StatusCode::kInvalidArgument, "pin chunk_bytes 100 is outside [4096, 68719476736]"));
  EXPECT_EQ(Leases(), 0u);
}

TEST_F(AttachPinTest, APatternMatchingNoHostTensorIsRefusedAndTheLeaseEnded) {
  WEIGHTD_ASSERT_OK(load_);
  AttachOptions options;
  options.pin.patterns = {"table", "dev"};
  EXPECT_THAT(client_->Attach("m", 0, options),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "pin pattern 'dev' matches no host tensor of model 'm' rank 0 (it matches 1 device-placed "
                       "tensors; only host tensors are pinned)"));
  EXPECT_TRUE(testing::WaitFor([&] { return Leases() == 0; }, std::chrono::seconds(10)));
}

TEST_F(AttachPinTest, WithoutPinThereIsNothingToWaitFor) {
  WEIGHTD_ASSERT_OK(load_);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel model, client_->Attach("m", 0));
  EXPECT_EQ(model.pin_status().state, "NOT_PINNED");
  EXPECT_THAT(model.WaitPinned(absl::Seconds(1)),
              StatusIs(absl::StatusCode::kFailedPrecondition, "model 'm' was attached without pin"));
  EXPECT_EQ(model.device_ptr(*model.Find("table.a")), 0u);
}

TEST_F(AttachPinTest, WithoutADriverTheAttachWorksAndPinningSaysWhy) {
  void* installed = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (installed != nullptr) GTEST_SKIP() << "a libcuda.so.1 is loadable in this process";
  WEIGHTD_ASSERT_OK(load_);
  AttachOptions options;
  options.pin = PinOptions::AllHostTensors();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel model, client_->Attach("m", 0, options));
  EXPECT_EQ(std::string(static_cast<const char*>(model.Find("table.a")->data), 3), "aaa");  // mapped as usual
  absl::Status waited = model.WaitPinned(absl::Seconds(30));
  if (waited.code() == absl::StatusCode::kUnimplemented) {  // a build without the CUDA toolkit
    EXPECT_THAT(waited, StatusIs(absl::StatusCode::kUnimplemented, "weightd was built without the CUDA toolkit"));
  } else {
    EXPECT_THAT(waited, StatusIs(absl::StatusCode::kUnavailable,
                                 "pinning host tensors: libcuda.so.1 not found: no NVIDIA driver on this machine"));
  }
  EXPECT_EQ(model.pin_status().state, "FAILED");
  EXPECT_EQ(model.device_ptr(*model.Find("table.a")), 0u);
}

}  // namespace
}  // namespace weightd
