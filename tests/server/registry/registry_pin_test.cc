// Pinning: a loaded generation is published unlocked and its host segments
// are mlock()ed afterwards on the registry's pinning thread, off the load's
// critical path; locked_bytes then says what took.
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "tests/server/registry/registry_fixture.h"
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

// A restarting daemon holds pinning until it listens: nothing is tried (not
// even an mlock that would fail) before ReleasePinning().
TEST_F(RegistryTest, HeldPinningStartsAtRelease) {
  RegistryOptions options = Options();
  options.loader.mlock = true;
  options.hold_pinning = true;
  ModelRegistry registry(options, &listener_);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::LoadResult loaded, Load("held", Checkpoint("held", 5), &registry));
  const HostSegment& segment = *loaded.model->host_segments.at(0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // an unheld pinner locks 136 B in well under this
  EXPECT_FALSE(segment.locked());
  EXPECT_EQ(segment.lock_errno(), 0);
  EXPECT_EQ(loaded.model->locked_bytes.load(), 0u);
  registry.ReleasePinning();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!(segment.locked() || segment.lock_errno() != 0) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(segment.locked() || segment.lock_errno() != 0) << "no pin was tried after ReleasePinning()";
}

// Shutdown: the page tables of every held generation are dropped once, and
// what they map still reads the same.
TEST_F(RegistryTest, DropHostPageTablesCoversEveryGenerationAndKeepsTheBytes) {
  ModelRegistry registry(Options(), &listener_);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::LoadResult a, Load("a", Checkpoint("a", 5), &registry));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::LoadResult b, Load("b", Checkpoint("b", 6), &registry));
  const std::string before(a.model->host_segments.at(0)->data(), a.model->host_segments.at(0)->size());
  const uint64_t expected = a.model->host_segments.at(0)->size() + b.model->host_segments.at(0)->size();
  EXPECT_EQ(registry.DropHostPageTables(), expected);
  EXPECT_EQ(std::string(a.model->host_segments.at(0)->data(), a.model->host_segments.at(0)->size()), before);
}

}  // namespace
}  // namespace weightd::registry_test
