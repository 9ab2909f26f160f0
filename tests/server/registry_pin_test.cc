// Pinning: a loaded generation is published unlocked and its host segments
// are mlock()ed afterwards on the registry's pinning thread, off the load's
// critical path; locked_bytes then says what took.
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "tests/server/registry_fixture.h"
#include "tests/testing/status_matchers.h"

namespace weightd::registry_test {
namespace {

TEST_F(RegistryTest, LoadedGenerationIsPinnedAfterPublishing) {
  RegistryOptions options = Options();
  options.loader.mlock = true;
  ModelRegistry registry(options, &listener_);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::LoadResult loaded, Load("pinned", Checkpoint("pinned", 5), &registry));
  const ModelGeneration& model = *loaded.model;
  ASSERT_EQ(model.host_segments.size(), 1u);
  const HostSegment& segment = *model.host_segments[0];
  // Root has CAP_IPC_LOCK; anyone else needs RLIMIT_MEMLOCK room for the one page.
  rlimit limit{};
  ASSERT_EQ(getrlimit(RLIMIT_MEMLOCK, &limit), 0);
  const bool can_lock = geteuid() == 0 || limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= (1u << 20);
  const uint64_t expected = can_lock ? model.host_bytes : 0;
  // Poll with a deadline: the pinning thread runs after Load returned.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!(segment.locked() || segment.lock_errno() != 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  while (model.locked_bytes.load() != expected && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(segment.locked(), can_lock) << "lock_errno " << segment.lock_errno();
  EXPECT_EQ(model.locked_bytes.load(), expected);
  EXPECT_EQ(model.host_bytes, 136u);  // a.weight 16 B at 0, b.bias 3 B at 64, c.scale 8 B at 128
}

}  // namespace
}  // namespace weightd::registry_test
