// NUMA-local copies (LoadRequest::numa_copies, docs/devices.md "NUMA
// copies"): the topology through the Env seam, one copy per node bound to
// it before it is filled, the copy an attach maps, the bytes per node, and
// the state record. A fake two-node topology covers what this one-node
// machine cannot; the real mbind(2) path runs here with one node.
#include <linux/mempolicy.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <map>
#include <string>

#include "common/format/catalog.h"
#include "gtest/gtest.h"
#include "server/load/loader.h"
#include "server/metrics/metrics.h"
#include "server/registry/registry.h"
#include "server/restart/state_record.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

// The machine's files, a stand-in topology, and a record of each binding
// (the memfd's inode, the bytes bound, the node).
class TwoNodeEnv final : public Env {
 public:
  struct Binding {
    uint64_t inode;
    uint64_t bytes;
    int node;
  };
  explicit TwoNodeEnv(std::vector<NumaNode> nodes) : nodes_(std::move(nodes)) {}
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    return Env::Default()->OpenForRead(path);
  }
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForDirectRead(const std::string& path) override {
    return Env::Default()->OpenForDirectRead(path);
  }
  absl::StatusOr<FileKind> Stat(const std::string& path) override { return Env::Default()->Stat(path); }
  absl::StatusOr<std::vector<std::string>> ListDir(const std::string& path) override {
    return Env::Default()->ListDir(path);
  }
  absl::StatusOr<std::string> RealPath(const std::string& path) override { return Env::Default()->RealPath(path); }
  absl::StatusOr<std::vector<NumaNode>> NumaNodes() override { return nodes_; }
  absl::Status BindMemory(int fd, char* addr, uint64_t bytes, int node) override {
    struct stat st {};
    EXPECT_EQ(fstat(fd, &st), 0);
    EXPECT_NE(addr, nullptr);
    bindings.push_back({static_cast<uint64_t>(st.st_ino), bytes, node});
    return absl::OkStatus();
  }
  std::vector<Binding> bindings;

 private:
  std::vector<NumaNode> nodes_;
};

uint64_t InodeOf(int fd) {
  struct stat st {};
  EXPECT_EQ(fstat(fd, &st), 0);
  return st.st_ino;
}

std::string Bytes(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>(i * 7 + seed);
  return s;
}

class NumaCopiesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::WriteFile(dir_.Join("m.safetensors"), testing::SafetensorsBuilder()
                                                       .Add("engram.table", "U8", {8192}, Bytes(8192, 1))
                                                       .Add("engram.scale", "U8", {100}, Bytes(100, 2))
                                                       .Build());
  }
  LoadRequest Request(bool copies = true) {
    LoadRequest r;
    r.name = "ds";
    r.checkpoint_path = dir_.Join("m.safetensors");
    r.numa_copies = copies;
    return r;
  }
  std::unique_ptr<ModelGeneration> Load(const LoadRequest& request, Env* env) {
    absl::StatusOr<Catalog> catalog = BuildCatalog(request.checkpoint_path);
    EXPECT_TRUE(catalog.ok()) << catalog.status();
    LoaderOptions options;
    options.mlock = false;
    options.env = env;
    absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = LoadGeneration(*catalog, request, options, nullptr);
    EXPECT_TRUE(gen.ok()) << gen.status();
    return gen.ok() ? std::move(*gen) : nullptr;
  }
  testing::TempDir dir_;
};

TEST(ParseCpuList, RangesAndSinglesSortedAndBounded) {
  EXPECT_THAT(ParseCpuList("0-3,8,10-11\n", 16).value(), ElementsAre(0, 1, 2, 3, 8, 10, 11));
  EXPECT_THAT(ParseCpuList("5,1-2,2", 16).value(), ElementsAre(1, 2, 5));
  EXPECT_TRUE(ParseCpuList("\n", 16).value().empty());  // a memory-only node has no CPUs
  for (const char* bad : {"1-", "a", "3-1", "16", "-1", "0,,1", "0-99999999999"}) {
    EXPECT_THAT(ParseCpuList(bad, 16), StatusIs(absl::StatusCode::kInvalidArgument, "is not a list of numbers below 16"))
        << bad;
  }
}

TEST(ReadNumaTopology, ReadsOnlineNodesAndTheirCpusFromAStandIn) {
  testing::TempDir sys;
  testing::WriteFile(sys.Join("online"), "0-1\n");
  ASSERT_EQ(mkdir(sys.Join("node0").c_str(), 0755), 0);
  ASSERT_EQ(mkdir(sys.Join("node1").c_str(), 0755), 0);
  testing::WriteFile(sys.Join("node0/cpulist"), "0\n");
  testing::WriteFile(sys.Join("node1/cpulist"), "1\n");
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::vector<NumaNode> nodes, Env::ReadNumaTopology(*Env::Default(), sys.path()));
  EXPECT_THAT(nodes, ElementsAre(NumaNode{0, {0}}, NumaNode{1, {1}}));
  testing::WriteFile(sys.Join("node1/cpulist"), "x\n");
  EXPECT_THAT(Env::ReadNumaTopology(*Env::Default(), sys.path()),
              StatusIs(absl::StatusCode::kInvalidArgument, sys.Join("node1/cpulist")));
  // No such folder (a kernel without NUMA): no nodes, not an error.
  EXPECT_TRUE(Env::ReadNumaTopology(*Env::Default(), sys.Join("missing")).value().empty());
  // This machine's own topology reads.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::vector<NumaNode> real, Env::Default()->NumaNodes());
  if (!real.empty()) {
    EXPECT_FALSE(real[0].cpus.empty());
  }
}

TEST_F(NumaCopiesTest, TwoNodesGetTwoCopiesEachBoundToItsNodeBeforeItIsFilled) {
  TwoNodeEnv env({{0, {0}}, {1, {1}}});
  auto gen = Load(Request(), &env);
  ASSERT_NE(gen, nullptr);
  ASSERT_EQ(gen->numa_copies.size(), 2u);
  EXPECT_EQ(gen->numa_copies[0].node, 0);
  EXPECT_EQ(gen->numa_copies[1].node, 1);
  ASSERT_EQ(gen->numa_copies[0].host_segments, gen->ranks[0].segments);  // copy 0 is the manifest's own
  ASSERT_EQ(gen->numa_copies[1].host_segments.size(), 1u);
  EXPECT_EQ(gen->host_segments.size(), 2u);
  EXPECT_EQ(gen->host_bytes, 2 * gen->segments[gen->ranks[0].segments[0]].size);
  // Every segment of copy k was bound to node k, all of it, once.
  std::map<uint64_t, std::pair<uint64_t, int>> bound;
  for (const TwoNodeEnv::Binding& b : env.bindings) {
    EXPECT_TRUE(bound.emplace(b.inode, std::pair{b.bytes, b.node}).second);
  }
  EXPECT_EQ(bound.size(), 2u);
  for (const NumaCopy& copy : gen->numa_copies) {
    for (uint32_t id : copy.host_segments) {
      const SegmentRecord& seg = gen->segments[id];
      auto it = bound.find(InodeOf(seg.fd));
      ASSERT_NE(it, bound.end()) << "segment " << id << " was never bound";
      EXPECT_EQ(it->second, std::pair(seg.size, copy.node)) << "segment " << id;
    }
  }
  // Each copy holds the file's bytes at the manifest's offsets.
  for (int copy = 0; copy < 2; ++copy) {
    std::vector<uint32_t> ids = gen->SegmentsOf(0, copy);
    for (const TensorRecord& t : gen->ranks[0].tensors) {
      const HostSegment& seg = *gen->host_segments[gen->segments[ids[t.segment]].owner];
      EXPECT_EQ(std::string(seg.data() + t.offset, t.nbytes), t.name == "engram.table" ? Bytes(8192, 1) : Bytes(100, 2))
          << t.name << " in copy " << copy;
    }
  }
  // Bytes per node: each copy's, once.
  std::shared_ptr<ModelGeneration> shared = std::move(gen);
  shared->state = ModelState::kReady;
  ModelsSample sample = SampleModels({shared, shared});
  uint64_t one = shared->segments[shared->ranks[0].segments[0]].size;
  EXPECT_THAT(sample.numa_bytes, ElementsAre(Pair("0", one), Pair("1", one)));
}

TEST_F(NumaCopiesTest, WithoutTheOptionNothingIsBoundAndThereIsOneCopy) {
  TwoNodeEnv env({{0, {0}}, {1, {1}}});
  auto gen = Load(Request(/*copies=*/false), &env);
  ASSERT_NE(gen, nullptr);
  EXPECT_TRUE(gen->numa_copies.empty());
  EXPECT_TRUE(env.bindings.empty());
  EXPECT_EQ(gen->host_segments.size(), 1u);
}

// The real mbind(2) on this machine's one node: one copy, and the kernel
// reports the segment's pages bound to that node.
TEST_F(NumaCopiesTest, OnThisMachineTheRealPathBindsTheOneCopy) {
  absl::StatusOr<std::vector<NumaNode>> nodes = Env::Default()->NumaNodes();
  ASSERT_TRUE(nodes.ok()) << nodes.status();
  if (nodes->empty()) GTEST_SKIP() << "this kernel has no NUMA support (no " << kNumaSysfsRoot << ")";
  auto gen = Load(Request(), nullptr);
  ASSERT_NE(gen, nullptr);
  ASSERT_EQ(gen->numa_copies.size(), nodes->size() == 1 ? 1u : nodes->size());
  EXPECT_EQ(gen->numa_copies[0].node, (*nodes)[0].id);
  const HostSegment& seg = *gen->host_segments[0];
  int mode = -1;
  unsigned long mask[kMaxNumaNodes / (8 * sizeof(unsigned long))] = {};
  // MPOL_F_ADDR: the policy of the memory at this address, for shmem the
  // file's shared policy, which the load set before filling.
  ASSERT_EQ(syscall(SYS_get_mempolicy, &mode, mask, kMaxNumaNodes, seg.data(), MPOL_F_ADDR), 0) << errno;
  EXPECT_EQ(mode, MPOL_BIND);
  EXPECT_EQ(mask[0], 1ul << (*nodes)[0].id);
}

TEST(ChooseNumaCopy, ANamedNodeThenTheCpusThenTheFirstCopy) {
  std::vector<NumaCopy> copies = {{0, {0, 1}, {0}}, {1, {2, 3}, {2}}};
  EXPECT_EQ(ChooseNumaCopy(copies, 1, {0}).value(), 1);  // named wins over CPUs
  EXPECT_EQ(ChooseNumaCopy(copies, std::nullopt, {3}).value(), 1);
  EXPECT_EQ(ChooseNumaCopy(copies, std::nullopt, {1, 2, 3}).value(), 1);  // most CPUs
  EXPECT_EQ(ChooseNumaCopy(copies, std::nullopt, {1, 2}).value(), 0);     // a tie: the lower node
  EXPECT_EQ(ChooseNumaCopy(copies, std::nullopt, {}).value(), 0);
  EXPECT_EQ(ChooseNumaCopy(copies, std::nullopt, {7}).value(), 0);  // on no copy's node
  EXPECT_THAT(ChooseNumaCopy(copies, 5, {}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "no NUMA copy on node 5; the model has copies on nodes 0, 1"));
  EXPECT_EQ(ChooseNumaCopy({}, 5, {1}).value(), -1);  // no copies: nothing to choose
}

// Through the registry: a client whose CPUs are node 1's maps node 1's copy.
TEST_F(NumaCopiesTest, AnAttachFromNodeOnesCpusGetsNodeOnesCopy) {
  TwoNodeEnv env({{0, {0}}, {1, {1}}});
  RegistryOptions options;
  options.model_roots = {dir_.path()};
  options.env = &env;
  options.loader.mlock = false;
  ModelRegistry registry(options, nullptr);
  ASSERT_TRUE(registry.Load(Request(), nullptr).ok());
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::Grant on1, registry.Attach("ds", 0, {std::nullopt, {1}}));
  EXPECT_EQ(on1.numa_node(), 1);
  const ModelGeneration& m = *on1.model;
  EXPECT_EQ(m.SegmentsOf(0, on1.numa_copy), m.numa_copies[1].host_segments);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::Grant on0, registry.Attach("ds", 0, {std::nullopt, {0}}));
  EXPECT_EQ(on0.numa_node(), 0);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::Grant named, registry.Attach("ds", 0, {1, {0}}));
  EXPECT_EQ(named.numa_node(), 1);
  EXPECT_THAT(registry.Attach("ds", 0, {4, {}}), StatusIs(absl::StatusCode::kFailedPrecondition, "no NUMA copy on node 4"));
  // The claim on the fd socket hands out what the attach chose.
  WEIGHTD_ASSERT_OK_AND_ASSIGN(ModelRegistry::Grant claimed, registry.Claim(on1.lease_id));
  EXPECT_EQ(claimed.numa_copy, on1.numa_copy);
  // A writer's commit would leave node 1's copy with the old bytes: refused.
  EXPECT_THAT(registry.BeginUpdate("ds", {"engram.table"}),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "model 'ds' has 2 NUMA copies; a writer's update of a model loaded with numa_copies is not "
                       "supported (load it without)"));
}

TEST_F(NumaCopiesTest, TheStateRecordKeepsTheCopiesAndRefusesAForgedOne) {
  TwoNodeEnv env({{0, {0}}, {1, {1}}});
  auto gen = Load(Request(), &env);
  ASSERT_NE(gen, nullptr);
  gen->generation = 3;
  gen->request.checkpoint_path = dir_.Join("m.safetensors");
  std::vector<StoredSegment> host;
  for (size_t i = 0; i < gen->host_segments.size(); ++i) {
    host.push_back({"wd-seg-" + std::to_string(i + 1), SegmentBackend::kMemfd, gen->host_segments[i]->size(),
                    InodeOf(gen->host_segments[i]->fd()), false, ""});
  }
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string record, EncodeStateRecord(*gen, host, {}));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(StateRecord decoded, DecodeStateRecord(record));
  ASSERT_EQ(decoded.model->numa_copies.size(), 2u);
  EXPECT_EQ(decoded.model->numa_copies[1].node, 1);
  EXPECT_EQ(decoded.model->numa_copies[1].cpus, std::vector<int>{1});
  EXPECT_TRUE(decoded.model->from_files);
  EXPECT_EQ(decoded.model->numa_copies[1].host_segments, gen->numa_copies[1].host_segments);
  EXPECT_TRUE(decoded.model->request.numa_copies);
  // A copy naming a segment of another size (here: an index past the end)
  // would hand a client a mapping its tensors do not fit: refused.
  const std::vector<uint32_t> good = gen->numa_copies[1].host_segments;
  gen->numa_copies[1].host_segments = {static_cast<uint32_t>(gen->segments.size())};
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string forged, EncodeStateRecord(*gen, host, {}));
  EXPECT_THAT(DecodeStateRecord(forged), StatusIs(absl::StatusCode::kInvalidArgument,
                                                  "numa_copies[1]: segment 2 is not a host segment the size of 0"));
  // A second rank whose host segment is not rank 0's: the copy would stand
  // in for a segment of another layout (a read past its end). Refused.
  gen->numa_copies[1].host_segments = good;
  gen->request.tp_size = 2;
  gen->ranks.push_back(gen->ranks[0]);
  gen->ranks[1].segments[0] = good[0];
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string two_ranks, EncodeStateRecord(*gen, host, {}));
  EXPECT_THAT(DecodeStateRecord(two_ranks), StatusIs(absl::StatusCode::kInvalidArgument,
                                                     "numa_copies[0]: the ranks do not share their host segments"));
}

}  // namespace
}  // namespace weightd
