// End-to-end: bounded work per request. A real weightd serving a model of
// many tensors to concurrent GetManifest streams that ask for pages of
// 2^32-1 tensors: every page stays within the documented caps (docs/api.md)
// and the daemon's memory returns near its baseline afterwards.
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <cstdint>
#include <fstream>
#include <limits>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/process.h"
#include "weightd/v1/weightd.grpc.pb.h"

namespace weightd {
namespace {

using testing::DaemonProcess;

constexpr size_t kMaxPageTensors = 4096;
constexpr size_t kMaxPageBytes = 1 << 20;

// A checkpoint of `count` F32 scalars named "<prefix><i>", written without a
// JSON library: nlohmann's ordered_json inserts in linear time per key.
std::string ManyTensors(size_t count, const std::string& prefix) {
  std::string header = "{", data;
  for (size_t i = 0; i < count; ++i) {
    absl::StrAppend(&header, i ? "," : "", "\"", prefix, i, "\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[",
                    4 * i, ",", 4 * i + 4, "]}");
    data.append(4, static_cast<char>(i));
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  return testing::FileImage(header, data);
}

uint64_t RssKib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  uint64_t kib = 0;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) (void)absl::SimpleAtoi(line.substr(6, line.size() - 6 - 3), &kib);
  }
  return kib;
}

struct PageStats {
  size_t tensors = 0, pages = 0, max_page_tensors = 0, max_page_bytes = 0;
  grpc::Status status;
};

PageStats ReadManifest(v1::Weightd::Stub& stub, const std::string& name, uint32_t page_size) {
  v1::GetManifestRequest request;
  request.set_name(name);
  request.set_page_size(page_size);
  grpc::ClientContext context;
  auto reader = stub.GetManifest(&context, request);
  PageStats stats;
  v1::ManifestPage page;
  while (reader->Read(&page)) {
    stats.pages++;
    stats.tensors += page.tensors_size();
    stats.max_page_tensors = std::max<size_t>(stats.max_page_tensors, page.tensors_size());
    stats.max_page_bytes = std::max(stats.max_page_bytes, page.ByteSizeLong());
  }
  stats.status = reader->Finish();
  return stats;
}

std::unique_ptr<v1::Weightd::Stub> Connect(const DaemonProcess& d) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);  // so an over-sized page arrives and is measured, not refused
  return v1::Weightd::NewStub(grpc::CreateCustomChannel("unix:" + d.socket(), grpc::InsecureChannelCredentials(), args));
}

struct Burst {
  std::vector<PageStats> streams;
  uint64_t peak_kib = 0, after_kib = 0;  // the daemon's VmRSS during and 200 ms after
};

// `streams` concurrent GetManifest calls of `name` asking for 2^32-1 tensors a page.
Burst ManifestBurst(v1::Weightd::Stub& stub, pid_t daemon, const std::string& name, int streams) {
  Burst burst;
  burst.streams.resize(streams);
  std::atomic<bool> done{false};
  std::thread sampler([&] {
    while (!done) {
      burst.peak_kib = std::max(burst.peak_kib, RssKib(daemon));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  std::vector<std::thread> threads;
  for (int i = 0; i < streams; ++i) {
    threads.emplace_back([&, i] { burst.streams[i] = ReadManifest(stub, name, std::numeric_limits<uint32_t>::max()); });
  }
  for (auto& t : threads) t.join();
  done = true;
  sampler.join();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  burst.after_kib = RssKib(daemon);
  return burst;
}

// Issue 12 item 4: 24 concurrent calls with page_size 2^32-1 on a 200,000
// tensor model grew the daemon by 2 GB, 1.7 GB of it held afterwards. Here
// 100,000 tensors: before the fix, +1.3 GB at the peak and +1.1 GB after.
TEST(ManifestLimits, HugePageSizeIsCappedAndMemoryReturnsAfterConcurrentBursts) {
  constexpr size_t kTensors = 100'000;
  constexpr int kStreams = 24;
  DaemonProcess d({"--mlock", "false", "--device-backend", "none"});
  testing::WriteFile(d.models_dir() + "/many.safetensors",
                     ManyTensors(kTensors, "model.layers.block.attention.output_projection.weight_"));
  ASSERT_EQ(d.Ctl({"load", "many", "many.safetensors"}).code, 0);
  auto stub = Connect(d);
  PageStats warm = ReadManifest(*stub, "many", 0);  // the sync server's first threads and buffers
  ASSERT_TRUE(warm.status.ok()) << warm.status.error_message();
  EXPECT_EQ(warm.tensors, kTensors);
  EXPECT_EQ(warm.max_page_tensors, 4096u);
  uint64_t baseline = RssKib(d.pid());

  Burst first = ManifestBurst(*stub, d.pid(), "many", kStreams);
  Burst second = ManifestBurst(*stub, d.pid(), "many", kStreams);
  for (const PageStats& r : first.streams) {
    ASSERT_TRUE(r.status.ok()) << r.status.error_message();
    EXPECT_EQ(r.tensors, kTensors);
    EXPECT_EQ(r.max_page_tensors, kMaxPageTensors);
    EXPECT_LE(r.max_page_bytes, kMaxPageBytes);
    EXPECT_EQ(r.pages, (kTensors + kMaxPageTensors - 1) / kMaxPageTensors);
  }
  std::string numbers = absl::StrFormat("VmRSS baseline %d KiB; burst 1 peak %d, after %d; burst 2 peak %d, after %d",
                                        baseline, first.peak_kib, first.after_kib, second.peak_kib, second.after_kib);
  std::cout << numbers << "\n";
  for (const Burst& burst : {first, second}) {  // the second reuses what the first left, rather than adding
    EXPECT_LT(burst.peak_kib, baseline + 128 * 1024) << numbers;
    EXPECT_LT(burst.after_kib, baseline + 96 * 1024) << numbers;
  }
}

// Names as long as the format allows: a page is cut by its encoded bytes
// before it reaches the tensor count.
TEST(ManifestLimits, PagesOfLongTensorNamesStayUnderTheByteCap) {
  constexpr size_t kTensors = 60;
  DaemonProcess d({"--mlock", "false", "--device-backend", "none"});
  testing::WriteFile(d.models_dir() + "/long.safetensors", ManyTensors(kTensors, std::string(100'000, 'n')));
  ASSERT_EQ(d.Ctl({"load", "long", "long.safetensors"}).code, 0);
  auto stub = Connect(d);
  PageStats stats = ReadManifest(*stub, "long", 0);
  ASSERT_TRUE(stats.status.ok()) << stats.status.error_message();
  EXPECT_EQ(stats.tensors, kTensors);
  EXPECT_LE(stats.max_page_bytes, kMaxPageBytes);
  // 10 entries of about 100,040 encoded bytes fit in 1 MiB, 11 do not: 6 pages of 10.
  EXPECT_EQ(stats.max_page_tensors, 10u);
  EXPECT_EQ(stats.pages, 6u);
}

// A 1 MiB model name is refused by its length, not echoed back into a status
// message larger than gRPC's metadata limit (which reads RESOURCE_EXHAUSTED
// or INTERNAL on the client).
TEST(ManifestLimits, AHugeModelNameIsInvalidArgumentOnEveryMethod) {
  DaemonProcess d({"--mlock", "false", "--device-backend", "none"});
  auto stub = Connect(d);
  std::string name(1 << 20, 'x');
  std::string expected = absl::StrCat("model name must be 1 to 128 characters, got ", name.size());
  EXPECT_EQ(ReadManifest(*stub, name, 0).status.error_message(), expected);
  EXPECT_EQ(ReadManifest(*stub, name, 0).status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  {
    grpc::ClientContext context;
    v1::AttachRequest request;
    request.set_name(name);
    v1::AttachResponse response;
    grpc::Status s = stub->Attach(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(s.error_message(), expected);
  }
  {
    grpc::ClientContext context;
    v1::UnloadModelRequest request;
    request.set_name(name);
    request.set_force(true);
    v1::UnloadModelResponse response;
    grpc::Status s = stub->UnloadModel(&context, request, &response);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(s.error_message(), expected);
  }
}

}  // namespace
}  // namespace weightd
