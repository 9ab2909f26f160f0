// The C++ client library against a real daemon: views, Find, fingerprint,
// DLPack export and its hold on the lease.
#include "weightd/client.h"

#include <dlpack/dlpack.h>

#include <thread>

#include "client/dlpack_dtype.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using testing::DaemonProcess;

class ClientTest : public ::testing::Test {
 protected:
  ClientTest() : d_({"--device-backend", "emulated"}) {
    testing::WriteFile(d_.models_dir() + "/m.safetensors", testing::SafetensorsBuilder()
                                                                .Add("w", "BF16", {2, 3}, "abcdefghijkl")
                                                                .Add("f8", "F8_E4M3", {4}, "wxyz")
                                                                .Add("flag", "BOOL", {2}, std::string("\1\0", 2))
                                                                .Build());
    auto client = Client::Connect(d_.socket());
    EXPECT_TRUE(client.ok());
    client_ = std::move(*client);
  }
  int Leases() {
    auto models = client_->List();
    return models.ok() && !models->empty() ? static_cast<int>((*models)[0].leases) : -1;
  }
  DaemonProcess d_;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientTest, HostViewsPointAtTheCheckpointBytes) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadResult loaded, client_->Load("m", "m.safetensors", {}));
  EXPECT_EQ(loaded.model.tensor_count, 3u);
  EXPECT_EQ(loaded.model.checkpoint_bytes, 18u);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel model, client_->Attach("m", 0));
  EXPECT_EQ(model.fingerprint(), loaded.model.fingerprint);
  const TensorView* w = model.Find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(std::string(static_cast<const char*>(w->data), w->nbytes), "abcdefghijkl");
  EXPECT_EQ(w->location, Location::kHost);
  EXPECT_EQ(w->info->shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w->data) % 64, 0u);  // host tensors are 64-byte aligned
  EXPECT_EQ(model.Find("nope"), nullptr);
  EXPECT_EQ(Leases(), 1);
}

TEST_F(ClientTest, DLPackExportKeepsTheLeaseUntilDeleted) {
  ASSERT_TRUE(client_->Load("m", "m.safetensors", {}).ok());
  DLManagedTensor* dl = nullptr;
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel model, client_->Attach("m", 0));
    WEIGHTD_ASSERT_OK_AND_ASSIGN(dl, model.ToDLPack(*model.Find("w")));
    EXPECT_EQ(dl->dl_tensor.device.device_type, kDLCPU);
    EXPECT_EQ(dl->dl_tensor.dtype.code, kDLBfloat);
    EXPECT_EQ(dl->dl_tensor.dtype.bits, 16);
    EXPECT_EQ(dl->dl_tensor.ndim, 2);
    EXPECT_EQ(dl->dl_tensor.shape[0], 2);
    EXPECT_EQ(dl->dl_tensor.shape[1], 3);
    EXPECT_EQ(dl->dl_tensor.strides[0], 3);
    EXPECT_EQ(dl->dl_tensor.strides[1], 1);
    EXPECT_EQ(dl->dl_tensor.byte_offset, 0u);
    WEIGHTD_ASSERT_OK_AND_ASSIGN(DLManagedTensor* flag, model.ToDLPack(*model.Find("flag")));
    EXPECT_EQ(flag->dl_tensor.dtype.code, 6);  // kDLBool
    flag->deleter(flag);
    // One policy with the Python client (client/dlpack_dtype.h): float8 as uint8 carriers.
    WEIGHTD_ASSERT_OK_AND_ASSIGN(DLManagedTensor* f8, model.ToDLPack(*model.Find("f8")));
    EXPECT_EQ(f8->dl_tensor.dtype.code, kDLUInt);
    EXPECT_EQ(f8->dl_tensor.dtype.bits, 8);
    f8->deleter(f8);
  }
  // The MappedModel is gone; the DLPack tensor still holds mapping and lease.
  EXPECT_EQ(std::string(static_cast<const char*>(dl->dl_tensor.data), 12), "abcdefghijkl");
  EXPECT_EQ(Leases(), 1);
  dl->deleter(dl);
  for (int i = 0; i < 100 && Leases() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(Leases(), 0);
}

TEST_F(ClientTest, EmulatedDeviceTensorsHaveDeviceOrdinalAndSliceBytes) {
  testing::WriteFile(d_.models_dir() + "/d.safetensors", testing::SafetensorsBuilder()
                                                              .Add("cols", "U8", {2, 4}, "abcdefgh")
                                                              .Add("norm", "U8", {3}, "xyz")
                                                              .Build());
  LoadOptions options;
  options.tp_size = 2;
  options.tp_rules = {{"cols", 1}};
  options.devices = {"GPU-emulated-3", "GPU-emulated-5"};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadResult loaded, client_->Load("d", "d.safetensors", options));
  EXPECT_EQ(loaded.model.device_bytes.at("GPU-emulated-5"), 256u + 3);  // cols slice at 0, norm at 256
  EXPECT_EQ(loaded.model.host_bytes, 0u);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel model, client_->Attach("d", 1));
  const TensorView* cols = model.Find("cols");
  ASSERT_NE(cols, nullptr);
  EXPECT_EQ(cols->location, Location::kDevice);
  EXPECT_EQ(cols->gpu_uuid, "GPU-emulated-5");
  EXPECT_EQ(cols->device_ordinal, 5);
  EXPECT_EQ(cols->info->shape, (std::vector<uint64_t>{2, 2}));
  std::string bytes(4, '\0');
  WEIGHTD_ASSERT_OK(model.CopyToHost(*cols, 0, bytes.data(), 4));
  EXPECT_EQ(bytes, "cdgh");  // columns 2..3 of each row
  EXPECT_TRUE(model.device_read_only());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(DLManagedTensor* dl, model.ToDLPack(*cols));
  EXPECT_EQ(dl->dl_tensor.device.device_type, kDLCPU);  // emulated device memory is host memory
  dl->deleter(dl);
}

TEST_F(ClientTest, SegmentsSayHowTheyAreExported) {
  testing::WriteFile(d_.models_dir() + "/d.safetensors",
                     testing::SafetensorsBuilder().Add("norm", "U8", {3}, "xyz").Add("embed", "U8", {2}, "ab").Build());
  LoadOptions options;
  options.host_resident_patterns = {"embed"};
  options.devices = {"GPU-emulated-1"};
  ASSERT_TRUE(client_->Load("d", "d.safetensors", options).ok());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel model, client_->Attach("d", 0));
  const std::vector<SegmentInfo>& segments = model.manifest().segments;
  ASSERT_EQ(segments.size(), 2u);
  EXPECT_EQ(segments[0].backend, "memfd");
  EXPECT_TRUE(segments[0].fd_attached);
  EXPECT_EQ(segments[1].backend, "emulated");
  EXPECT_TRUE(segments[1].fd_attached);
  EXPECT_EQ(segments[1].gpu_uuid, "GPU-emulated-1");
}

TEST_F(ClientTest, CopyOnWriteAttachWritesOnlyThisProcessesPages) {
  testing::WriteFile(d_.models_dir() + "/d.safetensors",
                     testing::SafetensorsBuilder().Add("norm", "U8", {3}, "xyz").Add("embed", "U8", {2}, "ab").Build());
  LoadOptions options;
  options.host_resident_patterns = {"embed"};
  options.devices = {"GPU-emulated-1"};
  ASSERT_TRUE(client_->Load("d", "d.safetensors", options).ok());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel mine, client_->Attach("d", 0, {.copy_on_write = true}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel shared, client_->Attach("d", 0));
  EXPECT_TRUE(mine.copy_on_write());
  EXPECT_FALSE(shared.copy_on_write());
  EXPECT_FALSE(mine.device_read_only());  // emulated arenas map copy-on-write too
  EXPECT_TRUE(shared.device_read_only());
  for (const char* name : {"embed", "norm"}) {
    char* bytes = static_cast<char*>(const_cast<void*>(mine.Find(name)->data));
    bytes[0] = 'Q';
    EXPECT_EQ(bytes[0], 'Q') << name;
  }
  EXPECT_EQ(std::string(static_cast<const char*>(shared.Find("embed")->data), 2), "ab");
  EXPECT_EQ(std::string(static_cast<const char*>(shared.Find("norm")->data), 3), "xyz");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel later, client_->Attach("d", 0, {.copy_on_write = true}));
  EXPECT_EQ(std::string(static_cast<const char*>(later.Find("embed")->data), 2), "ab");
}

TEST(DlpackDtype, OneTableForBothClients) {
  const DlpackDtype* f8 = FindDlpackDtype("F8_E5M2");
  ASSERT_NE(f8, nullptr);
  EXPECT_EQ(f8->code, kDLUInt);
  EXPECT_EQ(f8->bits, 8);
  EXPECT_EQ(FindDlpackDtype("BOOL")->code, kDLBoolCode);
  for (const char* f8 : {"F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}) {  // uint8 carriers
    ASSERT_NE(FindDlpackDtype(f8), nullptr) << f8;
    EXPECT_EQ(FindDlpackDtype(f8)->code, kDLUInt) << f8;
    EXPECT_EQ(FindDlpackDtype(f8)->bits, 8) << f8;
  }
  // Sub-byte elements have no DLPack 0.6 type: read their raw bytes.
  EXPECT_EQ(FindDlpackDtype("F4"), nullptr);
  EXPECT_EQ(FindDlpackDtype("F6_E2M3"), nullptr);
  EXPECT_EQ(FindDlpackDtype("F6_E3M2"), nullptr);
}

}  // namespace
}  // namespace weightd
