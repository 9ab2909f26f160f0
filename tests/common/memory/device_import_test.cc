// ImportArena: the client-side import of device arenas, and its
// copy-on-write option.
#include <fcntl.h>
#include <unistd.h>

#include <string>

#include "absl/strings/str_cat.h"

#include "common/memory/device.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::absl::StatusCode;

// A sealed emulated arena on GPU-emulated-2 holding "abcdefgh".
std::unique_ptr<DeviceArena> SealedArena(DeviceBackend& backend) {
  absl::StatusOr<std::vector<DeviceInfo>> devices = backend.Devices();
  absl::StatusOr<std::unique_ptr<DeviceArena>> arena = backend.Allocate((*devices)[2], 8);
  if (!arena.ok() || !(*arena)->CopyFromHost(0, 8, "abcdefgh", 8, 8, 1).ok() || !(*arena)->Seal().ok()) return nullptr;
  return std::move(*arena);
}

ArenaExport ExportOf(const DeviceArena& arena, bool copy_on_write) {
  return {"emulated", "GPU-emulated-2", arena.size(), "", ScopedFd(fcntl(arena.export_fd(), F_DUPFD_CLOEXEC, 0)),
          copy_on_write};
}

TEST(ImportArena, CopyOnWriteEmulatedArenaKeepsWritesInThisMapping) {
  std::unique_ptr<DeviceBackend> backend = MakeEmulatedBackend();
  std::unique_ptr<DeviceArena> arena = SealedArena(*backend);
  ASSERT_NE(arena, nullptr);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedArena> mine, ImportArena(ExportOf(*arena, true)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<ImportedArena> shared, ImportArena(ExportOf(*arena, false)));
  EXPECT_FALSE(mine->read_only());
  EXPECT_TRUE(shared->read_only());
  EXPECT_EQ(mine->device_ordinal(), 2);
  static_cast<char*>(const_cast<void*>(mine->device_pointer()))[1] = 'X';
  EXPECT_EQ(std::string(static_cast<const char*>(mine->device_pointer()), 8), "aXcdefgh");
  EXPECT_EQ(std::string(static_cast<const char*>(shared->device_pointer()), 8), "abcdefgh");
  std::string in_arena(8, '\0');
  WEIGHTD_ASSERT_OK(arena->CopyToHost(0, in_arena.data(), 8));
  EXPECT_EQ(in_arena, "abcdefgh");
}

TEST(ImportArena, CudaArenasRefuseCopyOnWriteBeforeLoadingADriver) {
  for (const char* backend : {"cuda-vmm", "cuda-legacy-ipc"}) {
    EXPECT_THAT(ImportArena({backend, "GPU-1234", 2 << 20, "", ScopedFd(), /*copy_on_write=*/true}),
                StatusIs(StatusCode::kFailedPrecondition,
                         absl::StrCat("a ", backend, " arena on GPU-1234 cannot be mapped copy-on-write")));
  }
}

TEST(ImportArena, UnknownBackendIsInvalidArgument) {
  EXPECT_THAT(ImportArena({"rocm", "GPU-1", 8, "", ScopedFd(), false}),
              StatusIs(StatusCode::kInvalidArgument, "unknown segment backend 'rocm'"));
}

}  // namespace
}  // namespace weightd
