// Generations that share segments, end to end through weightd and weightctl:
// a reload after one file of a sharded checkpoint changed reads only that
// file, shares the other's memfd, and serves the new bytes.
#include <dirent.h>
#include <stdio.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

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

std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The inodes of the daemon's open weightd memfds.
std::set<std::string> MemfdInodes(pid_t pid) {
  std::set<std::string> out;
  std::string dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(dir.c_str());
  while (dirent* e = readdir(d)) {
    std::string path = dir + "/" + e->d_name;
    char target[256] = {};
    struct stat st;
    if (readlink(path.c_str(), target, sizeof(target) - 1) > 0 && absl::StartsWith(target, "/memfd:weightd:") &&
        stat(path.c_str(), &st) == 0) {
      out.insert(std::to_string(st.st_ino));
    }
  }
  closedir(d);
  return out;
}

// Rewrites a safetensors file with every byte of its data section inverted
// (same header), through a new file renamed over it. Returns the data
// section's length: the tensor bytes a reload must read.
uint64_t InvertTensorBytes(const std::string& path) {
  std::string bytes = ReadAll(path);
  uint64_t header = 0;
  std::memcpy(&header, bytes.data(), 8);
  for (size_t i = 8 + header; i < bytes.size(); ++i) bytes[i] = static_cast<char>(~bytes[i]);
  std::ofstream(path + ".tmp", std::ios::binary) << bytes;
  EXPECT_EQ(rename((path + ".tmp").c_str(), path.c_str()), 0);
  return bytes.size() - 8 - header;
}

TEST(GenerationsE2E, ReloadAfterOneFileChangedReadsOnlyThatFile) {
  DaemonProcess d;
  std::string dir = d.models_dir() + "/tiny";
  ASSERT_EQ(testing::RunCommand({testing::WeightctlBinary(), "make-demo", dir}).code, 0);
  CommandResult load = d.Ctl({"load", "tiny", "tiny", "--json"});
  ASSERT_EQ(load.code, 0) << load.err;
  json first = json::parse(load.out);
  std::set<std::string> before = MemfdInodes(d.pid());
  ASSERT_EQ(before.size(), 2u);  // one host segment per file

  uint64_t changed = InvertTensorBytes(dir + "/model-00002-of-00002.safetensors");
  CommandResult reload = d.Ctl({"reload", "tiny", "--json"});
  ASSERT_EQ(reload.code, 0) << reload.err;
  json second = json::parse(reload.out);
  EXPECT_EQ(second["generation"], first["generation"].get<int>() + 1);
  EXPECT_EQ(second["bytes_read"], changed);
  EXPECT_EQ(second["bytes_reused"], first["bytes"].get<uint64_t>() - changed);
  EXPECT_NE(second["fingerprint"], first["fingerprint"]);

  // The first file's memfd is the same object; the second's is new, and the
  // old one went with generation 1 (no lease held it).
  std::set<std::string> after = MemfdInodes(d.pid());
  ASSERT_EQ(after.size(), 2u);
  std::vector<std::string> kept;
  std::set_intersection(before.begin(), before.end(), after.begin(), after.end(), std::back_inserter(kept));
  EXPECT_EQ(kept.size(), 1u);

  CommandResult verify = d.Ctl({"attach", "tiny", "--verify", dir});
  EXPECT_EQ(verify.code, 0) << verify.out << verify.err;

  // Text output says what was read and reused.
  uint64_t first_file = InvertTensorBytes(dir + "/model-00001-of-00002.safetensors");
  CommandResult text = d.Ctl({"reload", "tiny"});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_TRUE(absl::StrContains(text.out, absl::StrCat("(", first_file, " bytes) from storage, reused "))) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, absl::StrCat("(", changed, " bytes) of unchanged files"))) << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, "reloaded 'tiny' generation 3")) << text.out;
}

TEST(GenerationsE2E, ReloadOfAnUnknownNameIsNotFound) {
  DaemonProcess d;
  CommandResult reload = d.Ctl({"reload", "nope"});
  EXPECT_EQ(reload.code, 2);
  EXPECT_TRUE(absl::StrContains(reload.err, "no model named 'nope'")) << reload.err;
}

}  // namespace
}  // namespace weightd
