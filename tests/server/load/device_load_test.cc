// The device half of the load pipeline on the emulated backend: slices land
// where the manifest says, and a failed load frees every arena.
#include <unistd.h>

#include <atomic>
#include <cstring>

#include "common/format/catalog.h"
#include "common/memory/device.h"
#include "common/base/status.h"
#include "gtest/gtest.h"
#include "server/load/loader.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/counting_backend.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::CountingBackend;

std::string Iota(size_t n) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 7 + 1);
  return s;
}

LoadRequest Request() {
  LoadRequest r;
  r.name = "m";
  r.tp_size = 2;
  r.devices = {"GPU-emulated-0", "GPU-emulated-1"};
  r.tp_rules = {{"rows", 0}, {"cols", 1}};
  r.host_resident_patterns = {"table"};
  return r;
}

TEST(DeviceLoad, SlicesLandWhereTheManifestSays) {
  testing::TempDir dir;
  // cols is [3, 4, 6] U8 split on dim 1: rank r holds [3, 2, 6] = rows 2r, 2r+1 of each outer block.
  std::string rows = Iota(8 * 5), cols = Iota(3 * 4 * 6), rep = Iota(10), table = Iota(64);
  testing::WriteFile(dir.Join("m.safetensors"), testing::SafetensorsBuilder()
                                                    .Add("rows", "U8", {8, 5}, rows)
                                                    .Add("cols", "U8", {3, 4, 6}, cols)
                                                    .Add("rep", "U8", {10}, rep)
                                                    .Add("table", "U8", {64}, table)
                                                    .Build());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog catalog, BuildCatalog(dir.Join("m.safetensors")));
  CountingBackend backend;
  LoaderOptions options;
  options.device_backend = &backend;
  options.mlock = false;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ModelGeneration> gen, LoadGeneration(catalog, Request(), options, nullptr));
  ASSERT_EQ(gen->ranks.size(), 2u);
  EXPECT_EQ(backend.live(), 2);  // one arena per rank
  for (uint32_t r = 0; r < 2; ++r) {
    const RankManifest& rank = gen->ranks[r];
    ASSERT_EQ(rank.segments.size(), 2u);  // host + one arena
    DeviceArena& arena = *gen->arenas[r];
    auto device_bytes = [&](const TensorRecord& t) {
      std::string out(t.nbytes, '\0');
      EXPECT_TRUE(arena.CopyToHost(t.offset, out.data(), t.nbytes).ok());
      return out;
    };
    EXPECT_EQ(device_bytes(rank.tensors[0]), rows.substr(r * 20, 20));
    std::string expected_cols;
    for (int o = 0; o < 3; ++o) expected_cols += cols.substr(o * 24 + r * 12, 12);
    EXPECT_EQ(device_bytes(rank.tensors[1]), expected_cols);
    EXPECT_EQ(device_bytes(rank.tensors[2]), rep);
    EXPECT_EQ(rank.tensors[3].placement, Placement::kHost);
    EXPECT_EQ(std::string(gen->host_segments[0]->data() + rank.tensors[3].offset, 64), table);
    EXPECT_EQ(gen->segments[rank.segments[1]].gpu_uuid, "GPU-emulated-" + std::to_string(r));
  }
  // Content hashes are of the full checkpoint tensor, identical on both ranks.
  EXPECT_EQ(gen->ranks[0].tensors[1].content_hash, TensorContentHash(cols.data(), cols.size()));
  EXPECT_EQ(gen->ranks[1].tensors[1].content_hash, gen->ranks[0].tensors[1].content_hash);
  gen.reset();
  EXPECT_EQ(backend.live(), 0);
}

TEST(DeviceLoad, SplitTensorsLargerThanABlockAreExact) {
  testing::TempDir dir;
  // 3 x 4096 x 2048 U8 = 24 MiB, split on dim 1: blocks of 16 MiB cut slices mid-row.
  std::string big = Iota(3ull * 4096 * 2048);
  testing::WriteFile(dir.Join("m.safetensors"),
                     testing::SafetensorsBuilder().Add("cols", "U8", {3, 4096, 2048}, big).Build());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog catalog, BuildCatalog(dir.Join("m.safetensors")));
  CountingBackend backend;
  LoaderOptions options;
  options.device_backend = &backend;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ModelGeneration> gen, LoadGeneration(catalog, Request(), options, nullptr));
  for (uint32_t r = 0; r < 2; ++r) {
    const TensorRecord& t = gen->ranks[r].tensors[0];
    std::string got(t.nbytes, '\0');
    WEIGHTD_ASSERT_OK(gen->arenas[r]->CopyToHost(t.offset, got.data(), got.size()));
    std::string expected;
    for (int o = 0; o < 3; ++o) expected += big.substr(o * 4096ull * 2048 + r * 2048ull * 2048, 2048ull * 2048);
    EXPECT_TRUE(got == expected) << "rank " << r;
  }
}

TEST(DeviceLoad, FailedAllocationFreesEveryArena) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("m.safetensors"),
                     testing::SafetensorsBuilder().Add("rows", "U8", {8, 5}, Iota(40)).Build());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog catalog, BuildCatalog(dir.Join("m.safetensors")));
  CountingBackend backend({.fail_allocation = 1});  // rank 1's arena
  LoaderOptions options;
  options.device_backend = &backend;
  EXPECT_THAT(LoadGeneration(catalog, Request(), options, nullptr),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "allocating a 20-byte arena for rank 1 on GPU-emulated-1: out of device memory (injected)"));
  EXPECT_EQ(backend.allocations(), 2);
  EXPECT_EQ(backend.live(), 0);
}

TEST(DeviceLoad, FailedReadFreesEveryArena) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("m.safetensors"),
                     testing::SafetensorsBuilder().Add("rows", "U8", {8, 5}, Iota(40)).Add("rep", "U8", {4}, "abcd").Build());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog catalog, BuildCatalog(dir.Join("m.safetensors")));
  // Shrink the file after cataloging: the reader notices before reading.
  ASSERT_EQ(truncate(dir.Join("m.safetensors").c_str(), static_cast<off_t>(catalog.files[0].size - 3)), 0);
  CountingBackend backend;
  LoaderOptions options;
  options.device_backend = &backend;
  EXPECT_THAT(LoadGeneration(catalog, Request(), options, nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition, "m.safetensors: file changed size while loading"));
  EXPECT_EQ(backend.live(), 0);
}

TEST(DeviceLoad, HostTensorsBeyondAvailableMemoryAreRefusedBeforeAllocating) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("m.safetensors"), testing::SafetensorsBuilder().Add("table", "U8", {100}, Iota(100)).Build());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog catalog, BuildCatalog(dir.Join("m.safetensors")));
  LoaderOptions options;
  options.host_memory_limit = 99;
  LoadRequest host_only;
  host_only.name = "m";
  EXPECT_THAT(LoadGeneration(catalog, host_only, options, nullptr),
              StatusIs(absl::StatusCode::kResourceExhausted,
                       "the host-resident tensors need 100 bytes of host memory but only 99 are available"));
  options.host_memory_limit = 100;
  WEIGHTD_EXPECT_OK(LoadGeneration(catalog, host_only, options, nullptr));
}

TEST(DeviceLoad, DevicesWithoutABackendAreRefused) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("m.safetensors"), testing::SafetensorsBuilder().Add("rows", "U8", {8, 5}, Iota(40)).Build());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog catalog, BuildCatalog(dir.Join("m.safetensors")));
  EXPECT_THAT(LoadGeneration(catalog, Request(), LoaderOptions{}, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, "this daemon has no device backend"));
}

TEST(DeviceLoad, OneGpuForTwoRanksIsRefusedNamingBoth) {
  testing::TempDir dir;
  testing::WriteFile(dir.Join("m.safetensors"), testing::SafetensorsBuilder().Add("rows", "U8", {8, 5}, Iota(40)).Build());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Catalog catalog, BuildCatalog(dir.Join("m.safetensors")));
  CountingBackend backend;
  LoaderOptions options;
  options.device_backend = &backend;
  options.mlock = false;
  LoadRequest request = Request();
  request.devices = {"0", "GPU-emulated-0"};  // the same GPU by ordinal and by UUID
  EXPECT_THAT(LoadGeneration(catalog, request, options, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "device 'GPU-emulated-0' (GPU-emulated-0) is given for ranks 0 and 1: one GPU per rank"));
  EXPECT_EQ(backend.live(), 0);
}

}  // namespace
}  // namespace weightd
