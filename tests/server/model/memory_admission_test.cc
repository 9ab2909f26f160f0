#include "server/model/memory_admission.h"

#include "gtest/gtest.h"
#include "server/load/loader.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {


HostMemoryAdmission::Probe Fixed(uint64_t bytes) {
  return [bytes]() -> absl::StatusOr<HostMemoryBudget> { return HostMemoryBudget{bytes, "test budget"}; };
}

TEST(HostMemoryAdmission, TwoLoadsThatFitAloneButNotTogetherRefuseTheSecond) {
  HostMemoryAdmission admission(Fixed(100));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(HostMemoryAdmission::Reservation first, admission.Reserve("a", 60));
  EXPECT_EQ(admission.promised(), 60u);
  EXPECT_THAT(admission.Reserve("b", 60),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "the host-resident tensors need 60 bytes of host memory but only 40 are available (100 by "
                       "test budget, minus 60 promised to loads in flight)"));
  WEIGHTD_EXPECT_OK(admission.Reserve("c", 40));  // exactly what is left; released at once
  first = HostMemoryAdmission::Reservation();     // the first load ended
  EXPECT_EQ(admission.promised(), 0u);
  WEIGHTD_EXPECT_OK(admission.Reserve("b", 60));
}

TEST(HostMemoryAdmission, MovedReservationsReleaseOnce) {
  HostMemoryAdmission admission(Fixed(100));
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(HostMemoryAdmission::Reservation r, admission.Reserve("a", 30));
    HostMemoryAdmission::Reservation moved(std::move(r));
    EXPECT_EQ(moved.bytes(), 30u);
    EXPECT_EQ(admission.promised(), 30u);
  }
  EXPECT_EQ(admission.promised(), 0u);
}

TEST(HostMemoryAdmission, AnUnreadableBudgetAdmitsAndZeroBytesAlwaysFit) {
  HostMemoryAdmission broken([]() -> absl::StatusOr<HostMemoryBudget> { return absl::NotFoundError("no /proc"); });
  WEIGHTD_EXPECT_OK(broken.Reserve("a", 1ull << 50));
  HostMemoryAdmission empty(Fixed(0));
  WEIGHTD_EXPECT_OK(empty.Reserve("a", 0));
  EXPECT_THAT(empty.Reserve("a", 1), StatusIs(absl::StatusCode::kResourceExhausted, "need 1 bytes"));
}

TEST(HostMemoryAdmission, ALoadIsRefusedBeforeAllocatingWhileAnotherHoldsThePromise) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("m.safetensors"),
                     testing::SafetensorsBuilder().Add("table", "U8", {50}, std::string(50, 'x')).Build());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog catalog, BuildCatalog(dir.Join("m.safetensors")));
  HostMemoryAdmission admission(Fixed(100));
  LoaderOptions options;
  options.admission = &admission;
  LoadRequest request;
  request.name = "m";
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(HostMemoryAdmission::Reservation in_flight, admission.Reserve("other", 60));
    EXPECT_THAT(LoadGeneration(catalog, request, options, nullptr),
                StatusIs(absl::StatusCode::kResourceExhausted, "need 50 bytes of host memory but only 40 are available"));
  }
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ModelGeneration> loaded, LoadGeneration(catalog, request, options, nullptr));
  EXPECT_EQ(loaded->host_bytes, 50u);
  EXPECT_EQ(admission.promised(), 0u);  // the promise ends with the load
}

}  // namespace
}  // namespace weightd
