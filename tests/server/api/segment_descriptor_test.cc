// SegmentRecord -> SegmentDescriptor: one backend spelling on the wire, and
// export_kind agreeing with what the fd channel sends (an fd or none).
#include <string>

#include "gtest/gtest.h"
#include "server/api/convert.h"

namespace weightd {
namespace {

v1::SegmentDescriptor Encode(const SegmentRecord& record) {
  v1::SegmentDescriptor out;
  ToProto(record, 4, &out);
  return out;
}

TEST(SegmentDescriptor, HostMemfdComesWithItsFd) {
  v1::SegmentDescriptor d = Encode({Placement::kHost, 4096, SegmentBackend::kMemfd, "", 7, ""});
  EXPECT_EQ(d.id(), 4u);
  EXPECT_EQ(d.placement(), v1::HOST);
  EXPECT_EQ(d.size(), 4096u);
  EXPECT_EQ(d.backend(), "memfd");
  EXPECT_EQ(d.export_kind(), v1::SegmentDescriptor::EXPORT_FD);
}

TEST(SegmentDescriptor, CudaVmmIsSpelledCudaVmm) {
  v1::SegmentDescriptor d = Encode({Placement::kDevice, 2 << 20, SegmentBackend::kCudaVmm, "GPU-a", 9, ""});
  EXPECT_EQ(d.backend(), "cuda-vmm");
  EXPECT_EQ(d.gpu_uuid(), "GPU-a");
  EXPECT_EQ(d.export_kind(), v1::SegmentDescriptor::EXPORT_FD);
}

TEST(SegmentDescriptor, HandleExportedArenaSaysSo) {
  std::string handle(64, 'h');
  v1::SegmentDescriptor d = Encode({Placement::kDevice, 2 << 20, SegmentBackend::kCudaLegacyIpc, "GPU-a", -1, handle});
  EXPECT_EQ(d.backend(), "cuda-legacy-ipc");
  EXPECT_EQ(d.ipc_handle(), handle);
  EXPECT_EQ(d.export_kind(), v1::SegmentDescriptor::EXPORT_IPC_HANDLE);
}

}  // namespace
}  // namespace weightd
