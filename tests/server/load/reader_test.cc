// CheckpointReader and the O_DIRECT head/tail logic: against a fake file
// that refuses unaligned reads exactly as O_DIRECT does (so every case runs
// on any file system), and against real O_DIRECT files on a disk path
// (skipped where the file system refuses O_DIRECT).
#include "server/load/reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/base/status.h"
#include "gtest/gtest.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/fake_env.h"
#include "tests/testing/fault_env.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::Bytes;
using ::weightd::testing::FakeEnv;
using ::weightd::testing::FakeFile;
using ::weightd::testing::FaultInjectingEnv;
using ::weightd::testing::Faults;

using ::weightd::testing::WriteFile;
using ::weightd::testing::Xxh3Hex;

// A catalog holding each file of `env` open, as BuildCatalog leaves it.
Catalog CatalogOf(FakeEnv& env) {
  Catalog catalog;
  for (const auto& [path, data] : env.files) {
    catalog.files.push_back({path, path, data.size(), 0, 0, {}, 0, {}, std::move(env.OpenForRead(path)).value()});
  }
  return catalog;
}

// Offsets and lengths around the block edges of a 512-aligned file of
// 4 * 512 + 100 bytes (its size is not a block multiple).
struct Range {
  uint64_t offset, n;
};
std::vector<Range> EdgeRanges(uint64_t size) {
  std::vector<Range> ranges;
  for (uint64_t offset : {0, 1, 7, 511, 512, 513, 1000, 1024, 2047, 2048}) {
    for (uint64_t n : {1, 2, 100, 511, 512, 513, 1024, 1500}) {
      if (offset + n <= size) ranges.push_back({offset, n});
    }
    ranges.push_back({offset, size - offset});  // through the unaligned end
  }
  ranges.push_back({size - 1, 1});
  return ranges;
}

TEST(ReadDirect, EveryUnalignedRangeEqualsTheFileBytes) {
  const std::string data = Bytes(4 * 512 + 100, 1);
  FakeFile file("f", data, 512);
  ReadBuffer scratch;
  // Destinations both congruent with the offset (aligned middle read in
  // place) and not (everything bounced).
  ReadBuffer dst_memory;
  char* base = dst_memory.Get(8192, 4096);
  for (const Range& r : EdgeRanges(data.size())) {
    for (uint64_t shift : {r.offset % 512, (r.offset + 3) % 512}) {
      char* dst = base + shift;
      std::memset(dst, 0x5a, r.n);
      WEIGHTD_ASSERT_OK(ReadDirect(file, r.offset, r.n, dst, scratch));
      ASSERT_EQ(std::string(dst, r.n), data.substr(r.offset, r.n)) << "offset " << r.offset << " n " << r.n << " shift " << shift;
    }
    WEIGHTD_ASSERT_OK_AND_ASSIGN(const char* got, ReadDirectInto(file, r.offset, r.n, scratch));
    ASSERT_EQ(std::string(got, r.n), data.substr(r.offset, r.n)) << "offset " << r.offset << " n " << r.n;
  }
}

TEST(ReadDirect, CongruentDestinationReadsTheAlignedMiddleInPlace) {
  const std::string data = Bytes(8 * 512, 2);
  FakeFile file("f", data, 512);
  ReadBuffer scratch, dst_memory;
  char* dst = dst_memory.Get(8 * 512, 4096) + 100;
  // Head [100, 512), middle [512, 3584) straight into dst, tail [3584, 3600).
  WEIGHTD_ASSERT_OK(ReadDirect(file, 100, 3500, dst, scratch));
  EXPECT_EQ(std::string(dst, 3500), data.substr(100, 3500));
  EXPECT_EQ(file.reads(), 3);
  EXPECT_LE(scratch.capacity(), 4096u);  // only a block for the head and the tail
}

TEST(ReadDirect, AlignedRangeIntoAlignedMemoryIsOneRead) {
  const std::string data = Bytes(4 * 512, 3);
  FakeFile file("f", data, 512);
  ReadBuffer scratch, dst_memory;
  char* dst = dst_memory.Get(4096, 4096);
  WEIGHTD_ASSERT_OK(ReadDirect(file, 512, 1024, dst, scratch));
  EXPECT_EQ(std::string(dst, 1024), data.substr(512, 1024));
  EXPECT_EQ(file.reads(), 1);
  EXPECT_EQ(scratch.capacity(), 0u);
}

TEST(ReadDirect, AFileThatShrankIsOutOfRangeNamingTheByte) {
  FakeFile file("ckpt.safetensors", Bytes(1000, 4), 512);
  ReadBuffer scratch;
  EXPECT_THAT(ReadDirectInto(file, 900, 200, scratch),
              StatusIs(absl::StatusCode::kOutOfRange, "ckpt.safetensors: file ended at byte 1000 while 100 more"));
}

// Reads [offset, offset + n) with O_DIRECT asked for, from a file of a
// FaultInjectingEnv whose reads stop after `max_read` bytes; `direct` says
// whether O_DIRECT was used.
absl::StatusOr<std::string> ReadWithShortReads(size_t max_read, const std::string& data, uint64_t offset, uint64_t n,
                                               bool* direct) {
  FakeEnv fake;
  fake.files["ckpt"] = data;
  FaultInjectingEnv env(Faults{"ckpt", -1, max_read}, &fake);
  Catalog catalog;
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<RandomAccessFile> file, env.OpenForRead("ckpt"));
  catalog.files.push_back({"ckpt", "ckpt", data.size(), 0, 0, {}, 0, {}, std::move(file)});
  WEIGHTD_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(catalog, {DirectIo::kOn}));
  *direct = reader->direct(0);
  std::string out(n, '\0');
  ReadBuffer scratch;
  WEIGHTD_RETURN_IF_ERROR(reader->Read(0, offset, n, out.data(), scratch));
  return out;
}

TEST(ReadDirect, ShortReadsOfWholeBlocksAreContinued) {
  const std::string data = Bytes(10 * 512 + 77, 9);
  bool direct = false;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string got, ReadWithShortReads(512, data, 100, 9 * 512, &direct));
  EXPECT_TRUE(direct);
  EXPECT_EQ(got, data.substr(100, 9 * 512));
}

// O_DIRECT returns a count off the alignment only at the end of the file, so
// a file system that does so mid-file fails the probe read at open.
TEST(ReadDirect, ShortReadsOffTheAlignmentFallBackToBufferedReads) {
  const std::string data = Bytes(10 * 512, 10);
  bool direct = true;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string got, ReadWithShortReads(100, data, 0, 2048, &direct));
  EXPECT_FALSE(direct);
  EXPECT_EQ(got, data.substr(0, 2048));
}

TEST(DirectIoMode, ParsesTheThreeWords) {
  EXPECT_EQ(*ParseDirectIo("auto"), DirectIo::kAuto);
  EXPECT_EQ(*ParseDirectIo("on"), DirectIo::kOn);
  EXPECT_EQ(*ParseDirectIo("off"), DirectIo::kOff);
  EXPECT_THAT(ParseDirectIo("yes"), StatusIs(absl::StatusCode::kInvalidArgument, "got 'yes'"));
}

class CheckpointReaderModes : public ::testing::Test {
 protected:
  void SetUp() override {
    env_.files["/m/a.safetensors"] = Bytes(3 * 512 + 17, 5);
    env_.files["/m/b.safetensors"] = Bytes(700, 6);
  }
  std::unique_ptr<CheckpointReader> Open(DirectIo mode) {
    absl::StatusOr<std::unique_ptr<CheckpointReader>> reader = CheckpointReader::Open(CatalogOf(env_), {mode});
    EXPECT_TRUE(reader.ok()) << reader.status();
    return reader.ok() ? std::move(*reader) : nullptr;
  }
  void ExpectReadsEqualTheFiles(const CheckpointReader& reader) {
    ReadBuffer scratch;
    uint32_t index = 0;
    for (const auto& [path, data] : env_.files) {
      std::string got(data.size() - 3, '\0');
      WEIGHTD_ASSERT_OK(reader.Read(index, 3, got.size(), got.data(), scratch));
      EXPECT_EQ(got, data.substr(3)) << path;
      WEIGHTD_ASSERT_OK_AND_ASSIGN(const char* into, reader.ReadInto(index, 1, data.size() - 1, scratch));
      EXPECT_EQ(std::string(into, data.size() - 1), data.substr(1)) << path;
      ++index;
    }
  }
  FakeEnv env_;
};

TEST_F(CheckpointReaderModes, OffNeverOpensDirect) {
  env_.cached = 0.0;
  std::unique_ptr<CheckpointReader> reader = Open(DirectIo::kOff);
  EXPECT_FALSE(reader->direct(0));
  EXPECT_EQ(env_.direct_opens, 0);
  ExpectReadsEqualTheFiles(*reader);
}

TEST_F(CheckpointReaderModes, OnReadsEveryFileDirect) {
  std::unique_ptr<CheckpointReader> reader = Open(DirectIo::kOn);
  EXPECT_TRUE(reader->direct(0));
  EXPECT_TRUE(reader->direct(1));
  ExpectReadsEqualTheFiles(*reader);
}

TEST_F(CheckpointReaderModes, AutoReadsColdFilesDirectAndCachedOnesBuffered) {
  env_.cached = 0.1;
  EXPECT_TRUE(Open(DirectIo::kAuto)->direct(0));
  env_.cached = 0.9;
  EXPECT_FALSE(Open(DirectIo::kAuto)->direct(0));
}

TEST_F(CheckpointReaderModes, AFileSystemRefusingDirectFallsBackToBuffered) {
  env_.direct_ok = false;
  std::unique_ptr<CheckpointReader> reader = Open(DirectIo::kOn);
  EXPECT_FALSE(reader->direct(0));
  EXPECT_FALSE(reader->direct(1));
  ExpectReadsEqualTheFiles(*reader);
}

// Real O_DIRECT: a file on the build directory's disk (/tmp may be tmpfs).
class RealDirectFile : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string pattern = std::string(WEIGHTD_DISK_DIR) + "/reader-test-XXXXXX";
    ASSERT_NE(mkdtemp(pattern.data()), nullptr);
    dir_ = pattern;
    path_ = dir_ + "/odd.bin";
    data_ = Bytes(3 * 4096 + 4096 / 2 + 13, 7);  // not a block multiple
    WriteFile(path_, data_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_, path_, data_;
};

TEST_F(RealDirectFile, DirectReadsEqualPread) {
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> direct = Env::Default()->OpenForDirectRead(path_);
  if (absl::IsFailedPrecondition(direct.status())) GTEST_SKIP() << direct.status();
  WEIGHTD_ASSERT_OK(direct.status());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<RandomAccessFile> buffered, Env::Default()->OpenForRead(path_));
  uint64_t align = (*direct)->direct_alignment();
  ASSERT_GT(align, 0u);
  ASSERT_EQ(4096 % align, 0u);
  ReadBuffer scratch, dst_memory;
  char* base = dst_memory.Get(data_.size() + 8192, 4096);
  for (const Range& r : std::vector<Range>{{0, data_.size()}, {1, 4096}, {4095, 2}, {4096, 8192}, {5000, 3000},
                                           {align - 1, data_.size() - align}, {data_.size() - 13, 13},
                                           {data_.size() - 1, 1}, {12288, data_.size() - 12288}}) {
    std::string expected(r.n, '\0');
    WEIGHTD_ASSERT_OK(buffered->ReadAt(r.offset, r.n, expected.data()));
    for (uint64_t shift : {r.offset % 4096, (r.offset + 1) % 4096}) {
      WEIGHTD_ASSERT_OK(ReadDirect(**direct, r.offset, r.n, base + shift, scratch));
      EXPECT_EQ(std::string(base + shift, r.n), expected) << "offset " << r.offset << " n " << r.n;
    }
  }
}

// Issue 12: the O_DIRECT twin is the inode the catalog opened, not its path.
TEST_F(RealDirectFile, ReopenDirectReadsTheOpenedFileNotThePath) {
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<RandomAccessFile> buffered, Env::Default()->OpenForRead(path_));
  WriteFile(dir_ + "/other", Bytes(data_.size(), 8));
  ASSERT_EQ(rename((dir_ + "/other").c_str(), path_.c_str()), 0);
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> direct = buffered->ReopenDirect();
  if (absl::IsFailedPrecondition(direct.status())) GTEST_SKIP() << direct.status();
  WEIGHTD_ASSERT_OK(direct.status());
  EXPECT_GT((*direct)->direct_alignment(), 0u);
  ReadBuffer scratch;
  WEIGHTD_ASSERT_OK_AND_ASSIGN(const char* got, ReadDirectInto(**direct, 0, data_.size(), scratch));
  EXPECT_EQ(Xxh3Hex(got, data_.size()), Xxh3Hex(data_.data(), data_.size()));
}

}  // namespace
}  // namespace weightd
