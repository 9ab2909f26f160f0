// Metrics: error reasons for every ../shared case, the registry sample, the
// Prometheus exposition, the registry events and the RPC interceptor, all
// in-process (tests/e2e/ops_e2e_test.cc scrapes a real daemon).
#include "server/metrics/metrics.h"
#include "server/ops/prometheus_metrics.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "common/format/catalog.h"
#include "common/format/format_error.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/ops/metrics_listener.h"
#include "server/registry/registry.h"
#include "server/listen/rpc_metrics.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/fake_metrics.h"
#include "tests/testing/process.h"
#include "tests/testing/scrape.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;
using ::weightd::testing::FakeMetrics;
using ::weightd::testing::FileImage;
using ::weightd::testing::SafetensorsBuilder;
using ::weightd::testing::SampleValue;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;

// --- CheckpointErrorReason ---

// The reason of every refused case in ../shared/cases/cases.json. A new case
// fails the test until it is given a reason here.
const std::map<std::string, std::string>& ExpectedReasons() {
  static const auto* reasons = new std::map<std::string, std::string>{
      {"empty_file", "file_too_short"},
      {"seven_bytes", "file_too_short"},
      {"header_len_past_eof", "header_past_eof"},
      {"header_too_large", "header_too_large"},
      {"git_lfs_pointer", "git_lfs_pointer"},
      {"pytorch_zip", "foreign_format"},
      {"not_json", "header_not_json"},
      {"not_utf8", "header_not_utf8"},
      {"nul_padded_header", "header_not_json"},
      {"truncated_data", "truncated"},
      {"trailing_bytes", "trailing_bytes"},
      {"overlapping_offsets", "overlapping_tensors"},
      {"hole_between_tensors", "hole_between_tensors"},
      {"offsets_not_from_zero", "offsets_not_from_zero"},
      {"size_mismatch", "size_mismatch"},
      {"end_before_begin", "bad_data_offsets"},
      {"unknown_dtype", "unknown_dtype"},
      {"duplicate_key", "duplicate_key"},
      {"metadata_not_string", "bad_metadata"},
      {"shape_overflow", "shape_overflow"},
      {"negative_dim", "negative_value"},
      {"f4_odd_elements", "sub_byte_size"},
      {"sharded_missing_shard_file", "missing_shard"},
      {"sharded_tensor_absent_from_shard", "tensor_absent_from_shard"},
  };
  return *reasons;
}

TEST(CheckpointErrorReason, NamesTheRuleOfEverySharedErrorCase) {
  WEIGHTD_REQUIRE_SHARED(shared);
  std::ifstream f(shared + "/cases/cases.json");
  nlohmann::json cases = nlohmann::json::parse(f);
  std::set<std::string> seen;
  for (const auto& c : cases) {
    if (c["expect"] != "error") continue;
    std::string name = c["name"];
    seen.insert(name);
    absl::StatusOr<Catalog> catalog = BuildCatalog(shared + "/cases/" + c["path"].get<std::string>());
    ASSERT_FALSE(catalog.ok()) << name;
    auto expected = ExpectedReasons().find(name);
    ASSERT_NE(expected, ExpectedReasons().end()) << "give the new case '" << name << "' a reason: "
                                                 << catalog.status() << " -> " << CheckpointErrorReason(catalog.status());
    EXPECT_EQ(CheckpointErrorReason(catalog.status()), expected->second) << name << ": " << catalog.status();
  }
  EXPECT_EQ(seen.size(), ExpectedReasons().size());
}

TEST(CheckpointErrorReason, NamesRulesOfFilesBuiltHere) {
  TempDir dir;
  struct Case {
    std::string image, reason;
  };
  std::string good_header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::vector<Case> cases = {
      {"1234567", "file_too_short"},
      {FileImage(good_header, std::string(4, 'x')), "truncated"},
      {FileImage(good_header, std::string(12, 'x')), "trailing_bytes"},
      {FileImage(R"({"a":{"dtype":"F12","shape":[2],"data_offsets":[0,8]}})", std::string(8, 'x')), "unknown_dtype"},
      {"version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 1\n", "git_lfs_pointer"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    std::string path = dir.Join("case" + std::to_string(i) + ".safetensors");
    WriteFile(path, cases[i].image);
    absl::StatusOr<Catalog> catalog = BuildCatalog(path);
    ASSERT_FALSE(catalog.ok()) << cases[i].reason;
    EXPECT_EQ(CheckpointErrorReason(catalog.status()), cases[i].reason) << catalog.status();
  }
}

TEST(CheckpointErrorReason, FallsBackToTheStatusCode) {
  EXPECT_EQ(CheckpointErrorReason(absl::NotFoundError("/m: no such file or folder")), "not_found");
  EXPECT_EQ(CheckpointErrorReason(absl::PermissionDeniedError("/m: outside every --model-root")), "permission_denied");
  EXPECT_EQ(CheckpointErrorReason(absl::ResourceExhaustedError("mmap: Cannot allocate memory")), "resource_exhausted");
  EXPECT_EQ(CheckpointErrorReason(absl::InternalError("read /m/a.safetensors at byte 8: Input/output error")), "io");
  EXPECT_EQ(CheckpointErrorReason(absl::InvalidArgumentError("tensor 'a': missing field 'dtype'")),
            "invalid_checkpoint");
  EXPECT_EQ(CheckpointErrorReason(absl::CancelledError("stop")), "other");
}

// Regression: the reason was found by phrases of the message, so rewording a
// message relabelled its metric.
TEST(CheckpointErrorReason, FollowsTheRuleWhateverTheMessageSays) {
  EXPECT_EQ(CheckpointErrorReason(CheckpointError(CheckpointRule::kTruncated, "the data ran out early")), "truncated");
  EXPECT_EQ(CheckpointErrorReason(CheckpointError(CheckpointRule::kGitLfsPointer, "tensor 'x' appears twice")),
            "git_lfs_pointer");
  // The old phrases alone no longer name a rule.
  EXPECT_EQ(CheckpointErrorReason(absl::InvalidArgumentError("truncated: tensor 'b' ends at data byte 32")),
            "invalid_checkpoint");
  // A rule on a status of another code wins over the code.
  EXPECT_EQ(CheckpointErrorReason(WithCheckpointRule(absl::PermissionDeniedError("x"), CheckpointRule::kBadIndex)),
            "bad_index");
}

TEST(CheckpointErrorReason, ListsEveryReasonOnce) {
  std::vector<std::string> reasons = CheckpointErrorReasons();
  EXPECT_EQ(reasons.size(), 33u);
  EXPECT_EQ(std::set<std::string>(reasons.begin(), reasons.end()).size(), reasons.size());
  for (const auto& [name, reason] : ExpectedReasons()) {
    EXPECT_NE(std::find(reasons.begin(), reasons.end(), reason), reasons.end()) << reason;
  }
  for (const char* reason : {"invalid_checkpoint", "invalid_request", "already_loading", "not_found", "permission_denied",
                             "resource_exhausted", "io", "other"}) {
    EXPECT_NE(std::find(reasons.begin(), reasons.end(), reason), reasons.end()) << reason;
  }
}

// --- SampleModels ---

std::shared_ptr<ModelGeneration> Generation(const std::string& name, ModelState state, int leases,
                                            std::vector<std::pair<std::string, uint64_t>> device_segments = {}) {
  auto m = std::make_shared<ModelGeneration>();
  m->request.name = name;
  m->state = state;
  m->leases = leases;
  m->segments.push_back({Placement::kHost, 4096, SegmentBackend::kMemfd, "", -1, ""});
  for (const auto& [uuid, size] : device_segments) m->segments.push_back({Placement::kDevice, size, SegmentBackend::kEmulated, uuid, -1, ""});
  return m;
}

TEST(SampleModels, CountsStatesLeasesAndDeviceBytes) {
  ModelsSample s = SampleModels({Generation("llama", ModelState::kReady, 2, {{"GPU-a", 100}, {"GPU-b", 50}}),
                                 Generation("llama", ModelState::kDraining, 1, {{"GPU-a", 30}}),
                                 Generation("engram", ModelState::kReady, 0)});
  EXPECT_THAT(s.by_state, ElementsAre(Pair("DRAINING", 1), Pair("FAILED", 0), Pair("LOADING", 0), Pair("READY", 2)));
  EXPECT_THAT(s.leases, ElementsAre(Pair("engram", 0), Pair("llama", 3)));
  EXPECT_THAT(s.device_bytes, ElementsAre(Pair("GPU-a", 130), Pair("GPU-b", 50)));
}

TEST(SampleModels, ReportsEveryStateWhenEmpty) {
  ModelsSample s = SampleModels({});
  EXPECT_THAT(s.by_state, ElementsAre(Pair("DRAINING", 0), Pair("FAILED", 0), Pair("LOADING", 0), Pair("READY", 0)));
  EXPECT_TRUE(s.leases.empty());
  EXPECT_TRUE(s.device_bytes.empty());
}

// --- PrometheusMetrics ---

std::unique_ptr<PrometheusMetrics> Prometheus(ModelsSampler sampler = nullptr) {
  absl::StatusOr<std::unique_ptr<PrometheusMetrics>> m = PrometheusMetrics::Create({"", "1.2.3", std::move(sampler)});
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? std::move(*m) : nullptr;
}

// Huge-page bytes are the READY generation's, per model; a draining one
// (the model's previous generation) does not add to them.
TEST(SampleModels, HugePageBytesOfEachReadyModel) {
  auto ready = Generation("llama", ModelState::kReady, 0);
  ready->huge_page_bytes = 6 << 20;
  auto draining = Generation("llama", ModelState::kDraining, 1);
  draining->huge_page_bytes = 4 << 20;
  auto small = Generation("engram", ModelState::kReady, 0);
  ModelsSample s = SampleModels({ready, draining, small});
  EXPECT_THAT(s.huge_page_bytes, ElementsAre(Pair("engram", 0), Pair("llama", 6 << 20)));
  auto metrics = Prometheus([s] { return s; });
  std::string text = metrics->Exposition();
  EXPECT_EQ(SampleValue(text, R"(weightd_host_huge_page_bytes{model="llama"})"), 6 << 20);
  EXPECT_EQ(SampleValue(text, R"(weightd_host_huge_page_bytes{model="engram"})"), 0);
}

TEST(PrometheusMetrics, ExposesEveryEventWithItsValue) {
  auto metrics = Prometheus([] { return SampleModels({Generation("llama", ModelState::kReady, 2, {{"GPU-a", 64}})}); });
  metrics->LoadFinished(3000, 2.0);
  metrics->LoadFinished(1000, 0.5);
  metrics->LoadFailed(CheckpointError(CheckpointRule::kTruncated, "/m/x.safetensors: truncated: tensor 'b' ends at data byte 32"));
  metrics->HostMemory(8192, 4096);
  metrics->AttachFinished(0.003);
  metrics->RpcFinished("weightd.v1.Weightd/Attach", "OK", 0.003);
  metrics->RpcFinished("weightd.v1.Weightd/Attach", "OK", 0.004);
  metrics->RpcFinished("weightd.v1.Weightd/LoadModel", "NOT_FOUND", 0.001);
  std::string text = metrics->Exposition();
  EXPECT_EQ(metrics->port(), 0);
  EXPECT_EQ(SampleValue(text, "weightd_load_bytes_total"), 4000);
  EXPECT_EQ(SampleValue(text, "weightd_load_duration_seconds_count"), 2);
  EXPECT_EQ(SampleValue(text, "weightd_load_duration_seconds_sum"), 2.5);
  EXPECT_EQ(SampleValue(text, R"(weightd_load_duration_seconds_bucket{le="1"})"), 1);
  EXPECT_EQ(SampleValue(text, "weightd_load_throughput_bytes_per_second"), 2000);  // the last load
  EXPECT_EQ(SampleValue(text, R"(weightd_checkpoint_errors_total{reason="truncated"})"), 1);
  EXPECT_EQ(SampleValue(text, "weightd_host_resident_bytes"), 8192);
  EXPECT_EQ(SampleValue(text, "weightd_host_locked_bytes"), 4096);
  EXPECT_EQ(SampleValue(text, "weightd_attach_duration_seconds_count"), 1);
  EXPECT_EQ(SampleValue(text, R"(weightd_attach_duration_seconds_bucket{le="0.005"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(weightd_attach_duration_seconds_bucket{le="0.0025"})"), 0);
  EXPECT_EQ(SampleValue(text, R"(weightd_rpc_requests_total{code="OK",method="weightd.v1.Weightd/Attach"})"), 2);
  EXPECT_EQ(SampleValue(text, R"(weightd_rpc_requests_total{code="NOT_FOUND",method="weightd.v1.Weightd/LoadModel"})"),
            1);
  EXPECT_EQ(SampleValue(text, R"(weightd_rpc_duration_seconds_count{method="weightd.v1.Weightd/Attach"})"), 2);
  EXPECT_EQ(SampleValue(text, R"(weightd_models{state="READY"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(weightd_models{state="DRAINING"})"), 0);
  EXPECT_EQ(SampleValue(text, R"(weightd_leases_active{model="llama"})"), 2);
  EXPECT_EQ(SampleValue(text, R"(weightd_device_bytes{gpu_uuid="GPU-a"})"), 64);
  EXPECT_EQ(SampleValue(text, R"(weightd_build_info{version="1.2.3"})"), 1);
}

// Prometheus practice: no missing series. A rate() or an alert on a reason
// works before its first error.
TEST(PrometheusMetrics, ExposesEveryCheckpointErrorReasonAtZeroBeforeAnyError) {
  std::string text = Prometheus()->Exposition();
  for (const std::string& reason : CheckpointErrorReasons()) {
    EXPECT_EQ(SampleValue(text, R"(weightd_checkpoint_errors_total{reason=")" + reason + R"("})"), 0) << reason;
  }
}

TEST(PrometheusMetrics, ServesTheExpositionOverHttp) {
  absl::StatusOr<std::unique_ptr<PrometheusMetrics>> metrics = PrometheusMetrics::Create({"127.0.0.1:0", "1.2.3", {}});
  WEIGHTD_ASSERT_OK(metrics);
  ASSERT_GT((*metrics)->port(), 0);
  (*metrics)->LoadFinished(77, 1);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string body, testing::HttpGet((*metrics)->port(), "/metrics"));
  EXPECT_EQ(SampleValue(body, "weightd_load_bytes_total"), 77);
  EXPECT_EQ(SampleValue(body, R"(weightd_models{state="READY"})"), 0);
}

TEST(PrometheusMetrics, RefusesAnAddressInUseOrMalformed) {
  absl::StatusOr<std::unique_ptr<PrometheusMetrics>> first = PrometheusMetrics::Create({"127.0.0.1:0", "1", {}});
  WEIGHTD_ASSERT_OK(first);
  std::string taken = "127.0.0.1:" + std::to_string((*first)->port());
  EXPECT_THAT(PrometheusMetrics::Create({taken, "1", {}}), StatusIs(absl::StatusCode::kUnavailable, taken));
  EXPECT_THAT(PrometheusMetrics::Create({"9400", "1", {}}),
              StatusIs(absl::StatusCode::kInvalidArgument, "--metrics-address must be HOST:PORT"));
}

TEST(PrometheusMetrics, ExpositionPassesPromtool) {
  if (access("/usr/bin/promtool", X_OK) != 0) GTEST_SKIP() << "promtool is absent: apt-get install prometheus";
  auto metrics = Prometheus([] { return SampleModels({Generation("llama", ModelState::kReady, 1, {{"GPU-a", 64}})}); });
  metrics->LoadFinished(1000, 0.5);
  metrics->LoadFailed(absl::NotFoundError("gone"));
  metrics->HostMemory(1, 1);
  metrics->AttachFinished(0.001);
  metrics->RpcFinished("weightd.v1.Weightd/Attach", "OK", 0.001);
  TempDir dir;
  WriteFile(dir.Join("metrics.txt"), metrics->Exposition());
  testing::CommandResult r =
      testing::RunCommand({"/bin/sh", "-c", "exec /usr/bin/promtool check metrics < " + dir.Join("metrics.txt")});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(r.out + r.err, "");
}

// --- MetricsListener, fed by a real registry ---

TEST(MetricsListener, ReportsLoadsFailuresAndMemoryFromTheRegistry) {
  TempDir root;
  SafetensorsBuilder builder;
  builder.Add("a", "F32", {2, 2}, std::string(16, 'a')).Add("b", "U8", {8}, std::string(8, 'b'));
  WriteFile(root.Join("good.safetensors"), builder.Build());
  WriteFile(root.Join("bad.safetensors"),
            FileImage(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, 'x')));
  FakeMetrics metrics;
  MetricsListener listener(&metrics);
  RegistryOptions options;
  options.model_roots = {root.path()};
  options.loader.mlock = false;
  ModelRegistry registry(options, &listener);
  LoadRequest good;
  good.name = "good";
  good.checkpoint_path = "good.safetensors";
  WEIGHTD_ASSERT_OK(registry.Load(good, nullptr));
  LoadRequest bad;
  bad.name = "bad";
  bad.checkpoint_path = "bad.safetensors";
  EXPECT_FALSE(registry.Load(bad, nullptr).ok());
  WEIGHTD_ASSERT_OK(registry.Unload("good", false));
  EXPECT_THAT(metrics.loads, ElementsAre(24));
  EXPECT_THAT(metrics.failures, ElementsAre("truncated"));
  ASSERT_EQ(metrics.memory.size(), 2u);
  EXPECT_GE(metrics.memory[0].first, 24u);
  EXPECT_EQ(metrics.memory[0].second, 0u);  // mlock off
  EXPECT_EQ(metrics.memory[1], std::make_pair(uint64_t{0}, uint64_t{0}));
}

// --- The RPC interceptor ---

TEST(RpcMethodLabel, KeepsKnownMethodsOnly) {
  EXPECT_EQ(RpcMethodLabel("/weightd.v1.Weightd/Attach"), "weightd.v1.Weightd/Attach");
  EXPECT_EQ(RpcMethodLabel("/grpc.health.v1.Health/Check"), "grpc.health.v1.Health/Check");
  EXPECT_EQ(RpcMethodLabel("/weightd.v1.Weightd/Nope"), "unknown");
  EXPECT_EQ(RpcMethodLabel("/no.such.Service/Attach"), "unknown");
  EXPECT_EQ(RpcMethodLabel("/weightd.v1/Weightd.Attach"), "unknown");
  EXPECT_EQ(RpcMethodLabel("weightd.v1.Weightd/Attach"), "unknown");
  EXPECT_EQ(RpcMethodLabel("/"), "unknown");
  EXPECT_EQ(RpcMethodLabel(""), "unknown");
  EXPECT_EQ(RpcMethodLabel(nullptr), "unknown");
}

TEST(CountRpcs, CountsEveryCallByMethodAndCode) {
  TempDir dir;
  FakeMetrics metrics;
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.AddListeningPort("unix:" + dir.Join("s.sock"), grpc::InsecureServerCredentials());
  CountRpcs(builder, &metrics);
  grpc::CallbackGenericService unimplemented;
  builder.RegisterCallbackGenericService(&unimplemented);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel("unix:" + dir.Join("s.sock"), grpc::InsecureChannelCredentials()));
  for (const char* service : {"", "nope"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    (void)stub->Check(&context, request, &response);
  }
  server->Shutdown();
  EXPECT_THAT(metrics.rpcs, ElementsAre(Pair("grpc.health.v1.Health/Check", "OK"),
                                        Pair("grpc.health.v1.Health/Check", "NOT_FOUND")));
  EXPECT_EQ(metrics.attaches, 0);
}

}  // namespace
}  // namespace weightd
