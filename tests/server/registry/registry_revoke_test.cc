// A forced unload ends fd-exported leases at once, but leaves claimed leases
// on handle-exported (cuda-legacy-ipc) arenas to their clients: the arenas
// are freed only when those clients close their fd-socket connections.
#include <poll.h>

#include <thread>

#include "common/memory/device.h"
#include "common/base/status.h"
#include "common/transport/unix_socket.h"
#include "gtest/gtest.h"
#include "server/listen/fd_channel.h"
#include "tests/server/registry/registry_fixture.h"
#include "tests/testing/counting_backend.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::registry_test::MakeDir;
using ::weightd::registry_test::RegistryTest;
using ::weightd::registry_test::Tensors;
using ::weightd::registry_test::WriteCheckpoint;
using ::weightd::testing::CountingBackend;

class RevokeTest : public RegistryTest {
 protected:
  // A registry whose arenas come from `backend`, with Tensors(1) loaded as
  // "m" entirely on the one emulated GPU.
  std::unique_ptr<ModelRegistry> LoadOnDevice(DeviceBackend* backend) {
    RegistryOptions options = Options();
    options.loader.device_backend = backend;
    auto registry = std::make_unique<ModelRegistry>(options, nullptr);
    WriteCheckpoint(MakeDir(root_.Join("ck")) + "/model.safetensors", Tensors(1));
    LoadRequest request;
    request.name = "m";
    request.checkpoint_path = "ck";
    request.devices = {"GPU-emulated-0"};
    absl::StatusOr<ModelRegistry::LoadResult> loaded = registry->Load(request, nullptr);
    EXPECT_TRUE(loaded.ok()) << loaded.status();
    if (loaded.ok()) {
      EXPECT_EQ(loaded->model->arenas.size(), 1u);
    }
    return registry;
  }

  CountingBackend by_handle_{{.devices = 1, .export_by_handle = true}};
};

TEST_F(RevokeTest, ForcedUnloadLeavesClaimedHandleExportedLeasesToTheirClients) {
  std::unique_ptr<ModelRegistry> registry = LoadOnDevice(&by_handle_);
  ASSERT_EQ(by_handle_.live(), 1);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto a, registry->Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto b, registry->Attach("m", 0));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto pending, registry->Attach("m", 0));  // never claimed: ends at once
  WEIGHTD_ASSERT_OK(registry->Claim(a.lease_id));
  WEIGHTD_ASSERT_OK(registry->Claim(b.lease_id));
  std::string a_id = a.lease_id, b_id = b.lease_id, pending_id = pending.lease_id;
  a = b = pending = {};

  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry->Unload("m", /*force=*/true));
  EXPECT_FALSE(unloaded.freed);
  EXPECT_EQ(unloaded.model->leases.load(), 2);
  EXPECT_EQ(unloaded.model->state.load(), ModelState::kDraining);
  unloaded = {};
  EXPECT_TRUE(registry->IsLeaseLive(a_id));
  EXPECT_TRUE(registry->IsLeaseLive(b_id));
  EXPECT_FALSE(registry->IsLeaseLive(pending_id));
  // A second forced unload finds the draining generation and keeps them too.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto again, registry->Unload("m", /*force=*/true));
  EXPECT_FALSE(again.freed);
  EXPECT_EQ(again.model->leases.load(), 2);
  again = {};

  registry->Release(a_id);  // the first client closed its connection
  EXPECT_EQ(by_handle_.live(), 1);
  ASSERT_EQ(registry->List().size(), 1u);
  registry->Release(b_id);
  EXPECT_EQ(by_handle_.live(), 0);
  EXPECT_TRUE(registry->List().empty());
}

TEST_F(RevokeTest, ForcedUnloadOfFdExportedArenasEndsEveryLeaseAtOnce) {
  CountingBackend by_fd({.devices = 1});
  std::unique_ptr<ModelRegistry> registry = LoadOnDevice(&by_fd);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto a, registry->Attach("m", 0));
  WEIGHTD_ASSERT_OK(registry->Claim(a.lease_id));
  std::string id = a.lease_id;
  a = {};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry->Unload("m", /*force=*/true));
  EXPECT_TRUE(unloaded.freed);
  EXPECT_EQ(unloaded.model->leases.load(), 0);
  unloaded = {};
  EXPECT_FALSE(registry->IsLeaseLive(id));
  EXPECT_EQ(by_fd.live(), 0);
  EXPECT_TRUE(registry->List().empty());
}

// Through the fd socket: the daemon keeps the connection of a claimed
// legacy-IPC lease open after a forced unload, and frees the arena once the
// client closes it.
TEST_F(RevokeTest, FdChannelFreesHandleExportedArenasWhenTheClientCloses) {
  std::unique_ptr<ModelRegistry> registry = LoadOnDevice(&by_handle_);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(
      std::unique_ptr<FdChannel> channel,
      FdChannel::Start({.path = root_.Join("fd.sock")}, registry.get()));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto grant, registry->Attach("m", 0));
  std::string id = grant.lease_id;
  grant = {};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ScopedFd conn, ConnectSeqpacket(root_.Join("fd.sock")));
  WEIGHTD_ASSERT_OK(SendMessage(conn.get(), "CLAIM " + id, {}));
  std::vector<ScopedFd> fds;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string reply, ReceiveMessage(conn.get(), &fds, 5000));
  EXPECT_EQ(reply, "OK 0");  // no host tensors, so no host segment; the arena travels as handle bytes
  EXPECT_EQ(fds.size(), 0u);

  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, registry->Unload("m", /*force=*/true));
  EXPECT_FALSE(unloaded.freed);
  unloaded = {};
  pollfd p = {conn.get(), POLLIN | POLLRDHUP, 0};
  EXPECT_EQ(poll(&p, 1, 300), 0) << "the daemon closed a legacy-IPC lease's connection";
  EXPECT_EQ(by_handle_.live(), 1);

  conn.Reset();
  for (int i = 0; i < 200 && by_handle_.live() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(by_handle_.live(), 0);
  EXPECT_TRUE(registry->List().empty());
}

}  // namespace
}  // namespace weightd
