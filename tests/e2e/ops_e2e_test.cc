// End-to-end operations: a real weightd's /metrics as loads and attaches
// happen, `promtool check metrics` on a real scrape, a real Prometheus
// scraping it, the health service on the socket and on the TCP health port,
// server reflection, and systemd's READY=1 timing.
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <functional>
#include <regex>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/transport/unix_socket.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "tests/testing/scrape.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::DaemonProcess;
using testing::Process;
using testing::SampleValue;
using testing::TempDir;

constexpr char kPromtool[] = "/usr/bin/promtool";
constexpr char kPrometheus[] = "/usr/bin/prometheus";

// Polls `condition` every 50 ms for up to `seconds`; true once it holds.
bool Eventually(const std::function<bool()>& condition, double seconds = 10) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!condition()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

// The port of a "<what> 127.0.0.1:<port>" line in the daemon's log; 0 if none.
int LoggedPort(const std::string& log, const std::string& what) {
  std::smatch m;
  if (!std::regex_search(log, m, std::regex(what + R"( (http://)?127\.0\.0\.1:(\d+))"))) return 0;
  return std::stoi(m[2]);
}

// Two tensors of 64 and 16 bytes: 80 checkpoint bytes.
void WriteCheckpoint(const std::string& path) {
  testing::SafetensorsBuilder builder;
  builder.Add("a.weight", "F32", {4, 4}, std::string(64, 'a')).Add("b.bias", "F32", {4}, std::string(16, 'b'));
  testing::WriteFile(path, builder.Build());
}

// A daemon with /metrics and the TCP health port on free ports.
class OpsDaemon {
 public:
  OpsDaemon()
      : d_({"--metrics-address", "127.0.0.1:0", "--health-address", "127.0.0.1:0", "--device-backend", "emulated",
            "--mlock", "false"}) {
    metrics_port_ = d_.LoggedPort("metrics on http://");
    health_port_ = d_.LoggedPort("health service on ");  // starts after the Unix socket answers
    EXPECT_GT(metrics_port_, 0) << d_.process().Stderr();
    EXPECT_GT(health_port_, 0) << d_.process().Stderr();
    WriteCheckpoint(d_.models_dir() + "/m.safetensors");
  }
  DaemonProcess& d() { return d_; }
  int metrics_port() const { return metrics_port_; }
  std::string health_target() const { return absl::StrCat("127.0.0.1:", health_port_); }

  std::string Scrape() {
    absl::StatusOr<std::string> body = testing::HttpGet(metrics_port_, "/metrics");
    EXPECT_TRUE(body.ok()) << body.status();
    return body.value_or("");
  }
  std::optional<double> Value(const std::string& series) { return SampleValue(Scrape(), series); }
  void Load(const std::string& name, const std::string& path, std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"load", name, path, "--json"};
    args.insert(args.end(), extra.begin(), extra.end());
    CommandResult r = d_.Ctl(args);
    ASSERT_EQ(r.code, 0) << r.err;
  }
  json Model(const std::string& name) {
    json ls = json::parse(d_.Ctl({"ls", "--json"}).out);
    for (const json& m : ls["models"]) {
      if (m["name"] == name) return m;
    }
    return json();
  }

 private:
  DaemonProcess d_;
  int metrics_port_ = 0, health_port_ = 0;
};

// --- Metrics ---

TEST(OpsMetrics, EachMetricMovesAsLoadsAndAttachesHappen) {
  OpsDaemon o;
  std::string before = o.Scrape();
  EXPECT_EQ(SampleValue(before, absl::StrCat(R"(weightd_build_info{version=")", WEIGHTD_VERSION, R"("})")), 1);
  EXPECT_EQ(SampleValue(before, R"(weightd_models{state="READY"})"), 0);
  EXPECT_EQ(SampleValue(before, "weightd_load_bytes_total"), 0);
  EXPECT_EQ(SampleValue(before, "weightd_host_resident_bytes"), 0);

  o.Load("m", "m.safetensors");
  json m = o.Model("m");
  std::string loaded = o.Scrape();
  EXPECT_EQ(SampleValue(loaded, "weightd_load_bytes_total"), 80);
  EXPECT_EQ(SampleValue(loaded, "weightd_load_duration_seconds_count"), 1);
  EXPECT_GT(SampleValue(loaded, "weightd_load_throughput_bytes_per_second").value_or(0), 0);
  EXPECT_EQ(SampleValue(loaded, "weightd_host_resident_bytes"), m["host_bytes"].get<double>());
  EXPECT_EQ(SampleValue(loaded, "weightd_host_locked_bytes"), 0);  // --mlock false
  EXPECT_EQ(SampleValue(loaded, R"(weightd_models{state="READY"})"), 1);
  EXPECT_EQ(SampleValue(loaded, R"(weightd_leases_active{model="m"})"), 0);
  EXPECT_EQ(SampleValue(loaded, R"(weightd_rpc_requests_total{code="OK",method="weightd.v1.Weightd/LoadModel"})"), 1);
  EXPECT_EQ(SampleValue(loaded, "weightd_attach_duration_seconds_count"), 0);

  // A lease held by a real client process, then dropped by killing it.
  TempDir dir;
  Process holder(o.d().CtlArgv({"attach", "m", "--hold", "60"}), dir.path());
  EXPECT_TRUE(Eventually([&] { return o.Value(R"(weightd_leases_active{model="m"})") == 1; }));
  // Observed when the client claims its lease on the fd socket.
  EXPECT_TRUE(Eventually([&] { return o.Value("weightd_attach_duration_seconds_count") == 1; }));
  std::string attached = o.Scrape();
  EXPECT_EQ(SampleValue(attached, "weightd_attach_duration_seconds_count"), 1);
  EXPECT_EQ(SampleValue(attached, R"(weightd_rpc_requests_total{code="OK",method="weightd.v1.Weightd/Attach"})"), 1);
  holder.Signal(SIGKILL);
  holder.Wait();
  EXPECT_TRUE(Eventually([&] { return o.Value(R"(weightd_leases_active{model="m"})") == 0; }));

  // A refused checkpoint is counted by reason, and its RPC by code.
  testing::WriteFile(o.d().models_dir() + "/bad.safetensors",
                     testing::FileImage(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "1234"));
  EXPECT_EQ(o.d().Ctl({"load", "bad", "bad.safetensors"}).code, 2);
  std::string failed = o.Scrape();
  EXPECT_EQ(SampleValue(failed, R"(weightd_checkpoint_errors_total{reason="truncated"})"), 1);
  EXPECT_EQ(
      SampleValue(failed, R"(weightd_rpc_requests_total{code="INVALID_ARGUMENT",method="weightd.v1.Weightd/LoadModel"})"),
      1);

  // Device bytes by GPU (the emulated backend), then an unload.
  o.Load("dev", "m.safetensors", {"--devices", "0"});
  json dev = o.Model("dev");
  ASSERT_TRUE(dev["device_bytes_by_gpu"].contains("GPU-emulated-0")) << dev.dump();
  EXPECT_EQ(o.Value(R"(weightd_device_bytes{gpu_uuid="GPU-emulated-0"})"),
            dev["device_bytes_by_gpu"]["GPU-emulated-0"].get<double>());
  EXPECT_EQ(o.Value("weightd_load_bytes_total"), 160);
  ASSERT_EQ(o.d().Ctl({"unload", "m"}).code, 0);
  std::string unloaded = o.Scrape();
  EXPECT_EQ(SampleValue(unloaded, R"(weightd_models{state="READY"})"), 1);
  EXPECT_EQ(SampleValue(unloaded, R"(weightd_leases_active{model="m"})"), std::nullopt);
  EXPECT_EQ(SampleValue(unloaded, "weightd_host_resident_bytes"), dev["host_bytes"].get<double>());
}

// Prometheus practice: no missing series. Every reason a failed load can be
// counted under is exposed at 0 by a fresh daemon, so rate() and alerts work
// before the first error. The labels are those dashboards select on.
TEST(OpsMetrics, EveryCheckpointErrorReasonIsZeroOnAFreshDaemon) {
  OpsDaemon o;
  std::string scrape = o.Scrape();
  const char* reasons[] = {
      "file_too_short", "header_too_large", "header_past_eof", "git_lfs_pointer", "foreign_format",
      "header_not_utf8", "header_not_json", "truncated", "trailing_bytes", "overlapping_tensors",
      "hole_between_tensors", "offsets_not_from_zero", "bad_data_offsets", "unknown_dtype", "shape_overflow",
      "sub_byte_size", "size_mismatch", "negative_value", "duplicate_key", "duplicate_tensor",
      "bad_metadata", "missing_shard", "tensor_absent_from_shard", "shard_outside_checkpoint", "bad_index",
      "invalid_checkpoint", "invalid_request", "already_loading", "not_found", "permission_denied",
      "resource_exhausted", "io", "other"};
  for (const char* reason : reasons) {
    EXPECT_EQ(SampleValue(scrape, absl::StrCat(R"(weightd_checkpoint_errors_total{reason=")", reason, R"("})")), 0)
        << reason;
  }
  size_t series = 0;
  for (size_t at = 0; (at = scrape.find("\nweightd_checkpoint_errors_total{", at)) != std::string::npos; ++at) ++series;
  EXPECT_EQ(series, std::size(reasons));
}

// docs/operations.md promises one WARN line and one counted reason for every
// failed load. Before, a load refused before the catalog (a missing path, a
// path outside every --model-root, no root at all, a bad name) reached
// weightctl but left nothing in the log or the metrics.
TEST(OpsMetrics, EveryRefusedLoadIsOneLogLineAndOneCountedReason) {
  OpsDaemon o;
  EXPECT_EQ(o.d().Ctl({"load", "gone", "missing.safetensors"}).code, 2);
  EXPECT_EQ(o.d().Ctl({"load", "etc", "/etc"}).code, 2);
  EXPECT_EQ(o.d().Ctl({"load", "bad\nname\x1b[2J", "m.safetensors"}).code, 2);
  std::string scrape = o.Scrape();
  EXPECT_EQ(SampleValue(scrape, R"(weightd_checkpoint_errors_total{reason="not_found"})"), 1);
  EXPECT_EQ(SampleValue(scrape, R"(weightd_checkpoint_errors_total{reason="permission_denied"})"), 1);
  EXPECT_EQ(SampleValue(scrape, R"(weightd_checkpoint_errors_total{reason="invalid_request"})"), 1);
  EXPECT_EQ(SampleValue(scrape, R"(weightd_checkpoint_errors_total{reason="invalid_checkpoint"})"), 0);
  std::string log = o.d().process().Stderr();
  auto count = [&](const std::string& needle) {
    size_t n = 0;
    for (size_t at = log.find(needle); at != std::string::npos; at = log.find(needle, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("WARN  load of 'gone' from missing.safetensors failed: missing.safetensors: no such checkpoint "
                  "file or folder\n"),
            1u)
      << log;
  EXPECT_EQ(count("WARN  load of 'etc' from /etc failed: /etc: resolves to /etc, outside every --model-root"), 1u)
      << log;
  // The hostile name is one line, its control bytes escaped, in the log.
  EXPECT_EQ(count("WARN  load of 'bad\\x0aname\\x1b[2J' from m.safetensors failed: model name 'bad\\x0aname"), 1u)
      << log;
  EXPECT_EQ(count("\x1b"), 0u);
  EXPECT_EQ(count("WARN  load of "), 3u) << log;
}

// With no --model-root every load is refused, and each is still logged and
// counted.
TEST(OpsMetrics, ALoadWithoutAnyModelRootIsLoggedAndCounted) {
  TempDir dir;
  std::string socket = dir.Join("w.sock");
  Process daemon({testing::WeightdBinary(), "--socket", socket, "--metrics-address", "127.0.0.1:0", "--mlock", "false"},
                 dir.path());
  std::vector<std::string> ls = {testing::WeightctlBinary(), "--socket", socket, "ls"};
  ASSERT_TRUE(Eventually([&] { return testing::RunCommand(ls).code == 0; }, 20)) << daemon.Stderr();
  CommandResult load = testing::RunCommand({testing::WeightctlBinary(), "--socket", socket, "load", "m", "/tmp"});
  EXPECT_EQ(load.code, 2) << load.err;
  EXPECT_NE(load.err.find("no --model-root is configured"), std::string::npos) << load.err;
  int port = LoggedPort(daemon.Stderr(), "metrics on");
  ASSERT_GT(port, 0) << daemon.Stderr();
  absl::StatusOr<std::string> scrape = testing::HttpGet(port, "/metrics");
  ASSERT_TRUE(scrape.ok()) << scrape.status();
  EXPECT_EQ(SampleValue(*scrape, R"(weightd_checkpoint_errors_total{reason="permission_denied"})"), 1);
  EXPECT_NE(daemon.Stderr().find("WARN  load of 'm' from /tmp failed: no --model-root is configured, so no checkpoint "
                                 "may be loaded"),
            std::string::npos)
      << daemon.Stderr();
  daemon.Signal(SIGTERM);
  EXPECT_EQ(daemon.Wait(), 0);
}

TEST(OpsMetrics, RealScrapePassesPromtool) {
  if (access(kPromtool, X_OK) != 0) GTEST_SKIP() << kPromtool << " is absent: apt-get install prometheus";
  OpsDaemon o;
  o.Load("m", "m.safetensors", {"--devices", "0"});
  ASSERT_EQ(o.d().Ctl({"attach", "m"}).code, 0);
  ASSERT_NE(o.d().Ctl({"load", "gone", "missing.safetensors"}).code, 0);
  TempDir dir;
  testing::WriteFile(dir.Join("scrape.txt"), o.Scrape());
  CommandResult r = testing::RunCommand({"/bin/sh", "-c", absl::StrCat("exec ", kPromtool, " check metrics < ", dir.Join("scrape.txt"))});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(r.out + r.err, "");  // no lint complaints either
}

// A real Prometheus scraping weightd every second, queried over its HTTP API.
TEST(OpsMetrics, PrometheusScrapesWeightd) {
  if (access(kPrometheus, X_OK) != 0) {
    GTEST_SKIP() << kPrometheus << " is absent: apt-get install prometheus (scripts/install-deps.sh does in CI)";
  }
  OpsDaemon o;
  TempDir dir;
  testing::WriteFile(dir.Join("prometheus.yml"),
                     absl::StrCat("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                                  "scrape_configs:\n  - job_name: weightd\n    static_configs:\n"
                                  "      - targets: ['127.0.0.1:", o.metrics_port(), "']\n"));
  int port = testing::PickFreePort();
  Process prometheus({kPrometheus, "--config.file=" + dir.Join("prometheus.yml"),
                      "--storage.tsdb.path=" + dir.Join("data"), absl::StrCat("--web.listen-address=127.0.0.1:", port),
                      "--log.level=warn"},
                     dir.path());
  json result;
  bool scraped = Eventually(
      [&] {
        absl::StatusOr<std::string> body = testing::HttpGet(port, "/api/v1/query?query=weightd_build_info");
        if (!body.ok()) return false;
        result = json::parse(*body, nullptr, false);
        return result.is_object() && result["status"] == "success" && !result["data"]["result"].empty();
      },
      40);
  ASSERT_TRUE(scraped) << "Prometheus never returned weightd_build_info; last answer " << result.dump() << "\n"
                       << prometheus.Stderr();
  const json& sample = result["data"]["result"][0];
  EXPECT_EQ(sample["metric"]["job"], "weightd");
  EXPECT_EQ(sample["metric"]["version"], WEIGHTD_VERSION);
  EXPECT_EQ(sample["value"][1], "1");
  prometheus.Signal(SIGTERM);
  EXPECT_EQ(prometheus.Wait(), 0) << prometheus.Stderr();
}

// --- Health and reflection ---

TEST(OpsHealth, ServingPerModelOnTheSocketAndTheHealthPort) {
  OpsDaemon o;
  auto health = [&](const std::string& target, const std::string& model) {
    std::vector<std::string> argv = {testing::WeightctlBinary(), "--socket", target, "health"};
    if (!model.empty()) argv.push_back(model);
    CommandResult r = testing::RunCommand(argv);
    return std::make_pair(r.code, r.out);
  };
  std::string unix_target = o.d().socket();
  for (const std::string& target : {unix_target, o.health_target()}) {
    EXPECT_EQ(health(target, ""), std::make_pair(0, std::string("SERVING\n"))) << target;
    EXPECT_EQ(health(target, "m"), std::make_pair(1, std::string("SERVICE_UNKNOWN\n"))) << target;
  }
  o.Load("m", "m.safetensors");
  for (const std::string& target : {unix_target, o.health_target()}) {
    EXPECT_EQ(health(target, "m"), std::make_pair(0, std::string("SERVING\n"))) << target;
  }
  ASSERT_EQ(o.d().Ctl({"unload", "m"}).code, 0);
  for (const std::string& target : {unix_target, o.health_target()}) {
    EXPECT_EQ(health(target, "m"), std::make_pair(1, std::string("NOT_SERVING\n"))) << target;
  }
  // The health port serves nothing else.
  CommandResult ls = testing::RunCommand({testing::WeightctlBinary(), "--socket", o.health_target(), "ls"});
  EXPECT_NE(ls.code, 0);
  EXPECT_TRUE(absl::StrContains(ls.err, "serves grpc.health.v1.Health only")) << ls.err;
}

// Lists services through gRPC server reflection (grpc.reflection.v1alpha):
// the raw ListServiceResponse bytes, which hold each service name verbatim.
absl::StatusOr<std::string> ReflectionListServices(const std::string& target) {
  grpc::GenericStub stub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::CompletionQueue cq;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto call = stub.PrepareCall(&context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  auto wait = [&cq] {
    void* tag;
    bool ok = false;
    cq.Next(&tag, &ok);
    return ok;
  };
  grpc::Slice request_bytes(std::string("\x3a\x00", 2));  // field 7 (list_services) = ""
  grpc::ByteBuffer request(&request_bytes, 1), response;
  grpc::Status status;
  call->StartCall(nullptr);
  bool ok = wait();
  call->Write(request, nullptr);
  ok = wait() && ok;
  call->WritesDone(nullptr);
  ok = wait() && ok;
  call->Read(&response, nullptr);
  ok = wait() && ok;
  call->Finish(&status, nullptr);
  wait();
  cq.Shutdown();
  while (wait()) {
  }
  if (!status.ok()) return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
  if (!ok) return absl::InternalError("reflection stream failed");
  std::vector<grpc::Slice> slices;
  (void)response.Dump(&slices);
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

TEST(OpsReflection, ListsTheServicesOnTheSocketButNotOnTheHealthPort) {
  OpsDaemon o;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string services, ReflectionListServices("unix:" + o.d().socket()));
  EXPECT_TRUE(absl::StrContains(services, "weightd.v1.Weightd")) << services;
  EXPECT_TRUE(absl::StrContains(services, "grpc.health.v1.Health")) << services;
  EXPECT_THAT(ReflectionListServices(o.health_target()), StatusIs(absl::StatusCode::kUnimplemented, "health"));
}

// --- systemd ---

// A datagram socket standing in for systemd's notify socket.
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path), fd_(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0)) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    EXPECT_EQ(bind(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << strerror(errno);
  }
  // The next datagram, or "" after `seconds`.
  std::string Receive(int seconds) {
    timeval timeout{seconds, 0};
    setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    char buf[4096];
    ssize_t n = recv(fd_.get(), buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
  }

 private:
  std::string path_;
  ScopedFd fd_;
};

bool Accepts(int domain, int type, const sockaddr* addr, socklen_t len) {
  ScopedFd s(socket(domain, type | SOCK_CLOEXEC, 0));
  return connect(s.get(), addr, len) == 0;
}

bool UnixAccepts(const std::string& path, int type) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
  return Accepts(AF_UNIX, type, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
}

bool TcpAccepts(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return port > 0 && Accepts(AF_INET, SOCK_STREAM, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
}

TEST(OpsSystemd, ReadyArrivesOnlyOnceTheSocketsAcceptThenStatusAndWatchdog) {
  TempDir dir;
  mkdir(dir.Join("models").c_str(), 0755);
  WriteCheckpoint(dir.Join("models/m.safetensors"));
  NotifySocket notify(dir.Join("notify.sock"));
  setenv("NOTIFY_SOCKET", dir.Join("notify.sock").c_str(), 1);
  setenv("WATCHDOG_USEC", "200000", 1);
  Process weightd({testing::WeightdBinary(), "--socket", dir.Join("w.sock"), "--model-root", dir.Join("models"),
                   "--metrics-address", "127.0.0.1:0", "--health-address", "127.0.0.1:0", "--preload",
                   "m=m.safetensors"},
                  dir.path());
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");

  std::string message;
  while (!absl::StrContains(message = notify.Receive(20), "READY=1")) {
    ASSERT_NE(message, "") << "no READY=1 within 20 s; weightd said:\n" << weightd.Stderr();
  }
  // Checked the moment READY=1 arrives: everything a client or probe uses listens.
  EXPECT_TRUE(UnixAccepts(dir.Join("w.sock"), SOCK_STREAM));
  EXPECT_TRUE(UnixAccepts(dir.Join("w.fd.sock"), SOCK_SEQPACKET));
  std::string log = weightd.Stderr();
  EXPECT_TRUE(TcpAccepts(LoggedPort(log, "health service on"))) << log;
  EXPECT_TRUE(TcpAccepts(LoggedPort(log, "metrics on"))) << log;

  bool status = false, watchdog = false;
  for (int i = 0; i < 200 && !(status && watchdog); ++i) {
    message = notify.Receive(10);
    ASSERT_NE(message, "") << "weightd said:\n" << weightd.Stderr();
    status |= absl::StrContains(message, "STATUS=loaded 'm' generation 1");
    watchdog |= absl::StrContains(message, "WATCHDOG=1");
  }
  EXPECT_TRUE(status);
  EXPECT_TRUE(watchdog);
  weightd.Signal(SIGTERM);
  EXPECT_EQ(weightd.Wait(), 0) << weightd.Stderr();
}

// Regression: the watchdog thread sent WATCHDOG=1 every usec/2 whatever the
// listeners did, so systemd never restarted a daemon that served nothing.
TEST(OpsSystemd, WatchdogStopsWhileAListenerDoesNotAnswer) {
  TempDir dir;
  mkdir(dir.Join("models").c_str(), 0755);
  NotifySocket notify(dir.Join("notify.sock"));
  setenv("NOTIFY_SOCKET", dir.Join("notify.sock").c_str(), 1);
  setenv("WATCHDOG_USEC", "400000", 1);  // a self-check every 0.2 s
  Process weightd({testing::WeightdBinary(), "--socket", dir.Join("w.sock"), "--model-root", dir.Join("models"),
                   "--metrics-address", ""},
                  dir.path());
  unsetenv("NOTIFY_SOCKET");
  unsetenv("WATCHDOG_USEC");
  std::string message;
  while (!absl::StrContains(message = notify.Receive(20), "WATCHDOG=1")) {
    ASSERT_NE(message, "") << "no WATCHDOG=1 within 20 s; weightd said:\n" << weightd.Stderr();
  }
  // Wedge the fd socket: clients can no longer reach it.
  ASSERT_EQ(unlink(dir.Join("w.fd.sock").c_str()), 0);
  std::string failed = "self-check failed: fd socket " + dir.Join("w.fd.sock") + ": connect to fd socket " +
                       dir.Join("w.fd.sock") + ": No such file or directory; WATCHDOG=1 withheld";
  EXPECT_TRUE(Eventually([&] { return absl::StrContains(weightd.Stderr(), failed); }, 5)) << weightd.Stderr();
  for (int i = 0; i < 10 && !notify.Receive(1).empty(); ++i) {
  }  // what was queued before the failure was logged
  int watchdogs = 0;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);  // ten self-checks
  while (std::chrono::steady_clock::now() < until) watchdogs += absl::StrContains(notify.Receive(1), "WATCHDOG=1");
  EXPECT_EQ(watchdogs, 0) << weightd.Stderr();
  weightd.Signal(SIGTERM);
  EXPECT_EQ(weightd.Wait(), 0) << weightd.Stderr();
}

}  // namespace
}  // namespace weightd
