// Generations share segments: LoadGeneration with the generation before
// re-reads only the checkpoint files whose stamp changed and shares the
// segments (host and device) of the others by reference (server/load/loader.h).
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/format/catalog.h"
#include "common/memory/device.h"
#include "gtest/gtest.h"
#include "server/load/loader.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::Bytes;
using ::weightd::testing::SafetensorsBuilder;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;

LoaderOptions Options() {
  LoaderOptions options;
  options.threads = 2;
  options.mlock = false;
  return options;
}

LoadRequest HostRequest() {
  LoadRequest r;
  r.name = "m";
  return r;
}

// A file of two tensors "<prefix>.0" (1000 bytes) and "<prefix>.1" (3000 bytes).
std::string TwoTensors(const std::string& prefix, uint32_t seed) {
  return SafetensorsBuilder()
      .Add(prefix + ".0", "U8", {1000}, Bytes(1000, seed))
      .Add(prefix + ".1", "U8", {3000}, Bytes(3000, seed + 1))
      .Build();
}

// Replaces `path` by a new file (a new inode), as a trainer's writer would.
void Replace(const std::string& path, const std::string& bytes) {
  WriteFile(path + ".tmp", bytes);
  ASSERT_EQ(rename((path + ".tmp").c_str(), path.c_str()), 0);
}

const std::string& BytesOf(const ModelGeneration& gen, const std::string& tensor) {
  static std::string out;
  for (const TensorRecord& t : gen.ranks[0].tensors) {
    if (t.name != tensor) continue;
    const SegmentRecord& s = gen.segments[gen.ranks[0].segments[t.segment]];
    out.assign(gen.host_segments[s.owner]->data() + t.offset, t.nbytes);
    return out;
  }
  out = "<missing>";
  return out;
}

class PartialReloadTest : public ::testing::Test {
 protected:
  void SetUp() override {
    WriteFile(dir_.Join("a.safetensors"), TwoTensors("a", 1));
    WriteFile(dir_.Join("b.safetensors"), TwoTensors("b", 10));
  }
  std::unique_ptr<ModelGeneration> Load(const std::string& path, const ModelGeneration* previous,
                                        const LoadRequest& request = HostRequest(), const LoaderOptions& options = Options()) {
    absl::StatusOr<Catalog> catalog = BuildCatalog(path);
    EXPECT_TRUE(catalog.ok()) << catalog.status();
    SharedSegments shared;  // what a reload may share: the generation before's segments
    if (previous != nullptr) shared.Add(*previous);
    absl::StatusOr<std::unique_ptr<ModelGeneration>> gen =
        LoadGeneration(*catalog, request, options, nullptr, previous != nullptr ? &shared : nullptr);
    EXPECT_TRUE(gen.ok()) << gen.status();
    return gen.ok() ? std::move(*gen) : nullptr;
  }
  TempDir dir_;
};

TEST_F(PartialReloadTest, OneHostSegmentPerFile) {
  auto gen = Load(dir_.path(), nullptr);
  ASSERT_EQ(gen->host_segments.size(), 2u);
  ASSERT_EQ(gen->files.size(), 2u);
  EXPECT_EQ(gen->files[0].stamp.name, "a.safetensors");
  EXPECT_EQ(gen->files[0].host_segments, std::vector<uint32_t>{0});
  EXPECT_EQ(gen->files[1].host_segments, std::vector<uint32_t>{1});
  EXPECT_EQ(gen->bytes_read, 8000u);
  EXPECT_EQ(gen->bytes_reused, 0u);
}

TEST_F(PartialReloadTest, AChangedFileIsReadAndTheOtherSharedByReference) {
  auto first = Load(dir_.path(), nullptr);
  Replace(dir_.Join("b.safetensors"), TwoTensors("b", 20));
  auto second = Load(dir_.path(), first.get());
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(second->host_segments[0].get(), first->host_segments[0].get());  // the same sealed memfd
  EXPECT_NE(second->host_segments[1].get(), first->host_segments[1].get());
  EXPECT_EQ(second->bytes_read, 4000u);                          // b's tensors only
  EXPECT_EQ(second->bytes_reused, first->host_segments[0]->size());  // a's segment
  EXPECT_EQ(BytesOf(*second, "b.1"), Bytes(3000, 21));
  EXPECT_EQ(BytesOf(*second, "a.1"), Bytes(3000, 2));
  EXPECT_EQ(BytesOf(*first, "b.1"), Bytes(3000, 11));  // the old generation is untouched
  // Hashes and fingerprint equal those of a full load of the same files.
  auto full = Load(dir_.path(), nullptr);
  EXPECT_EQ(second->fingerprint, full->fingerprint);
  EXPECT_NE(second->fingerprint, first->fingerprint);
  for (size_t i = 0; i < full->ranks[0].tensors.size(); ++i) {
    EXPECT_EQ(second->ranks[0].tensors[i].content_hash, full->ranks[0].tensors[i].content_hash) << i;
  }
}

TEST_F(PartialReloadTest, AnUnchangedCheckpointReadsNothing) {
  auto first = Load(dir_.path(), nullptr);
  auto second = Load(dir_.path(), first.get());
  EXPECT_EQ(second->bytes_read, 0u);
  EXPECT_EQ(second->host_segments[0].get(), first->host_segments[0].get());
  EXPECT_EQ(second->host_segments[1].get(), first->host_segments[1].get());
  EXPECT_EQ(second->fingerprint, first->fingerprint);
}

TEST_F(PartialReloadTest, ASymlinkToTheSameFileIsSharedAndACopyIsNot) {
  auto first = Load(dir_.path(), nullptr);
  TempDir next;  // a new checkpoint folder: one file linked from the old one, one copied
  ASSERT_EQ(symlink(dir_.Join("a.safetensors").c_str(), next.Join("a.safetensors").c_str()), 0);
  WriteFile(next.Join("b.safetensors"), TwoTensors("b", 10));  // the same bytes in a new inode
  auto second = Load(next.path(), first.get());
  EXPECT_EQ(second->host_segments[0].get(), first->host_segments[0].get());
  EXPECT_NE(second->host_segments[1].get(), first->host_segments[1].get());
  EXPECT_EQ(second->bytes_read, 4000u);
  EXPECT_EQ(second->fingerprint, first->fingerprint);
}

TEST_F(PartialReloadTest, AHardLinkMovesTheCtimeSoTheFileIsReadAgain) {
  auto first = Load(dir_.path(), nullptr);
  TempDir next;
  ASSERT_EQ(link(dir_.Join("a.safetensors").c_str(), next.Join("a.safetensors").c_str()), 0);
  ASSERT_EQ(link(dir_.Join("b.safetensors").c_str(), next.Join("b.safetensors").c_str()), 0);
  auto second = Load(next.path(), first.get());
  // link(2) updates the inode's ctime (inode(7)): identity errs toward re-reading.
  EXPECT_EQ(second->bytes_read, 8000u);
  EXPECT_EQ(second->fingerprint, first->fingerprint);
}

TEST_F(PartialReloadTest, ATouchedFileIsReadAgain) {
  auto first = Load(dir_.path(), nullptr);
  struct timespec times[2] = {{0, UTIME_OMIT}, {123456789, 42}};  // a new mtime, same bytes
  ASSERT_EQ(utimensat(AT_FDCWD, dir_.Join("a.safetensors").c_str(), times, 0), 0);
  auto second = Load(dir_.path(), first.get());
  EXPECT_NE(second->host_segments[0].get(), first->host_segments[0].get());
  EXPECT_EQ(second->host_segments[1].get(), first->host_segments[1].get());
  EXPECT_EQ(second->bytes_read, 4000u);
}

TEST_F(PartialReloadTest, DeviceArenasOfUnchangedFilesAreShared) {
  std::unique_ptr<DeviceBackend> backend = MakeEmulatedBackend(2);
  LoaderOptions options = Options();
  options.device_backend = backend.get();
  LoadRequest request;
  request.name = "m";
  request.tp_size = 2;
  request.devices = {"GPU-emulated-0", "GPU-emulated-1"};
  request.tp_rules = {{".1", 0}};
  request.host_resident_patterns = {"a.0"};
  auto first = Load(dir_.path(), nullptr, request, options);
  ASSERT_NE(first, nullptr);
  ASSERT_EQ(first->host_segments.size(), 1u);  // a.0
  ASSERT_EQ(first->arenas.size(), 4u);         // per rank: one arena for a's, one for b's device tensors
  Replace(dir_.Join("b.safetensors"), TwoTensors("b", 30));
  auto second = Load(dir_.path(), first.get(), request, options);
  ASSERT_NE(second, nullptr);
  // Rank order: rank 0's arenas (a, b), then rank 1's.
  EXPECT_EQ(second->arenas[0].get(), first->arenas[0].get());
  EXPECT_NE(second->arenas[1].get(), first->arenas[1].get());
  EXPECT_EQ(second->arenas[2].get(), first->arenas[2].get());
  EXPECT_NE(second->arenas[3].get(), first->arenas[3].get());
  EXPECT_EQ(second->host_segments[0].get(), first->host_segments[0].get());
  EXPECT_EQ(second->bytes_read, 4000u);
  // b.1 is split on dim 0: rank 1 holds its second half.
  const TensorRecord& b1 = second->ranks[1].tensors[3];
  ASSERT_EQ(b1.name, "b.1");
  std::string half(1500, '\0');
  const SegmentRecord& s = second->segments[second->ranks[1].segments[b1.segment]];
  ASSERT_TRUE(second->arenas[s.owner]->CopyToHost(b1.offset, half.data(), half.size()).ok());
  EXPECT_EQ(half, Bytes(3000, 31).substr(1500));
}

}  // namespace
}  // namespace weightd
