// End-to-end: WatchModel against a real weightd. The exact event sequences
// of loads, reloads, leases ending and unloads; CURRENT on subscribe and on
// reconnect; the watcher limit; a client that stops reading; the read-only
// TCP listener; the daemon's stop ending every stream; weightctl watch; and
// the publish-to-event latency.
#include <grpcpp/grpcpp.h>
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "tests/testing/status_matchers.h"
#include "weightd/client.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using testing::DaemonProcess;
using testing::Process;
using Code = absl::StatusCode;

// root/<dir>/model.safetensors: one F32 tensor filled with `fill`.
std::string Checkpoint(const DaemonProcess& d, const std::string& dir, char fill) {
  std::string path = d.models_dir() + "/" + dir;
  mkdir(path.c_str(), 0755);
  testing::WriteFile(path + "/model.safetensors",
                     testing::SafetensorsBuilder().Add("w", "F32", {4, 4}, std::string(64, fill)).Build());
  return dir;
}

std::unique_ptr<Client> Connect(const std::string& target) {
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Connect(target);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? std::move(*client) : nullptr;
}

// Reads `watch` on a thread of its own, so a missing event fails the test
// (after 10 s) instead of hanging it.
class Events {
 public:
  explicit Events(ModelWatch watch) : watch_(std::move(watch)), reader_([this] { Read(); }) {}
  ~Events() {
    watch_.Cancel();
    reader_.join();
  }
  // The first `n` events as "KIND generation" (fewer if they do not come within 10 s).
  std::vector<std::string> Take(size_t n) {
    std::vector<std::string> out;
    for (const WatchEvent& e : TakeEvents(n)) out.push_back(absl::StrCat(e.kind, " ", e.generation));
    return out;
  }
  std::vector<WatchEvent> TakeEvents(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return events_.size() >= n || !ended_.ok(); };
    mu_.AwaitWithTimeout(absl::Condition(&enough), absl::Seconds(10));
    return std::vector<WatchEvent>(events_.begin(), events_.begin() + std::min(n, events_.size()));
  }
  // Waits up to 10 s for the stream to end; its status.
  absl::Status End() {
    absl::MutexLock lock(&mu_);
    auto ended = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !ended_.ok(); };
    mu_.AwaitWithTimeout(absl::Condition(&ended), absl::Seconds(10));
    return ended_;
  }
  // When each event arrived, wall clock seconds since the Unix epoch.
  std::vector<double> arrivals() {
    absl::MutexLock lock(&mu_);
    return arrivals_;
  }

 private:
  void Read() {
    while (true) {
      absl::StatusOr<WatchEvent> e = watch_.Next();
      double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
      absl::MutexLock lock(&mu_);
      if (!e.ok()) {
        ended_ = e.status();
        return;
      }
      events_.push_back(*e);
      arrivals_.push_back(now);
    }
  }

  ModelWatch watch_;
  absl::Mutex mu_;
  std::vector<WatchEvent> events_ ABSL_GUARDED_BY(mu_);
  std::vector<double> arrivals_ ABSL_GUARDED_BY(mu_);
  absl::Status ended_ ABSL_GUARDED_BY(mu_);
  std::thread reader_;
};

// Waits until `n` watch streams are open on a daemon started with
// --max-watchers n: one more is refused then.
bool WaitForWatchers(Client& client) {
  for (int i = 0; i < 500; ++i) {
    absl::StatusOr<ModelWatch> probe = client.Watch("probe");
    if (probe.status().code() == absl::StatusCode::kResourceExhausted) return true;
    probe = absl::CancelledError();  // frees the probe's slot before the next try
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

std::unique_ptr<Events> Watch(Client& client, const std::string& name) {
  absl::StatusOr<ModelWatch> watch = client.Watch(name);
  EXPECT_TRUE(watch.ok()) << watch.status();
  return watch.ok() ? std::make_unique<Events>(std::move(*watch)) : nullptr;
}

TEST(WatchE2E, LoadReloadLeaseEndAndUnloadArriveInOrder) {
  DaemonProcess d;
  auto client = Connect(d.socket());
  auto events = Watch(*client, "m");  // before the name exists
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadResult first, client->Load("m", Checkpoint(d, "one", 'a'), {}));
  ASSERT_EQ(first.model.generation, 1u);
  std::optional<MappedModel> reader;
  {
    WEIGHTD_ASSERT_OK_AND_ASSIGN(MappedModel attached, client->Attach("m", 0));
    reader.emplace(std::move(attached));
  }
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadResult second, client->Load("m", Checkpoint(d, "two", 'b'), {}));
  ASSERT_EQ(second.model.generation, 2u);
  EXPECT_THAT(events->Take(3), ElementsAre("PUBLISHED 1", "PUBLISHED 2", "DRAINING 1"));
  reader.reset();  // the lease ends: generation 1 is freed
  EXPECT_THAT(events->Take(4), ElementsAre("PUBLISHED 1", "PUBLISHED 2", "DRAINING 1", "FREED 1"));
  WEIGHTD_ASSERT_OK(client->Unload("m", false));
  std::vector<WatchEvent> all = events->TakeEvents(6);
  ASSERT_EQ(all.size(), 6u);
  EXPECT_EQ(absl::StrCat(all[4].kind, " ", all[4].generation), "UNLOADED 2");
  EXPECT_EQ(absl::StrCat(all[5].kind, " ", all[5].generation), "FREED 2");
  for (const WatchEvent& e : all) {
    EXPECT_EQ(e.model, "m");
    EXPECT_EQ(e.version_label, "");
    EXPECT_EQ(e.fingerprint, e.generation == 1 ? first.model.fingerprint : second.model.fingerprint);
  }
  EXPECT_NE(first.model.fingerprint, second.model.fingerprint);
}

TEST(WatchE2E, SubscribersAndReconnectsStartWithCurrent) {
  DaemonProcess d;
  auto client = Connect(d.socket());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadResult loaded, client->Load("m", Checkpoint(d, "one", 'a'), {}));
  {
    auto events = Watch(*client, "m");
    std::vector<WatchEvent> current = events->TakeEvents(1);
    ASSERT_EQ(current.size(), 1u);
    EXPECT_EQ(current[0].kind, "CURRENT");
    EXPECT_EQ(current[0].generation, loaded.model.generation);
    EXPECT_EQ(current[0].fingerprint, loaded.model.fingerprint);
    EXPECT_NEAR(current[0].time, absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()), 60);
  }
  WEIGHTD_ASSERT_OK(client->Load("m", Checkpoint(d, "two", 'b'), {}));  // missed while away
  auto again = Watch(*client, "m");
  EXPECT_THAT(again->Take(1), ElementsAre("CURRENT 2"));
  // version_label travels in every listing and manifest; loads from disk have none.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::vector<ModelSummary> models, client->List());
  ASSERT_EQ(models.size(), 1u);
  EXPECT_EQ(models[0].version_label, "");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(Manifest manifest, client->GetManifest("m", 0));
  EXPECT_EQ(manifest.version_label, "");
}

TEST(WatchE2E, WatchersBeyondTheLimitAreRefusedUntilOneLeaves) {
  DaemonProcess d({"--max-watchers", "2"});
  auto client = Connect(d.socket());
  auto a = Watch(*client, "m");
  auto b = Watch(*client, "other");
  EXPECT_THAT(client->Watch("m"), StatusIs(Code::kResourceExhausted,
                                           "2 watch streams are open, as many as --max-watchers (2) allows"));
  EXPECT_THAT(client->Watch("bad/name"), StatusIs(Code::kInvalidArgument, "'bad/name' may hold only"));
  a.reset();  // cancels: its slot frees once the daemon saw the cancel
  absl::StatusOr<ModelWatch> c = client->Watch("m");
  for (int i = 0; i < 100 && !c.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    c = client->Watch("m");
  }
  WEIGHTD_EXPECT_OK(c);
}

// A client that opens a watch and never reads: the daemon keeps at most its
// queue bound and one flow-control window for it, then drops it with
// RESOURCE_EXHAUSTED; a reading watcher of the same name is unaffected.
TEST(WatchE2E, AClientThatDoesNotReadIsDroppedNotBuffered) {
  DaemonProcess d({"--watch-queue-events", "16"});
  auto client = Connect(d.socket());
  auto reading = Watch(*client, "m");
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);                  // a fixed, small window:
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);  // the daemon can send little unread
  auto channel = grpc::CreateCustomChannel("unix://" + d.socket(), grpc::InsecureChannelCredentials(), args);
  auto stub = v1::Weightd::NewStub(channel);
  grpc::ClientContext context;
  v1::WatchModelRequest request;
  request.set_name("m");
  std::unique_ptr<grpc::ClientReader<v1::ModelEvent>> stuck = stub->WatchModel(&context, request);
  stuck->WaitForInitialMetadata();
  constexpr int kCycles = 200;  // 3 events each (PUBLISHED, UNLOADED, FREED): 600 in all
  std::string dir = Checkpoint(d, "one", 'a');
  for (int i = 0; i < kCycles; ++i) {
    ASSERT_TRUE(client->Load("m", dir, {}).ok());
    ASSERT_TRUE(client->Unload("m", false).ok());
  }
  EXPECT_EQ(reading->Take(3 * kCycles).size(), 3u * kCycles);
  int received = 0;
  v1::ModelEvent e;
  while (stuck->Read(&e)) ++received;
  grpc::Status status = stuck->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_EQ(status.error_message(),
            "this watch of 'm' fell 16 events behind and was dropped; watch again to get the CURRENT generation");
  EXPECT_LT(received, 3 * kCycles);
  std::cerr << "a watcher that did not read got " << received << " of " << 3 * kCycles
            << " events before it was dropped\n";
}

// A client whose unread events fill the flow-control window leaves a write
// in flight that never completes; the daemon's stop cancels the stream
// rather than leave it to the servers' 10 s grace. Observed from the client:
// a second after SIGTERM, before it reads anything, its call is already
// cancelled (had the daemon waited, reading now would let the write complete
// and the stream end with UNAVAILABLE instead).
TEST(WatchE2E, DaemonStopCancelsAStreamStuckBehindAClientThatDoesNotRead) {
  DaemonProcess d;
  auto client = Connect(d.socket());
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_HTTP2_BDP_PROBE, 0);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 1024);
  auto channel = grpc::CreateCustomChannel("unix://" + d.socket(), grpc::InsecureChannelCredentials(), args);
  auto stub = v1::Weightd::NewStub(channel);
  grpc::ClientContext context;
  v1::WatchModelRequest request;
  request.set_name("m");
  std::unique_ptr<grpc::ClientReader<v1::ModelEvent>> stuck = stub->WatchModel(&context, request);
  stuck->WaitForInitialMetadata();
  std::string dir = Checkpoint(d, "one", 'a');
  for (int i = 0; i < 40; ++i) {  // 120 events, far more than 1 KiB of window
    ASSERT_TRUE(client->Load("m", dir, {}).ok());
    ASSERT_TRUE(client->Unload("m", false).ok());
  }
  d.process().Signal(SIGTERM);
  absl::SleepFor(absl::Seconds(1));
  v1::ModelEvent e;
  while (stuck->Read(&e)) {
  }
  grpc::Status status = stuck->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
  stuck.reset();  // the daemon's Shutdown also waits for open connections to close
  stub.reset();
  channel.reset();
  client.reset();
  EXPECT_EQ(d.process().Wait(), 0);
}

TEST(WatchE2E, ReadOnlyTcpListenerServesWatch) {
  DaemonProcess d({"--grpc-address", "127.0.0.1:0"});
  int port = d.TcpListenerPort();
  ASSERT_GT(port, 0) << d.process().Stderr();
  auto tcp = Connect(absl::StrCat("127.0.0.1:", port));
  auto events = Watch(*tcp, "m");
  auto unix_client = Connect(d.socket());
  WEIGHTD_ASSERT_OK(unix_client->Load("m", Checkpoint(d, "one", 'a'), {}));
  EXPECT_THAT(events->Take(1), ElementsAre("PUBLISHED 1"));
}

TEST(WatchE2E, DaemonStopEndsEveryStreamPromptly) {
  DaemonProcess d;
  auto client = Connect(d.socket());
  WEIGHTD_ASSERT_OK(client->Load("m", Checkpoint(d, "one", 'a'), {}));
  auto events = Watch(*client, "m");
  auto other = Watch(*client, "not-loaded");
  EXPECT_THAT(events->Take(1), ElementsAre("CURRENT 1"));
  auto start = std::chrono::steady_clock::now();
  d.process().Signal(SIGTERM);
  EXPECT_THAT(events->End(), StatusIs(Code::kUnavailable, "weightd is stopping"));
  EXPECT_THAT(other->End(), StatusIs(Code::kUnavailable, "weightd is stopping"));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(seconds, 2) << "the streams ended with the servers' grace, not at once";
  events.reset();  // the daemon's Shutdown also waits for open connections to close
  other.reset();
  client.reset();
  EXPECT_EQ(d.process().Wait(), 0);
}

TEST(WatchE2E, WeightctlWatchPrintsOneLinePerEventAndExitsZeroOnSigterm) {
  DaemonProcess d({"--max-watchers", "2"});
  Process watch(d.CtlArgv({"watch", "m"}), d.dir().path());
  Process json_watch(d.CtlArgv({"watch", "m", "--json"}), d.dir().path());
  auto client = Connect(d.socket());
  ASSERT_TRUE(WaitForWatchers(*client));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(LoadResult loaded, client->Load("m", Checkpoint(d, "one", 'a'), {}));
  WEIGHTD_ASSERT_OK(client->Unload("m", false));
  auto lines = [](const std::string& out) {
    return std::vector<std::string>(absl::StrSplit(out, '\n', absl::SkipEmpty()));
  };
  for (int i = 0; i < 500 && (lines(watch.Stdout()).size() < 3 || lines(json_watch.Stdout()).size() < 3); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  watch.Signal(SIGTERM);
  json_watch.Signal(SIGINT);
  EXPECT_EQ(watch.Wait(), 0) << watch.Stderr();
  EXPECT_EQ(json_watch.Wait(), 0) << json_watch.Stderr();
  std::vector<std::string> text = lines(watch.Stdout());
  ASSERT_EQ(text.size(), 3u) << watch.Stdout();
  const std::string tail = " m generation 1 version_label - fingerprint " + loaded.model.fingerprint;
  EXPECT_THAT(text[0], ::testing::EndsWith("Z PUBLISHED" + tail));
  EXPECT_THAT(text[1], ::testing::EndsWith("Z UNLOADED " + tail));
  EXPECT_THAT(text[2], ::testing::EndsWith("Z FREED    " + tail));
  EXPECT_THAT(text[0], ::testing::MatchesRegex("[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9:.]{15}Z .*"));
  std::vector<std::string> json = lines(json_watch.Stdout());
  ASSERT_EQ(json.size(), 3u);
  EXPECT_THAT(json[0], ::testing::HasSubstr("\"kind\":\"PUBLISHED\""));
  EXPECT_THAT(json[0], ::testing::HasSubstr("\"generation\":1"));
  EXPECT_THAT(json[0], ::testing::HasSubstr("\"fingerprint\":\"" + loaded.model.fingerprint + "\""));
  EXPECT_THAT(json[2], ::testing::HasSubstr("\"kind\":\"FREED\""));
}

TEST(WatchE2E, WeightctlWatchExitsNonZeroWhenTheDaemonGoesAway) {
  auto d = std::make_unique<DaemonProcess>(std::vector<std::string>{"--max-watchers", "1"});
  Process watch(d->CtlArgv({"watch", "m"}), d->dir().path());
  ASSERT_TRUE(WaitForWatchers(*Connect(d->socket())));
  EXPECT_EQ(d->Stop(), 0);
  EXPECT_EQ(watch.Wait(), 1);
  EXPECT_EQ(watch.Stderr(), "weightctl: weightd is stopping\n");
  Process refused(d->CtlArgv({"watch", "bad/name"}), d->dir().path());
  EXPECT_EQ(refused.Wait(), 1);  // no daemon any more: UNAVAILABLE
}

// Publish-to-event latency: the daemon stamps each event when it publishes
// it; a watcher on the same host notes when it arrived.
TEST(WatchE2E, PublishToEventLatency) {
  DaemonProcess d;
  auto client = Connect(d.socket());
  auto events = Watch(*client, "m");
  constexpr int kReloads = 30;
  std::string one = Checkpoint(d, "one", 'a'), two = Checkpoint(d, "two", 'b');
  for (int i = 0; i < kReloads; ++i) ASSERT_TRUE(client->Load("m", i % 2 ? two : one, {}).ok());
  std::vector<WatchEvent> all = events->TakeEvents(2 * kReloads - 1);  // PUBLISHED each, FREED all but the last
  std::vector<double> arrivals = events->arrivals();
  std::vector<double> latency_ms;
  for (size_t i = 0; i < all.size(); ++i) {
    if (all[i].kind == "PUBLISHED") latency_ms.push_back((arrivals[i] - all[i].time) * 1e3);
  }
  ASSERT_EQ(latency_ms.size(), static_cast<size_t>(kReloads));
  std::sort(latency_ms.begin(), latency_ms.end());
  double p50 = latency_ms[latency_ms.size() / 2], max = latency_ms.back();
  std::cerr << "publish-to-event latency over " << kReloads << " reloads: p50 " << p50 << " ms, max " << max
            << " ms\n";
  EXPECT_LT(p50, 1000);  // a gross bound only: tests/bench measures it
}

}  // namespace
}  // namespace weightd
