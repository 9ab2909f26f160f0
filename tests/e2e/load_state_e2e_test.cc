// LOADING and FAILED through the real binaries: `weightctl ls --json` shows a
// load in flight with its bytes, and a load whose file was cut short under
// it as FAILED with the error until the name is unloaded.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"

namespace weightd {
namespace {

using json = nlohmann::json;
using testing::CommandResult;
using testing::DaemonProcess;
using testing::Process;

constexpr uint64_t kTensorBytes = 1ull << 30;

// One U8 tensor of `bytes` zero bytes, written as a sparse file: instant to
// make, and still a gigabyte for the daemon to copy into its segment.
void WriteSparseCheckpoint(const std::string& path, uint64_t bytes) {
  std::string header = absl::StrCat(R"({"big":{"dtype":"U8","shape":[)", bytes, R"(],"data_offsets":[0,)", bytes,
                                    "]}}");
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0) << path;
  std::string head = prefix + header;
  ASSERT_EQ(write(fd, head.data(), head.size()), static_cast<ssize_t>(head.size()));
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(head.size() + bytes)), 0);
  close(fd);
}

json Ls(const DaemonProcess& d) {
  CommandResult r = d.Ctl({"ls", "--json"});
  EXPECT_EQ(r.code, 0) << r.err;
  return r.code == 0 ? json::parse(r.out) : json{{"models", json::array()}};
}

TEST(LoadStateE2E, LoadInFlightIsLoadingAndAFileCutShortLeavesFailedUntilUnloaded) {
  DaemonProcess d({"--load-threads", "1"});
  std::string file = d.models_dir() + "/big.safetensors";
  WriteSparseCheckpoint(file, kTensorBytes);
  Process load(d.CtlArgv({"load", "big", "big.safetensors"}), d.dir().path());
  json loading;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (loading.is_null() && load.Running() && std::chrono::steady_clock::now() < deadline) {
    json ls = Ls(d);
    for (const json& m : ls["models"]) {
      if (m["state"] == "LOADING" && m["bytes_done"].get<uint64_t>() > 0) loading = m;  // reading, past the catalog
    }
  }
  ASSERT_FALSE(loading.is_null()) << "no LOADING entry while the load ran: " << load.Stderr();
  // Cut the file short while it is read: the rest of the read fails.
  ASSERT_EQ(truncate(file.c_str(), 4096), 0);
  EXPECT_EQ(loading["name"], "big");
  EXPECT_EQ(loading["generation"], 0);
  EXPECT_EQ(loading["bytes_total"], kTensorBytes);
  EXPECT_LT(loading["bytes_done"].get<uint64_t>(), kTensorBytes);
  EXPECT_EQ(loading["host_bytes"], 0);
  EXPECT_EQ(loading["error"], "");

  EXPECT_NE(load.Wait(), 0) << "the load finished before the file was cut short";
  EXPECT_TRUE(absl::StrContains(load.Stderr(), "file ended at byte")) << load.Stderr();
  json models = Ls(d)["models"];
  ASSERT_EQ(models.size(), 1u) << models.dump();
  const json& failed = models[0];
  EXPECT_EQ(failed["name"], "big");
  EXPECT_EQ(failed["state"], "FAILED");
  EXPECT_EQ(failed["generation"], 0);
  EXPECT_EQ(failed["bytes_total"], kTensorBytes);
  std::string error = failed["error"];
  EXPECT_TRUE(absl::StartsWith(error, "OUT_OF_RANGE: big.safetensors: tensor 'big': ")) << error;
  EXPECT_TRUE(absl::StrContains(error, "file ended at byte")) << error;
  CommandResult text = d.Ctl({"ls"});
  EXPECT_TRUE(absl::StrContains(text.out, "FAILED")) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, error)) << text.out;

  CommandResult attach = d.Ctl({"attach", "big"});
  EXPECT_EQ(attach.code, 2);
  EXPECT_TRUE(absl::StrContains(attach.err, absl::StrCat("model 'big' failed to load (", error, ")"))) << attach.err;
  CommandResult unload = d.Ctl({"unload", "big"});
  EXPECT_EQ(unload.code, 0) << unload.err;
  EXPECT_TRUE(Ls(d)["models"].empty());
}

}  // namespace
}  // namespace weightd
