#include "common/memory/segment_backend.h"

#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

TEST(SegmentBackend, EveryBackendRoundTripsThroughItsWireName) {
  for (SegmentBackend b : {SegmentBackend::kMemfd, SegmentBackend::kCudaVmm, SegmentBackend::kCudaLegacyIpc,
                           SegmentBackend::kEmulated}) {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(SegmentBackend parsed, ParseSegmentBackend(SegmentBackendName(b)));
    EXPECT_EQ(parsed, b) << SegmentBackendName(b);
  }
}

TEST(SegmentBackend, WireNamesAreTheDocumentedOnes) {
  EXPECT_EQ(SegmentBackendName(SegmentBackend::kMemfd), "memfd");
  EXPECT_EQ(SegmentBackendName(SegmentBackend::kCudaVmm), "cuda-vmm");
  EXPECT_EQ(SegmentBackendName(SegmentBackend::kCudaLegacyIpc), "cuda-legacy-ipc");
  EXPECT_EQ(SegmentBackendName(SegmentBackend::kEmulated), "emulated");
}

TEST(SegmentBackend, OldDaemonsCudaMeansCudaVmm) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(SegmentBackend parsed, ParseSegmentBackend("cuda"));
  EXPECT_EQ(parsed, SegmentBackend::kCudaVmm);
}

TEST(SegmentBackend, UnknownNameIsRefused) {
  EXPECT_THAT(ParseSegmentBackend("rocm"),
              StatusIs(absl::StatusCode::kInvalidArgument, "unknown segment backend 'rocm'"));
  EXPECT_THAT(ParseSegmentBackend(""), StatusIs(absl::StatusCode::kInvalidArgument, "unknown segment backend ''"));
}

TEST(SegmentBackend, OnlyLegacyIpcIsExportedWithoutAnFd) {
  EXPECT_TRUE(ExportsFd(SegmentBackend::kMemfd));
  EXPECT_TRUE(ExportsFd(SegmentBackend::kCudaVmm));
  EXPECT_FALSE(ExportsFd(SegmentBackend::kCudaLegacyIpc));
  EXPECT_TRUE(ExportsFd(SegmentBackend::kEmulated));
}

}  // namespace
}  // namespace weightd
