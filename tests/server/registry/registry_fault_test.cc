// What a load leaves behind when the disk fails under it: files read
// through a fault-injecting Env (tests/testing/fault_env.h) fail with EIO
// half-way or change size, and the registry must free every segment of
// that load, keep a FAILED record, and keep other models serving.
#include <dirent.h>
#include <sys/stat.h>

#include "gtest/gtest.h"
#include "server/metrics/metrics.h"
#include "tests/server/registry/registry_fixture.h"
#include "tests/testing/counting_backend.h"
#include "tests/testing/fault_env.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::registry_test::RegistryTest;
using ::weightd::registry_test::Tensor;
using ::weightd::registry_test::WriteCheckpoint;
using ::weightd::testing::CountingBackend;
using ::weightd::testing::FaultInjectingEnv;
using ::weightd::testing::Faults;
using Code = absl::StatusCode;

constexpr uint64_t kMiB = 1 << 20;

// Open file descriptors of this process (memfds of host segments and
// emulated arenas included).
int OpenFds() {
  int n = 0;
  DIR* dir = opendir("/proc/self/fd");
  while (readdir(dir) != nullptr) ++n;
  closedir(dir);
  return n;
}

uint64_t FileSize(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : 0;
}

class RegistryFaultTest : public RegistryTest {
 protected:
  RegistryOptions FaultyOptions(DeviceBackend* backend = nullptr) {
    RegistryOptions options = Options();
    options.env = &env_;
    options.loader.threads = 1;  // blocks in file order: the ones before the fault are read
    options.loader.direct_io = DirectIo::kOff;
    options.loader.device_backend = backend;
    return options;
  }
  // root/<name>/model.safetensors: tensors t0..t3 of 1 MiB each; returns the
  // file's byte offset of the middle of t2, half-way through the data.
  uint64_t BigCheckpoint(const std::string& name) {
    std::vector<Tensor> tensors;
    for (int i = 0; i < 4; ++i) tensors.push_back({"t" + std::to_string(i), "U8", {kMiB}, std::string(kMiB, 'a' + i)});
    std::string file = registry_test::MakeDir(root_.Join(name)) + "/model.safetensors";
    WriteCheckpoint(file, tensors);
    return FileSize(file) - 4 * kMiB + 2 * kMiB + kMiB / 2;
  }
  std::vector<std::string> States(const ModelRegistry& registry) {
    std::vector<std::string> out;
    for (const auto& m : registry.ListAll()) {
      out.push_back(absl::StrCat(m->request.name, "/", m->generation, "=", static_cast<int>(m->state.load())));
    }
    return out;
  }

  FaultInjectingEnv env_;
  ModelRegistry faulty_{FaultyOptions(), &listener_};
};

constexpr int kReady = static_cast<int>(ModelState::kReady);
constexpr int kFailed = static_cast<int>(ModelState::kFailed);

TEST_F(RegistryFaultTest, EioHalfWayFreesEverythingAndOthersKeepServing) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto good, Load("good", Checkpoint("ck", 1), &faulty_));
  uint64_t half = BigCheckpoint("big");
  env_.set_faults(Faults{"big/model.safetensors", static_cast<int64_t>(half)});
  int fds = OpenFds();
  EXPECT_THAT(Load("big", "big", &faulty_), StatusIs(Code::kInternal, "model.safetensors: tensor 't2': "));
  EXPECT_THAT(Load("big", "big", &faulty_),
              StatusIs(Code::kInternal, absl::StrCat("read at byte ", half, ": Input/output error")));
  EXPECT_EQ(env_.eio_reads(), 2);
  EXPECT_EQ(OpenFds(), fds);  // no memfd of the host segment is left
  ASSERT_EQ(faulty_.List().size(), 1u);
  EXPECT_EQ(faulty_.List()[0], good.model);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, faulty_.Attach("good", 0));
  EXPECT_EQ(lease.model, good.model);
  faulty_.Release(lease.lease_id);
  EXPECT_EQ(listener_.failures().size(), 2u);
}

TEST_F(RegistryFaultTest, EioHalfWayFreesEveryDeviceArena) {
  CountingBackend backend;
  ModelRegistry registry(FaultyOptions(&backend), nullptr);
  uint64_t half = BigCheckpoint("big");
  env_.set_faults(Faults{"big/model.safetensors", static_cast<int64_t>(half)});
  LoadRequest request;
  request.name = "big";
  request.checkpoint_path = "big";
  request.devices = {"GPU-emulated-0"};
  int fds = OpenFds();
  EXPECT_THAT(registry.Load(request, nullptr), StatusIs(Code::kInternal, "Input/output error"));
  EXPECT_EQ(backend.allocations(), 1);
  EXPECT_EQ(backend.live(), 0);
  EXPECT_EQ(OpenFds(), fds);
  env_.set_faults({});
  WEIGHTD_ASSERT_OK(registry.Load(request, nullptr));
  EXPECT_EQ(backend.live(), 1);
}

TEST_F(RegistryFaultTest, FailedLoadIsListedAsFailedWithItsErrorAndProgress) {
  uint64_t half = BigCheckpoint("big");
  env_.set_faults(Faults{"big/model.safetensors", static_cast<int64_t>(half)});
  ASSERT_FALSE(Load("big", "big", &faulty_).ok());
  EXPECT_TRUE(faulty_.List().empty());  // a FAILED record holds no memory
  std::vector<std::shared_ptr<ModelGeneration>> all = faulty_.ListAll();
  ASSERT_EQ(all.size(), 1u);
  const ModelGeneration& failed = *all[0];
  EXPECT_EQ(failed.state.load(), ModelState::kFailed);
  EXPECT_EQ(failed.request.name, "big");
  EXPECT_EQ(failed.request.checkpoint_path, registry_test::RealPath(root_.Join("big")));
  EXPECT_EQ(failed.generation, 0u);
  EXPECT_EQ(failed.bytes_done.load(), 2 * kMiB);  // t0 and t1, read before the fault in t2
  EXPECT_EQ(failed.bytes_total.load(), 4 * kMiB);
  EXPECT_EQ(failed.error.rfind("INTERNAL: model.safetensors: tensor 't2': ", 0), 0u) << failed.error;
  EXPECT_NE(failed.error.find("Input/output error"), std::string::npos) << failed.error;
  EXPECT_EQ(failed.host_bytes, 0u);
  EXPECT_TRUE(failed.segments.empty());
}

TEST_F(RegistryFaultTest, AttachOrManifestOfAFailedNameIsFailedPreconditionNamingTheError) {
  env_.set_faults(Faults{"big/model.safetensors", static_cast<int64_t>(BigCheckpoint("big"))});
  ASSERT_FALSE(Load("big", "big", &faulty_).ok());
  EXPECT_THAT(faulty_.Attach("big", 0),
              StatusIs(Code::kFailedPrecondition, "model 'big' failed to load (INTERNAL: model.safetensors: "));
  EXPECT_THAT(faulty_.GetRank("big", 0), StatusIs(Code::kFailedPrecondition, "Input/output error); load it again"));
  EXPECT_THAT(faulty_.Get("big"), StatusIs(Code::kFailedPrecondition, "failed to load"));
}

TEST_F(RegistryFaultTest, LoadingTheNameAgainReplacesItsFailedRecord) {
  env_.set_faults(Faults{"big/model.safetensors", static_cast<int64_t>(BigCheckpoint("big"))});
  ASSERT_FALSE(Load("big", "big", &faulty_).ok());
  EXPECT_THAT(States(faulty_), ::testing::ElementsAre(absl::StrCat("big/0=", kFailed)));
  env_.set_faults({});
  WEIGHTD_ASSERT_OK(Load("big", "big", &faulty_));
  EXPECT_THAT(States(faulty_), ::testing::ElementsAre(absl::StrCat("big/1=", kReady)));
  WEIGHTD_EXPECT_OK(faulty_.Attach("big", 0));
}

TEST_F(RegistryFaultTest, UnloadOfAFailedNameRemovesIt) {
  env_.set_faults(Faults{"big/model.safetensors", static_cast<int64_t>(BigCheckpoint("big"))});
  ASSERT_FALSE(Load("big", "big", &faulty_).ok());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, faulty_.Unload("big", /*force=*/false));
  EXPECT_TRUE(unloaded.freed);
  EXPECT_EQ(unloaded.model->state.load(), ModelState::kFailed);
  EXPECT_TRUE(faulty_.ListAll().empty());
  EXPECT_THAT(faulty_.Unload("big", false), StatusIs(Code::kNotFound, "no model named 'big'"));
  EXPECT_THAT(faulty_.Attach("big", 0), StatusIs(Code::kNotFound, "no model named 'big'"));
}

TEST_F(RegistryFaultTest, FailedReloadKeepsServingTheReadyGenerationBesideItsFailedRecord) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto good, Load("m", Checkpoint("ck", 1), &faulty_));
  env_.set_faults(Faults{"big/model.safetensors", static_cast<int64_t>(BigCheckpoint("big"))});
  ASSERT_FALSE(Load("m", "big", &faulty_).ok());
  EXPECT_THAT(States(faulty_), ::testing::ElementsAre(absl::StrCat("m/1=", kReady), absl::StrCat("m/0=", kFailed)));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto current, faulty_.Get("m"));
  EXPECT_EQ(current, good.model);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto lease, faulty_.Attach("m", 0));
  faulty_.Release(lease.lease_id);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(auto unloaded, faulty_.Unload("m", false));
  EXPECT_EQ(unloaded.model, good.model);
  EXPECT_TRUE(faulty_.ListAll().empty());  // the unload took the FAILED record too
}

TEST_F(RegistryFaultTest, FileThatChangedSizeAfterCatalogFailsTheLoad) {
  BigCheckpoint("big");
  uint64_t size = FileSize(root_.Join("big/model.safetensors"));
  env_.set_faults(Faults{"big/model.safetensors", -1, 0, 5});
  EXPECT_THAT(Load("big", "big", &faulty_),
              StatusIs(Code::kFailedPrecondition, absl::StrCat("file changed size while loading (", size, " -> 5 bytes)")));
  EXPECT_THAT(States(faulty_), ::testing::ElementsAre(absl::StrCat("big/0=", kFailed)));
}

TEST_F(RegistryFaultTest, FailedAndReadyRecordsAreCountedByStateInMetrics) {
  WEIGHTD_ASSERT_OK(Load("good", Checkpoint("ck", 1), &faulty_));
  env_.set_faults(Faults{"big/model.safetensors", static_cast<int64_t>(BigCheckpoint("big"))});
  ASSERT_FALSE(Load("big", "big", &faulty_).ok());
  ModelsSample sample = SampleModels(faulty_.ListAll());
  EXPECT_EQ(sample.by_state,
            (std::map<std::string, int>{{"DRAINING", 0}, {"FAILED", 1}, {"LOADING", 0}, {"READY", 1}}));
}

}  // namespace
}  // namespace weightd
