// Attach's manifest encodings and prefault: the packed tensor table gives the
// same manifest as TensorEntry messages; a hostile daemon's malformed table
// is DATA_LOSS (and the lease is detached); prefault maps every page of the
// host segments at attach, lazily mapped ones none.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdio>
#include <fstream>

#include "common/format/packed_manifest.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "tests/testing/status_matchers.h"
#include "weightd/client.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

using testing::DaemonProcess;

class AttachManifestTest : public ::testing::Test {
 protected:
  AttachManifestTest() : d_({"--device-backend", "emulated"}) {
    testing::WriteFile(d_.models_dir() + "/m.safetensors",
                       testing::SafetensorsBuilder()
                           .Add("cols", "U8", {2, 4}, "abcdefgh")
                           .Add("norm", "F32", {2}, "12345678")
                           .Add("big", "U8", {3 * 4096 + 5}, std::string(3 * 4096 + 5, 'b'))
                           .Build());
    auto client = Client::Connect(d_.socket());
    EXPECT_TRUE(client.ok());
    client_ = std::move(*client);
  }
  DaemonProcess d_;
  std::unique_ptr<Client> client_;
};

void ExpectSameTensor(const TensorInfo& a, const TensorInfo& b) {
  EXPECT_EQ(a.name, b.name);
  EXPECT_EQ(a.dtype, b.dtype) << a.name;
  EXPECT_EQ(a.shape, b.shape) << a.name;
  EXPECT_EQ(a.location, b.location) << a.name;
  EXPECT_EQ(a.segment, b.segment) << a.name;
  EXPECT_EQ(a.offset, b.offset) << a.name;
  EXPECT_EQ(a.nbytes, b.nbytes) << a.name;
  EXPECT_EQ(a.full_shape, b.full_shape) << a.name;
  EXPECT_EQ(a.split_dim, b.split_dim) << a.name;
  EXPECT_EQ(a.split_start, b.split_start) << a.name;
  EXPECT_EQ(a.content_hash, b.content_hash) << a.name;
}

TEST_F(AttachManifestTest, PackedTableAndTensorEntriesGiveTheSameManifest) {
  LoadOptions options;
  options.tp_size = 2;
  options.tp_rules = {{"cols", 1}};
  options.host_resident_patterns = {"big"};
  options.devices = {"GPU-emulated-0", "GPU-emulated-1"};
  ASSERT_TRUE(client_->Load("m", "m.safetensors", options).ok());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel packed, client_->Attach("m", 1, {.packed_manifest = true}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel entries, client_->Attach("m", 1, {.packed_manifest = false}));
  const std::vector<TensorInfo>& p = packed.manifest().tensors;
  const std::vector<TensorInfo>& e = entries.manifest().tensors;
  ASSERT_EQ(p.size(), 3u);
  ASSERT_EQ(e.size(), 3u);
  for (size_t i = 0; i < p.size(); ++i) ExpectSameTensor(p[i], e[i]);
  const TensorInfo& cols = *packed.Find("cols")->info;
  EXPECT_EQ(cols.dtype, "U8");
  EXPECT_EQ(cols.shape, (std::vector<uint64_t>{2, 2}));
  EXPECT_EQ(cols.full_shape, (std::vector<uint64_t>{2, 4}));
  EXPECT_EQ(cols.split_dim, 1);
  EXPECT_EQ(cols.split_start, 2u);
  EXPECT_EQ(cols.location, Location::kDevice);
  EXPECT_EQ(cols.content_hash.size(), 16u);
  EXPECT_EQ(packed.Find("big")->info->location, Location::kHost);
  EXPECT_EQ(packed.Find("norm")->info->split_dim, -1);
  std::string bytes(4, '\0');
  WEIGHTD_ASSERT_OK(packed.CopyToHost(*packed.Find("cols"), 0, bytes.data(), 4));
  EXPECT_EQ(bytes, "cdgh");
}

// One mapping of this process, from /proc/self/smaps (kB).
struct MappingStats {
  long size = -1, rss = -1, private_dirty = -1;
};

// The mapping that contains `address`.
MappingStats StatsOf(const void* address) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false;
  MappingStats out;
  auto at = reinterpret_cast<uintptr_t>(address);
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      if (inside) break;
      inside = lo <= at && at < hi;
      continue;
    }
    if (!inside) continue;
    if (line.rfind("Size:", 0) == 0) out.size = std::stol(line.substr(5));
    if (line.rfind("Rss:", 0) == 0) out.rss = std::stol(line.substr(4));
    if (line.rfind("Private_Dirty:", 0) == 0) out.private_dirty = std::stol(line.substr(14));
  }
  return out;
}

TEST_F(AttachManifestTest, PrefaultMapsEveryPageAndLazyNone) {
  ASSERT_TRUE(client_->Load("m", "m.safetensors", {}).ok());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel lazy, client_->Attach("m", 0));
  MappingStats before = StatsOf(lazy.Find("big")->data);
  EXPECT_GE(before.size, 16);  // the segment holds the 4 pages of "big" and the others
  EXPECT_EQ(before.rss, 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel prefaulted, client_->Attach("m", 0, {.prefault = true}));
  MappingStats after = StatsOf(prefaulted.Find("big")->data);
  EXPECT_EQ(after.size, before.size);
  EXPECT_EQ(after.rss, after.size);
  EXPECT_EQ(std::string(static_cast<const char*>(prefaulted.Find("norm")->data), 8), "12345678");
}

TEST_F(AttachManifestTest, PrefaultedCopyOnWriteStillSharesEveryPage) {
  ASSERT_TRUE(client_->Load("m", "m.safetensors", {}).ok());
  // Until the daemon has pinned the segment (after READY, off the load's
  // path) no other process maps its pages, and smaps counts a dirty shmem
  // page mapped once as Private_Dirty whether or not it was copied: wait, so
  // that Private_Dirty counts copies only.
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        absl::StatusOr<std::vector<ModelSummary>> models = client_->List();
        return models.ok() && models->size() == 1 && (*models)[0].host_bytes > 0 &&
               (*models)[0].locked_bytes == (*models)[0].host_bytes;
      },
      std::chrono::seconds(10)))
      << "the daemon did not pin the segment within 10 s";
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel mine, client_->Attach("m", 0, {.copy_on_write = true, .prefault = true}));
  char* big = static_cast<char*>(const_cast<void*>(mine.Find("big")->data));
  MappingStats populated = StatsOf(big);
  EXPECT_EQ(populated.rss, populated.size);
  EXPECT_EQ(populated.private_dirty, 0);  // populated by reading: no page copied
  big[0] = 'Q';
  EXPECT_EQ(StatsOf(big).private_dirty, 4);  // the one page written
  WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel shared, client_->Attach("m", 0));
  EXPECT_EQ(static_cast<const char*>(shared.Find("big")->data)[0], 'b');
}

TEST_F(AttachManifestTest, WeightctlAttachPrefaults) {
  ASSERT_TRUE(client_->Load("m", "m.safetensors", {}).ok());
  testing::CommandResult r = d_.Ctl({"attach", "m", "--prefault", "--json"});
  ASSERT_EQ(r.code, 0) << r.err;
  nlohmann::json out = nlohmann::json::parse(r.out);
  EXPECT_EQ(out["prefaulted"], true);
  EXPECT_EQ(out["tensors"], 3);
  r = d_.Ctl({"attach", "m"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out.find("prefaulted"), std::string::npos);
  r = d_.Ctl({"attach", "m", "--prefault"});
  EXPECT_NE(r.out.find(", prefaulted (fingerprint"), std::string::npos) << r.out;
}

// ------------------------------------------------ a daemon that lies

// Answers Attach with `packed` as packed_tensors (and, when `entries`, a
// TensorEntry too); records Detach.
class LyingDaemon final : public v1::Weightd::Service {
 public:
  LyingDaemon(std::string packed, bool entries) : packed_(std::move(packed)), entries_(entries) {}
  grpc::Status Attach(grpc::ServerContext*, const v1::AttachRequest* request, v1::AttachResponse* out) override {
    asked_packed_ = request->manifest_encoding() == v1::AttachRequest::PACKED_TABLE_V1;
    out->set_lease_id("lease-1");
    out->set_fd_socket("/nonexistent/fd.sock");
    out->set_model(request->name());
    out->set_packed_tensors(packed_);
    if (entries_) out->add_tensors()->set_name("x");
    return grpc::Status::OK;
  }
  grpc::Status Detach(grpc::ServerContext*, const v1::DetachRequest* request, v1::DetachResponse*) override {
    detached_ = request->lease_id();
    return grpc::Status::OK;
  }
  std::atomic<bool> asked_packed_{false};
  std::string detached_;

 private:
  std::string packed_;
  bool entries_;
};

absl::Status AttachFrom(LyingDaemon* service, std::string* detached) {
  testing::TempDir dir;
  std::string socket = dir.Join("fake.sock");
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix://" + socket, grpc::InsecureServerCredentials());
  builder.RegisterService(service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(socket);
  if (!client.ok()) return client.status();
  absl::Status status = (*client)->Attach("m", 0).status();
  server->Shutdown();
  *detached = service->detached_;
  return status;
}

std::string ValidTable() {
  static const std::vector<uint64_t> shape = {2};
  PackedManifestWriter w;
  w.Add({"w", "U8", shape, shape, kPackedPlacementHost, 0, 0, 2, -1, 0, 1});
  return *w.Finish();
}

TEST(HostileDaemon, TruncatedPackedTableIsDataLossAndDetaches) {
  std::string table = ValidTable();
  for (size_t cut : {size_t{0} + 1, size_t{31}, size_t{40}, table.size() - 1}) {
    LyingDaemon service(table.substr(0, cut), false);
    std::string detached;
    absl::Status status = AttachFrom(&service, &detached);
    EXPECT_THAT(status, StatusIs(absl::StatusCode::kDataLoss, "packed manifest")) << cut;
    EXPECT_TRUE(service.asked_packed_);
    EXPECT_EQ(detached, "lease-1");
  }
}

TEST(HostileDaemon, PackedTableWithEntriesIsDataLoss) {
  LyingDaemon service(ValidTable(), true);
  std::string detached;
  EXPECT_THAT(AttachFrom(&service, &detached), StatusIs(absl::StatusCode::kDataLoss, "both packed_tensors"));
}

}  // namespace
}  // namespace weightd
