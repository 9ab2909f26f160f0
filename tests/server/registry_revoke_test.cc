// A forced unload of a generation whose arenas are exported by handle
// (cuda-legacy-ipc) keeps the arenas until every process that claimed a
// lease has exited; fd-exported memory is let go at once. ProcessWatch tells
// a running process from an exited one.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/device.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "server/process_watch.h"
#include "tests/server/registry_fixture.h"
#include "tests/testing/counting_backend.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::registry_test::RegistryTest;
using ::weightd::registry_test::WriteCheckpoint;
using ::weightd::registry_test::Tensors;
using ::weightd::registry_test::MakeDir;
using ::weightd::testing::CountingBackend;

// A child process that waits to be killed; reaped by Kill().
class Sleeper {
 public:
  Sleeper() : pid_(fork()) {
    if (pid_ == 0) {
      pause();
      _exit(0);
    }
  }
  ~Sleeper() { Kill(); }
  pid_t pid() const { return pid_; }
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_;
};

class RevokeTest : public RegistryTest {
 protected:
  RevokeTest() {
    RegistryOptions options = Options();
    options.loader.device_backend = &backend_;
    registry_ = std::make_unique<ModelRegistry>(options, nullptr);
  }
  // Loads Tensors(1) with every tensor on the one emulated GPU.
  std::shared_ptr<ModelGeneration> LoadOnDevice() {
    WriteCheckpoint(MakeDir(root_.Join("ck")) + "/model.safetensors", Tensors(1));
    LoadRequest request;
    request.name = "m";
    request.checkpoint_path = "ck";
    request.devices = {"GPU-emulated-0"};
    absl::StatusOr<ModelRegistry::LoadResult> loaded = registry_->Load(request, nullptr);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    return loaded.ok() ? loaded->model : nullptr;
  }

  CountingBackend backend_{{.devices = 1, .export_by_handle = true}};
  std::unique_ptr<ModelRegistry> registry_;
};

TEST_F(RevokeTest, ForcedUnloadKeepsHandleExportedArenasUntilClaimantsExit) {
  std::shared_ptr<ModelGeneration> model = LoadOnDevice();
  ASSERT_NE(model, nullptr);
  ASSERT_EQ(model->arenas.size(), 1u);
  EXPECT_EQ(backend_.live(), 1);
  Sleeper first, second;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto a, registry_->Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto b, registry_->Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto pending, registry_->Attach("m", 0));  // never claimed: holds nothing
  WEIGHTD_ASSERT_OK(registry_->Claim(a.lease_id, first.pid()));
  WEIGHTD_ASSERT_OK(registry_->Claim(b.lease_id, second.pid()));
  a = {};
  b = {};
  pending = {};

  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_->Unload("m", /*force=*/true));
  EXPECT_FALSE(unloaded.freed);
  EXPECT_EQ(unloaded.model->leases.load(), 0);
  EXPECT_EQ(unloaded.model->state.load(), ModelState::kDraining);
  unloaded = {};
  std::weak_ptr<ModelGeneration> weak = model;
  model.reset();
  ASSERT_EQ(registry_->List().size(), 1u);
  EXPECT_EQ(registry_->List()[0]->generation, 1u);
  // A second forced unload finds it, and still cannot free it.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto again, registry_->Unload("m", /*force=*/true));
  EXPECT_FALSE(again.freed);
  again = {};

  EXPECT_EQ(registry_->ReleaseRevoked(), 0);
  first.Kill();
  EXPECT_EQ(registry_->ReleaseRevoked(), 0);  // the second claimant still runs
  EXPECT_EQ(backend_.live(), 1);
  EXPECT_FALSE(weak.expired());
  second.Kill();
  EXPECT_EQ(registry_->ReleaseRevoked(), 1);
  EXPECT_TRUE(weak.expired());
  EXPECT_EQ(backend_.live(), 0);
  EXPECT_TRUE(registry_->List().empty());
  EXPECT_EQ(registry_->ReleaseRevoked(), 0);
}

TEST_F(RevokeTest, ClaimantInAnotherPidNamespaceHoldsTheArenasUntilExit) {
  ASSERT_NE(LoadOnDevice(), nullptr);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto a, registry_->Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry_->Claim(a.lease_id, /*claimant=*/0));  // SO_PEERCRED gives 0 for invisible pids
  a = {};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_->Unload("m", /*force=*/true));
  EXPECT_FALSE(unloaded.freed);
  unloaded = {};
  EXPECT_EQ(registry_->ReleaseRevoked(), 0);
  EXPECT_EQ(backend_.live(), 1);
  EXPECT_EQ(registry_->List().size(), 1u);
}

TEST_F(RevokeTest, PlainUnloadWaitsForLeasesNotProcesses) {
  ASSERT_NE(LoadOnDevice(), nullptr);
  Sleeper claimant;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto a, registry_->Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry_->Claim(a.lease_id, claimant.pid()));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry_->Unload("m", /*force=*/false));
  EXPECT_FALSE(unloaded.freed);
  unloaded = {};
  // The client closed its lease itself (after closing its IPC handles): freed
  // with the lease, though the process runs on.
  registry_->Release(a.lease_id);
  a = {};
  EXPECT_EQ(backend_.live(), 0);
  EXPECT_TRUE(registry_->List().empty());
}

TEST_F(RegistryTest, ForcedUnloadOfFdExportedMemoryFreesAtOnce) {
  std::unique_ptr<DeviceBackend> emulated = MakeEmulatedBackend(1);
  RegistryOptions options = Options();
  options.loader.device_backend = emulated.get();
  ModelRegistry registry(options, nullptr);
  WriteCheckpoint(MakeDir(root_.Join("ck")) + "/model.safetensors", Tensors(1));
  LoadRequest request;
  request.name = "m";
  request.checkpoint_path = "ck";
  request.devices = {"GPU-emulated-0"};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto loaded, registry.Load(request, nullptr));
  ASSERT_EQ(loaded.model->arenas.size(), 1u);
  ASSERT_GE(loaded.model->arenas[0]->export_fd(), 0);
  loaded = {};
  Sleeper claimant;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto a, registry.Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry.Claim(a.lease_id, claimant.pid()));
  a = {};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry.Unload("m", /*force=*/true));
  EXPECT_TRUE(unloaded.freed);
  EXPECT_TRUE(registry.List().empty());
}

TEST(ProcessWatch, TellsRunningFromExited) {
  Sleeper child;
  ProcessWatch watch(child.pid());
  EXPECT_TRUE(watch.known());
  EXPECT_EQ(watch.pid(), child.pid());
  EXPECT_FALSE(watch.Exited());
  child.Kill();
  EXPECT_TRUE(watch.Exited());
  ProcessWatch self(getpid());
  EXPECT_FALSE(self.Exited());
  ProcessWatch invisible(0);
  EXPECT_FALSE(invisible.known());
  EXPECT_FALSE(invisible.Exited());
}

}  // namespace
}  // namespace weightd
