// Restart without reload, below the process level: FdStoreKeeper puts a
// generation into a store (a fake one here), RestoreFromFdStore takes it back
// from the store's fds, and every damaged or partial store is refused with
// its reason instead of served (server/restart/fd_store.h, server/restart/restore.h,
// server/restart/state_record.h).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <mutex>

#include <xxhash.h>

#include "absl/strings/match.h"
#include "common/format/catalog.h"
#include "common/format/content_hash.h"
#include "common/io/env.h"
#include "common/memory/device.h"
#include "gtest/gtest.h"
#include "server/restart/fd_store.h"
#include "server/load/loader.h"
#include "server/restart/restore.h"
#include "server/restart/state_record.h"
#include "tests/testing/checkpoint_builder.h"
#include "tests/testing/shared_inputs.h"
#include "tests/testing/status_matchers.h"

namespace weightd {
namespace {

using ::weightd::testing::Bytes;
using ::weightd::testing::SafetensorsBuilder;
using ::weightd::testing::TempDir;
using ::weightd::testing::WriteFile;

// A store that keeps copies of what it is given, and the order of calls.
class FakeSink final : public FdStoreSink {
 public:
  absl::Status Store(const std::string& name, int fd) override {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back("+" + name);
    fds_.emplace_back(name, ScopedFd(fcntl(fd, F_DUPFD_CLOEXEC, 3)));
    return absl::OkStatus();
  }
  absl::Status Remove(const std::string& name) override {
    std::lock_guard<std::mutex> lock(mu_);
    log_.push_back("-" + name);
    std::erase_if(fds_, [&](const auto& e) { return e.first == name; });
    return absl::OkStatus();
  }
  // Copies of the stored fds, as a restarted daemon receives them.
  std::vector<NamedFd> Passed() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<NamedFd> out;
    for (const auto& [name, fd] : fds_) out.push_back({name, ScopedFd(fcntl(fd.get(), F_DUPFD_CLOEXEC, 3))});
    return out;
  }
  std::vector<std::string> Log() {
    std::lock_guard<std::mutex> lock(mu_);
    return log_;
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<std::string, ScopedFd>> fds_;
  std::vector<std::string> log_;
};

class Restore : public ::testing::Test {
 protected:
  Restore() : backend_(MakeEmulatedBackend(2)) {
    // table: host-resident; rows: split on dim 0 over two ranks; bias: replicated.
    WriteFile(dir_.Join("model.safetensors"), SafetensorsBuilder()
                                                  .Add("embed.table", "U8", {64, 16}, Bytes(1024, 1))
                                                  .Add("layer.rows", "F32", {8, 4}, Bytes(128, 2))
                                                  .Add("layer.bias", "F32", {4}, Bytes(16, 3))
                                                  .Build());
    roots_ = ModelRoots::Resolve(*Env::Default(), {dir_.path()});
  }

  std::shared_ptr<ModelGeneration> Load(const std::string& name, uint64_t generation) {
    absl::StatusOr<Catalog> catalog = BuildCatalog(dir_.path());
    EXPECT_TRUE(catalog.ok()) << catalog.status();
    LoadRequest r;
    r.name = name;
    r.checkpoint_path = dir_.path();
    r.tp_size = 2;
    r.devices = {"GPU-emulated-0", "GPU-emulated-1"};
    r.tp_rules = {{"rows", 0}};
    r.host_resident_patterns = {"table"};
    LoaderOptions options;
    options.threads = 1;
    options.mlock = false;
    options.device_backend = backend_.get();
    absl::StatusOr<std::unique_ptr<ModelGeneration>> gen = LoadGeneration(*catalog, r, options, nullptr);
    EXPECT_TRUE(gen.ok()) << gen.status();
    std::shared_ptr<ModelGeneration> model = std::move(*gen);
    model->generation = generation;
    model->state = ModelState::kReady;
    return model;
  }

  // Stores `model` through a keeper into sink_, as the registry would.
  void Store(FdStoreKeeper& keeper, const std::shared_ptr<ModelGeneration>& model) {
    keeper.OnGenerationPublished(model);
    keeper.Flush();
  }

  RestoreResult RestoreAll(std::vector<NamedFd> fds, DeviceBackend* backend, const RecordKey* key = nullptr) {
    return RestoreFromFdStore(std::move(fds), {&roots_, backend, key});
  }

  TempDir dir_;
  std::unique_ptr<DeviceBackend> backend_;
  ModelRoots roots_;
};

std::string HostBytes(const ModelGeneration& m) {
  std::string out;
  for (const auto& s : m.host_segments) out.append(s->data(), s->size());
  return out;
}

std::string ArenaBytes(const ModelGeneration& m) {
  std::string out;
  for (const auto& a : m.arenas) {
    std::string bytes(a->size(), '\0');
    EXPECT_TRUE(a->CopyToHost(0, bytes.data(), bytes.size()).ok());
    out += bytes;
  }
  return out;
}

// A sealed memfd of `bytes`.
ScopedFd Sealed(const std::string& bytes) {
  absl::StatusOr<ScopedFd> fd = SealedMemfd("test", bytes);
  EXPECT_TRUE(fd.ok()) << fd.status();
  return std::move(*fd);
}

std::string ReadAll(int fd) {
  struct stat st {};
  fstat(fd, &st);
  std::string out(st.st_size, '\0');
  EXPECT_EQ(pread(fd, out.data(), out.size(), 0), static_cast<ssize_t>(out.size()));
  return out;
}

TEST_F(Restore, AStoredGenerationComesBackWithTheSameManifestAndBytes) {
  auto* sink = new FakeSink;
  FdStoreKeeper keeper{std::unique_ptr<FdStoreSink>(sink)};
  std::shared_ptr<ModelGeneration> model = Load("m", 7);
  Store(keeper, model);
  // 1 host segment + 1 arena per rank, each stored once, before the record.
  EXPECT_EQ(sink->Log(), (std::vector<std::string>{"+wd-seg-1", "+wd-seg-2", "+wd-seg-3", "+wd-rec-7"}));

  RestoreResult result = RestoreAll(sink->Passed(), backend_.get());
  ASSERT_EQ(result.models.size(), 1u);
  EXPECT_TRUE(result.dropped.empty());
  EXPECT_TRUE(result.unused.empty());
  const ModelGeneration& back = *result.models[0].model;
  EXPECT_EQ(back.generation, 7u);
  EXPECT_EQ(back.fingerprint, model->fingerprint);
  EXPECT_EQ(back.request.checkpoint_path, dir_.path());
  EXPECT_EQ(back.request.tp_rules[0].pattern, "rows");
  ASSERT_EQ(back.ranks.size(), 2u);
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_EQ(back.ranks[r].tensors.size(), model->ranks[r].tensors.size());
    for (size_t i = 0; i < back.ranks[r].tensors.size(); ++i) {
      const TensorRecord &a = back.ranks[r].tensors[i], &b = model->ranks[r].tensors[i];
      EXPECT_EQ(a.name, b.name);
      EXPECT_EQ(a.shape, b.shape);
      EXPECT_EQ(a.offset, b.offset);
      EXPECT_EQ(a.content_hash, b.content_hash);
      EXPECT_EQ(a.split_start, b.split_start);
    }
  }
  EXPECT_EQ(HostBytes(back), HostBytes(*model));
  EXPECT_EQ(ArenaBytes(back), ArenaBytes(*model));
  EXPECT_EQ(back.files[0].stamp, model->files[0].stamp);  // a reload can still share its segments
  EXPECT_EQ(result.models[0].host_segment_names, std::vector<std::string>{"wd-seg-1"});
  EXPECT_EQ(result.models[0].arena_names, (std::vector<std::string>{"wd-seg-2", "wd-seg-3"}));
  for (const SegmentRecord& s : back.segments) EXPECT_GE(s.fd, 0);
}

TEST_F(Restore, TheNextGenerationReplacesTheRecordAndUnloadEmptiesTheStore) {
  auto* sink = new FakeSink;
  FdStoreKeeper keeper{std::unique_ptr<FdStoreSink>(sink)};
  std::shared_ptr<ModelGeneration> first = Load("m", 1);
  Store(keeper, first);
  // A generation sharing the host segment and rank 1's arena, with a new arena for rank 0.
  std::shared_ptr<ModelGeneration> second = Load("m", 2);
  second->host_segments = first->host_segments;
  second->arenas[1] = first->arenas[1];
  Store(keeper, second);
  EXPECT_EQ(sink->Log(), (std::vector<std::string>{"+wd-seg-1", "+wd-seg-2", "+wd-seg-3", "+wd-rec-1",
                                                   // second: only its new arena, then the record; then the old record
                                                   // and the arena only it needed leave
                                                   "+wd-seg-4", "+wd-rec-2", "-wd-rec-1", "-wd-seg-2"}));
  keeper.OnModelUnloaded("m");
  keeper.Flush();
  std::vector<std::string> log = sink->Log();
  EXPECT_EQ(std::vector<std::string>(log.begin() + 8, log.end()),
            (std::vector<std::string>{"-wd-rec-2", "-wd-seg-1", "-wd-seg-4", "-wd-seg-3"}));
  EXPECT_TRUE(sink->Passed().empty());
  EXPECT_TRUE(keeper.StoredNames().empty());
}

TEST_F(Restore, HandoffCopiesEveryStoredFdRecordsFirst) {
  FdStoreKeeper keeper{nullptr};  // no service manager: the keeper still knows what to hand over
  std::shared_ptr<ModelGeneration> model = Load("m", 3);
  Store(keeper, model);
  std::vector<NamedFd> fds = keeper.Handoff();
  ASSERT_EQ(fds.size(), 4u);
  EXPECT_EQ(fds[0].name, "wd-rec-3");
  RestoreResult result = RestoreAll(std::move(fds), backend_.get());
  ASSERT_EQ(result.models.size(), 1u);
  EXPECT_EQ(result.models[0].model->fingerprint, model->fingerprint);
}

TEST_F(Restore, DamagedRecordsAreDroppedWithTheirReason) {
  auto* sink = new FakeSink;
  FdStoreKeeper keeper{std::unique_ptr<FdStoreSink>(sink)};
  Store(keeper, Load("a", 1));
  Store(keeper, Load("b", 2));
  Store(keeper, Load("c", 3));
  Store(keeper, Load("d", 4));
  std::vector<NamedFd> fds = sink->Passed();
  for (NamedFd& f : fds) {
    if (f.name == "wd-rec-1") {  // a: one body byte flipped
      std::string bytes = ReadAll(f.fd.get());
      bytes[kStateRecordHeaderBytes + 10] ^= 1;
      f.fd = Sealed(bytes);
    } else if (f.name == "wd-rec-2") {  // b: the same bytes, but not sealed
      std::string bytes = ReadAll(f.fd.get());
      f.fd = ScopedFd(memfd_create("unsealed", MFD_CLOEXEC));
      ASSERT_EQ(write(f.fd.get(), bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    }
  }
  // c: its host segment (wd-seg-7) is missing. d: its first arena is another memfd.
  std::erase_if(fds, [](const NamedFd& f) { return f.name == "wd-seg-7"; });
  for (NamedFd& f : fds) {
    if (f.name == "wd-seg-11") f.fd = Sealed(std::string(4096, 'x'));
  }
  RestoreResult result = RestoreAll(std::move(fds), backend_.get());
  EXPECT_EQ(result.models.size(), 0u);
  std::map<std::string, std::string> reasons;
  for (const DroppedRecord& d : result.dropped) reasons[d.fd_name] = d.reason + ": " + d.message;
  EXPECT_TRUE(absl::StartsWith(reasons["wd-rec-1"], "corrupt: state record checksum")) << reasons["wd-rec-1"];
  EXPECT_TRUE(absl::StartsWith(reasons["wd-rec-2"], "corrupt: the record is not a memfd sealed")) << reasons["wd-rec-2"];
  EXPECT_EQ(reasons["wd-rec-3"], "missing_fd: wd-seg-7 was not passed");
  EXPECT_TRUE(absl::StartsWith(reasons["wd-rec-4"], "segment_mismatch: wd-seg-11 is not the memfd that was stored"))
      << reasons["wd-rec-4"];
  // Every fd passed is left for the store to drop.
  EXPECT_EQ(result.unused.size(), 4u + 11u);
}

TEST_F(Restore, ModelsOutsideTheRootsOrWithoutTheirDevicesAreDropped) {
  auto* sink = new FakeSink;
  FdStoreKeeper keeper{std::unique_ptr<FdStoreSink>(sink)};
  Store(keeper, Load("m", 1));
  ModelRoots elsewhere = ModelRoots::Resolve(*Env::Default(), {"/nonexistent-root"});
  RestoreResult outside = RestoreFromFdStore(sink->Passed(), {&elsewhere, backend_.get()});
  ASSERT_EQ(outside.dropped.size(), 1u);
  EXPECT_EQ(outside.dropped[0].reason, "outside_model_roots");
  EXPECT_EQ(outside.dropped[0].model, "m");
  RestoreResult no_gpu = RestoreAll(sink->Passed(), nullptr);
  ASSERT_EQ(no_gpu.dropped.size(), 1u);
  EXPECT_EQ(no_gpu.dropped[0].reason, "device_unavailable");
  std::unique_ptr<DeviceBackend> one_gpu = MakeEmulatedBackend(1);  // GPU-emulated-1 is gone
  RestoreResult missing = RestoreAll(sink->Passed(), one_gpu.get());
  ASSERT_EQ(missing.dropped.size(), 1u);
  EXPECT_EQ(missing.dropped[0].message, "wd-seg-3: GPU GPU-emulated-1 is not present");
}

TEST_F(Restore, TheNewestRecordOfANameWins) {
  auto* old_sink = new FakeSink;
  FdStoreKeeper old_keeper{std::unique_ptr<FdStoreSink>(old_sink)};
  Store(old_keeper, Load("m", 5));
  auto* new_sink = new FakeSink;
  FdStoreKeeper new_keeper{std::unique_ptr<FdStoreSink>(new_sink)};
  std::shared_ptr<ModelGeneration> newer = Load("m", 9);
  Store(new_keeper, newer);
  // Both stores' fds at once; a name passed twice keeps its last fd, here
  // the newer store's segments.
  std::vector<NamedFd> fds = old_sink->Passed();
  for (NamedFd& f : new_sink->Passed()) fds.push_back(std::move(f));
  RestoreResult result = RestoreAll(std::move(fds), backend_.get());
  ASSERT_EQ(result.models.size(), 1u);
  EXPECT_EQ(result.models[0].model->generation, 9u);
  ASSERT_EQ(result.dropped.size(), 1u);
  EXPECT_EQ(result.dropped[0].fd_name, "wd-rec-5");
  EXPECT_EQ(result.dropped[0].reason, "duplicate");
}

TEST_F(Restore, EveryTruncationAndAForgedFingerprintAreRefused) {
  std::shared_ptr<ModelGeneration> model = Load("m", 1);
  std::vector<StoredSegment> host = {{"wd-seg-1", SegmentBackend::kMemfd, model->host_segments[0]->size(), 1, false, ""}};
  std::vector<StoredSegment> arenas;
  for (const auto& a : model->arenas) arenas.push_back({"wd-seg-x", SegmentBackend::kEmulated, a->size(), 1, false, a->device().uuid});
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string record, EncodeStateRecord(*model, host, arenas));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(StateRecord decoded, DecodeStateRecord(record));
  EXPECT_EQ(decoded.model->fingerprint, model->fingerprint);
  for (size_t n = 0; n < record.size(); ++n) {
    EXPECT_EQ(DecodeStateRecord(absl::string_view(record).substr(0, n)).status().code(), absl::StatusCode::kDataLoss) << n;
  }
  // A body with a valid checksum whose tensor hash was changed: the
  // fingerprint no longer matches its tensors.
  std::string body = record.substr(kStateRecordHeaderBytes);
  std::string hash = std::to_string(model->ranks[0].tensors[0].content_hash);
  size_t at = body.find(hash);
  ASSERT_NE(at, std::string::npos);
  body.replace(at, hash.size(), hash == "1" ? "2" : "1");
  model->host_segments.clear();  // only the record matters below
  std::string forged = record.substr(0, 8);
  const uint64_t fields[] = {body.size(), XXH3_64bits(body.data(), body.size())};
  for (uint64_t v : fields) {
    for (int i = 0; i < 8; ++i) forged.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  forged += body;
  EXPECT_THAT(DecodeStateRecord(forged), StatusIs(absl::StatusCode::kInvalidArgument, "record fingerprint"));
}

// What a forger who hands the daemon fds passes: `host_bytes` in a sealed
// memfd of its own as the model's one host segment (wd-seg-1), the model's
// arenas, and a record naming them, with an HMAC under `key` unless null.
std::vector<NamedFd> PassedWithHostBytes(const ModelGeneration& model, const std::string& host_bytes,
                                         const RecordKey* key) {
  ScopedFd host = Sealed(host_bytes);
  struct stat st {};
  EXPECT_EQ(fstat(host.get(), &st), 0);
  std::vector<StoredSegment> hosts = {{"wd-seg-1", SegmentBackend::kMemfd, host_bytes.size(),
                                       static_cast<uint64_t>(st.st_ino), false, ""}};
  std::vector<StoredSegment> arenas;
  std::vector<NamedFd> fds;
  fds.push_back({"wd-seg-1", std::move(host)});
  for (size_t i = 0; i < model.arenas.size(); ++i) {
    const DeviceArena& a = *model.arenas[i];
    std::string name = absl::StrCat("wd-seg-", 2 + i);
    arenas.push_back({name, SegmentBackend::kEmulated, a.size(), 0, false, a.device().uuid});
    fds.push_back({name, ScopedFd(fcntl(a.export_fd(), F_DUPFD_CLOEXEC, 3))});
  }
  absl::StatusOr<std::string> record = EncodeStateRecord(model, hosts, arenas, key);
  EXPECT_TRUE(record.ok()) << record.status();
  fds.push_back({"wd-rec-1", Sealed(*record)});
  return fds;
}

// A record is checksummed, not authenticated. Before, whoever could hand
// the daemon fds at start could rewrite a record to name a sealed memfd of
// their own (its inode, the right size) and recompute the checksum, and
// restore served those bytes under the genuine hashes and fingerprint.
// Now every host tensor is hashed again from its segment.
TEST_F(Restore, ARecordNamingAnotherMemfdWithOtherBytesIsDroppedAsContentMismatch) {
  std::shared_ptr<ModelGeneration> model = Load("m", 1);
  ASSERT_EQ(model->host_segments.size(), 1u);
  const HostSegment& genuine = *model->host_segments[0];
  std::string bytes(genuine.data(), genuine.size());
  std::string forged = bytes;
  forged[0] ^= 0x5a;  // the first byte of embed.table
  RestoreResult attack = RestoreAll(PassedWithHostBytes(*model, forged, nullptr), backend_.get());
  EXPECT_EQ(attack.models.size(), 0u);
  ASSERT_EQ(attack.dropped.size(), 1u);
  EXPECT_EQ(attack.dropped[0].reason, "content_mismatch");
  EXPECT_TRUE(absl::StartsWith(attack.dropped[0].message, "tensor 'embed.table': its bytes hash to "))
      << attack.dropped[0].message;
  EXPECT_TRUE(absl::StrContains(attack.dropped[0].message,
                                absl::StrCat(", the record says ", ContentHashHex(model->ranks[0].tensors[0].content_hash))))
      << attack.dropped[0].message;
  // The same bytes in another memfd are the verified bytes: restored.
  RestoreResult copy = RestoreAll(PassedWithHostBytes(*model, bytes, nullptr), backend_.get());
  ASSERT_EQ(copy.models.size(), 1u) << (copy.dropped.empty() ? "" : copy.dropped[0].message);
  EXPECT_EQ(HostBytes(*copy.models[0].model), bytes);
}

RecordKey KeyOf(uint8_t fill) {
  std::array<uint8_t, kRecordKeyBytes> bytes;
  bytes.fill(fill);
  return RecordKey::FromBytes(bytes);
}

// A record with a valid HMAC under the daemon's key is restored without a
// second pass over its bytes; one under another key, or none, is hashed.
TEST_F(Restore, AnAuthenticatedRecordSkipsTheHashingAndAnyOtherIsHashed) {
  const RecordKey key = KeyOf(7), other = KeyOf(8);
  std::shared_ptr<ModelGeneration> model = Load("m", 1);
  auto* sink = new FakeSink;
  FdStoreKeeper keeper{std::unique_ptr<FdStoreSink>(sink), &key};
  Store(keeper, model);
  RestoreResult ours = RestoreAll(sink->Passed(), backend_.get(), &key);
  ASSERT_EQ(ours.models.size(), 1u) << (ours.dropped.empty() ? "" : ours.dropped[0].message);
  EXPECT_TRUE(ours.models[0].authenticated);
  EXPECT_EQ(HostBytes(*ours.models[0].model), HostBytes(*model));
  EXPECT_EQ(ours.models[0].model->fingerprint, model->fingerprint);
  for (const RecordKey* k : {&other, static_cast<const RecordKey*>(nullptr)}) {
    RestoreResult hashed = RestoreAll(sink->Passed(), backend_.get(), k);
    ASSERT_EQ(hashed.models.size(), 1u);
    EXPECT_FALSE(hashed.models[0].authenticated);
  }
  // One byte of the body changed, checksum recomputed, HMAC kept: not
  // authenticated, so hashed (and here refused by the fingerprint check).
  std::vector<NamedFd> passed = sink->Passed();
  auto rec = std::find_if(passed.begin(), passed.end(), [](const NamedFd& f) { return f.name == "wd-rec-1"; });
  ASSERT_NE(rec, passed.end());
  std::string record = ReadAll(rec->fd.get());
  uint64_t length = 0;
  for (int i = 0; i < 8; ++i) length |= uint64_t{static_cast<unsigned char>(record[8 + i])} << (8 * i);
  ASSERT_EQ(record.size(), kStateRecordHeaderBytes + length + kRecordMacBytes);
  std::string body = record.substr(kStateRecordHeaderBytes, length);
  size_t at = body.find("\"generation\":1");
  ASSERT_NE(at, std::string::npos);
  body.replace(at, 14, "\"generation\":3");
  uint64_t sum = XXH3_64bits(body.data(), body.size());
  std::string forged = record.substr(0, 16);
  for (int i = 0; i < 8; ++i) forged.push_back(static_cast<char>((sum >> (8 * i)) & 0xff));
  forged += body + record.substr(kStateRecordHeaderBytes + length);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(StateRecord decoded, DecodeStateRecord(forged, &key));
  EXPECT_FALSE(decoded.authenticated);
  EXPECT_EQ(decoded.model->generation, 3u);
  WEIGHTD_ASSERT_OK_AND_ASSIGN(StateRecord genuine, DecodeStateRecord(record, &key));
  EXPECT_TRUE(genuine.authenticated);
}

// What the HMAC vouches for is what was verified at load: a record the key
// signed over other bytes is served as is, which is why only the daemon may
// read the key (server/restart/record_key.h). Without the key the same record is
// hashed and dropped.
TEST_F(Restore, TheKeyIsWhatVouchesForAnAuthenticatedRecordsBytes) {
  const RecordKey key = KeyOf(7);
  std::shared_ptr<ModelGeneration> model = Load("m", 1);
  std::string bytes(model->host_segments[0]->data(), model->host_segments[0]->size());
  bytes[0] ^= 0x5a;
  RestoreResult signed_ = RestoreAll(PassedWithHostBytes(*model, bytes, &key), backend_.get(), &key);
  ASSERT_EQ(signed_.models.size(), 1u);
  EXPECT_TRUE(signed_.models[0].authenticated);
  RestoreResult unsigned_ = RestoreAll(PassedWithHostBytes(*model, bytes, &key), backend_.get(), nullptr);
  ASSERT_EQ(unsigned_.dropped.size(), 1u);
  EXPECT_EQ(unsigned_.dropped[0].reason, "content_mismatch");
}

// Fields a live request would have refused are refused in a record too.
TEST_F(Restore, ARecordWithAControlCharacterLabelOrAnUnresolvedPathIsCorrupt) {
  std::shared_ptr<ModelGeneration> model = Load("m", 1);
  std::vector<StoredSegment> host = {{"wd-seg-1", SegmentBackend::kMemfd, model->host_segments[0]->size(), 1, false, ""}};
  std::vector<StoredSegment> arenas;
  for (const auto& a : model->arenas) arenas.push_back({"wd-seg-x", SegmentBackend::kEmulated, a->size(), 1, false, a->device().uuid});
  model->version_label = "step-1\n2026 WARN forged";
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string labelled, EncodeStateRecord(*model, host, arenas));
  EXPECT_THAT(DecodeStateRecord(labelled),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "record.version_label: version label may hold only printable ASCII characters"));
  model->version_label = "step-1";
  for (const std::string& path : {dir_.path() + "/../../etc", dir_.path() + "/./x", dir_.path() + "//x",
                                  std::string("relative/path"), std::string("")}) {
    model->request.checkpoint_path = path;
    WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string record, EncodeStateRecord(*model, host, arenas));
    EXPECT_THAT(DecodeStateRecord(record),
                StatusIs(absl::StatusCode::kInvalidArgument, "is not a resolved absolute path")) << path;
  }
  model->request.checkpoint_path = dir_.path();
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::string fine, EncodeStateRecord(*model, host, arenas));
  WEIGHTD_EXPECT_OK(DecodeStateRecord(fine).status());
}

// Regression (review): the size check multiplied before comparing, and
// truncated the product to 64 bits, so a crafted record with a valid
// checksum could claim a huge shape over a few bytes.
TEST_F(Restore, ShapesWhoseSizeOverflowsAreRefused) {
  std::shared_ptr<ModelGeneration> model = Load("m", 1);
  std::vector<StoredSegment> host = {{"wd-seg-1", SegmentBackend::kMemfd, model->host_segments[0]->size(), 1, false, ""}};
  std::vector<StoredSegment> arenas;
  for (const auto& a : model->arenas) arenas.push_back({"wd-seg-x", SegmentBackend::kEmulated, a->size(), 1, false, a->device().uuid});
  auto forged = [&](const std::string& tensor, std::vector<uint64_t> shape, uint64_t nbytes) {
    ModelGeneration copy;
    copy.request = model->request;
    copy.generation = 1;
    copy.segments = model->segments;
    copy.ranks = model->ranks;
    copy.files = model->files;
    copy.host_segments = model->host_segments;
    copy.arenas = model->arenas;
    for (TensorRecord& t : copy.ranks[0].tensors) {
      if (t.name == tensor) {
        t.shape = shape;
        t.full_shape = shape;
        t.nbytes = nbytes;
      }
    }
    copy.fingerprint = FingerprintOf(copy.ranks[0].tensors);
    absl::StatusOr<std::string> record = EncodeStateRecord(copy, host, arenas);
    EXPECT_TRUE(record.ok()) << record.status();
    return DecodeStateRecord(*record).status();
  };
  EXPECT_THAT(forged("embed.table", {16, (1ull << 60) + 1}, 16),
              StatusIs(absl::StatusCode::kInvalidArgument, "does not match its dtype and shape"));
  EXPECT_THAT(forged("layer.bias", {1ull << 63, 1ull << 12, 1ull << 48}, 0),
              StatusIs(absl::StatusCode::kInvalidArgument, "shape is too large"));
}

TEST(HostSegmentAdopt, RefusesUnsealedWrongSizeAndWrongPageSize) {
  ScopedFd plain(memfd_create("plain", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  ASSERT_EQ(ftruncate(plain.get(), 4096), 0);
  EXPECT_THAT(HostSegment::Adopt(ScopedFd(dup(plain.get())), 4096, false),
              StatusIs(absl::StatusCode::kFailedPrecondition, "lacks its seals"));
  ASSERT_EQ(fcntl(plain.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL), 0);
  EXPECT_THAT(HostSegment::Adopt(ScopedFd(dup(plain.get())), 8192, false),
              StatusIs(absl::StatusCode::kFailedPrecondition, "is 4096 bytes, the record says 8192"));
  EXPECT_THAT(HostSegment::Adopt(ScopedFd(dup(plain.get())), 4096, true),
              StatusIs(absl::StatusCode::kFailedPrecondition, "the record says 2 MiB"));
  WEIGHTD_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostSegment> adopted, HostSegment::Adopt(ScopedFd(dup(plain.get())), 4096, false));
  EXPECT_TRUE(adopted->sealed());
  EXPECT_EQ(adopted->data()[0], 0);
  ScopedFd pipe_fds[2];
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  pipe_fds[0] = ScopedFd(p[0]);
  pipe_fds[1] = ScopedFd(p[1]);
  EXPECT_THAT(HostSegment::Adopt(std::move(pipe_fds[0]), 0, false),
              StatusIs(absl::StatusCode::kFailedPrecondition, "not a sealable memfd"));
}

}  // namespace
}  // namespace weightd

namespace weightd {
namespace {

// A published layout of `model` rank `rank`: one host tensor and one device
// tensor on the rank's GPU, bytes from `seed`.
std::shared_ptr<Layout> PublishLayout(ModelGeneration& model, DeviceBackend* backend, const std::string& key,
                                      uint32_t rank, char seed) {
  LayoutRequest r;
  r.model = model.request.name;
  r.key = key;
  r.rank = rank;
  r.identity = {{"engine", "test"}};
  r.tensors = {{"fused.qkv", DType::kI8, {4, 3}, {}, Placement::kHost},
               {"w_t", DType::kF32, {2, 2}, {1, 2}, Placement::kDevice}};
  absl::StatusOr<std::vector<DeviceInfo>> devices = backend->Devices();
  EXPECT_TRUE(devices.ok());
  absl::StatusOr<std::unique_ptr<StagedLayout>> staged = StageLayout(r, model.generation, (*devices)[rank], backend, nullptr);
  EXPECT_TRUE(staged.ok()) << staged.status();
  for (const LayoutTensor& t : (*staged)->tensors) {
    char* at = (*staged)->segments[t.record.segment].memory->writable() + t.record.offset;
    for (uint64_t i = 0; i < t.record.nbytes; ++i) at[i] = static_cast<char>(seed + i);
  }
  LayoutCommitAttempt attempt = SealLayout(**staged, {}, false);
  EXPECT_TRUE(attempt.layout.ok()) << attempt.layout.status();
  std::shared_ptr<Layout> layout = *attempt.layout;
  model.layouts->Add(layout);
  return layout;
}

TEST_F(Restore, LayoutsComeBackWithTheirGenerationAndARewriteReplacesTheRecord) {
  auto* sink = new FakeSink;
  FdStoreKeeper keeper{std::unique_ptr<FdStoreSink>(sink)};
  std::shared_ptr<ModelGeneration> model = Load("m", 7);
  Store(keeper, model);
  std::shared_ptr<Layout> layout = PublishLayout(*model, backend_.get(), "eng/int8/tp2", 1, 5);
  keeper.OnLayoutsChanged(model);
  keeper.Flush();
  // The layout's memfd and arena, then the rewritten record, then the old record leaves.
  EXPECT_EQ(sink->Log(), (std::vector<std::string>{"+wd-seg-1", "+wd-seg-2", "+wd-seg-3", "+wd-rec-7", "+wd-seg-4",
                                                   "+wd-seg-5", "+wd-rec-7.1", "-wd-rec-7"}));

  RestoreResult result = RestoreAll(sink->Passed(), backend_.get());
  ASSERT_EQ(result.models.size(), 1u);
  EXPECT_TRUE(result.dropped.empty());
  EXPECT_TRUE(result.unused.empty());
  const RestoredModel& back = result.models[0];
  ASSERT_EQ(back.layouts.size(), 1u);
  EXPECT_EQ(back.layouts[0].segment_names, (std::vector<std::string>{"wd-seg-4", "wd-seg-5"}));
  std::shared_ptr<const Layout> restored = back.model->layouts->Find("eng/int8/tp2", 1);
  ASSERT_NE(restored, nullptr);
  EXPECT_EQ(restored->identity, layout->identity);
  EXPECT_EQ(restored->fingerprint, layout->fingerprint);
  EXPECT_EQ(restored->generation, 7u);
  EXPECT_EQ(restored->gpu_uuid, "GPU-emulated-1");
  ASSERT_EQ(restored->tensors.size(), 2u);
  EXPECT_EQ(restored->tensors[1].strides, (std::vector<uint64_t>{1, 2}));
  EXPECT_EQ(std::string(restored->host_segments[0]->data(), 12), std::string(layout->host_segments[0]->data(), 12));
  std::string device(restored->tensors[1].record.nbytes, '\0');
  ASSERT_TRUE(restored->arenas[0]->CopyToHost(restored->tensors[1].record.offset, device.data(), device.size()).ok());
  EXPECT_EQ(TensorContentHash(device.data(), device.size()), layout->tensors[1].record.content_hash);
  EXPECT_NE(restored->segments[1].fd, -1);

  // Dropping it writes the record again without it.
  model->layouts->Clear();
  keeper.OnLayoutsChanged(model);
  keeper.Flush();
  std::vector<std::string> log = sink->Log();
  EXPECT_EQ(std::vector<std::string>(log.end() - 4, log.end()),
            (std::vector<std::string>{"+wd-rec-7.2", "-wd-rec-7.1", "-wd-seg-4", "-wd-seg-5"}));
}

TEST_F(Restore, ALayoutWhoseFdIsMissingIsDroppedAloneAndTheLaterRecordWins) {
  auto* sink = new FakeSink;
  FdStoreKeeper keeper{std::unique_ptr<FdStoreSink>(sink)};
  std::shared_ptr<ModelGeneration> model = Load("m", 3);
  Store(keeper, model);
  std::vector<NamedFd> before = sink->Passed();  // a crash before the rewrite's old record left
  PublishLayout(*model, backend_.get(), "k", 0, 9);
  keeper.OnLayoutsChanged(model);
  keeper.Flush();
  std::vector<NamedFd> passed = sink->Passed();
  for (NamedFd& f : before) {
    if (f.name == "wd-rec-3") passed.push_back(std::move(f));
  }
  std::erase_if(passed, [](const NamedFd& f) { return f.name == "wd-seg-5"; });  // the layout's arena
  RestoreResult result = RestoreAll(std::move(passed), backend_.get());
  ASSERT_EQ(result.models.size(), 1u);
  EXPECT_EQ(result.models[0].record_name, "wd-rec-3.1");
  ASSERT_EQ(result.dropped.size(), 1u);
  EXPECT_EQ(result.dropped[0].fd_name, "wd-rec-3");
  EXPECT_EQ(result.dropped[0].reason, "duplicate");
  EXPECT_TRUE(result.models[0].layouts.empty());
  EXPECT_TRUE(result.models[0].model->layouts->List().empty());
  EXPECT_EQ(result.unused, (std::vector<std::string>{"wd-rec-3", "wd-seg-4"}));  // the layout's memfd, unused
}

}  // namespace
}  // namespace weightd

namespace weightd {
namespace {

// Regression (review of the layout rewrite): a daemon that restored
// "wd-rec-G.1" numbered its next rewrite ".1" again, stored it, then removed
// that name, and with it the record just stored.
TEST_F(Restore, ARewriteAfterARestartNeverReusesTheAdoptedRecordsName) {
  auto* first_sink = new FakeSink;
  std::vector<NamedFd> passed;
  {
    FdStoreKeeper keeper{std::unique_ptr<FdStoreSink>(first_sink)};
    std::shared_ptr<ModelGeneration> model = Load("m", 7);
    Store(keeper, model);
    PublishLayout(*model, backend_.get(), "a", 0, 1);
    keeper.OnLayoutsChanged(model);
    keeper.Flush();
    passed = first_sink->Passed();
  }
  RestoreResult result = RestoreAll(std::move(passed), backend_.get());
  ASSERT_EQ(result.models.size(), 1u);
  RestoredModel& back = result.models[0];
  ASSERT_EQ(back.record_name, "wd-rec-7.1");
  // The restarted daemon's store holds what it was passed.
  auto* sink = new FakeSink;
  FdStoreKeeper keeper{std::unique_ptr<FdStoreSink>(sink)};
  std::shared_ptr<ModelGeneration> model = std::move(back.model);
  std::vector<std::pair<std::shared_ptr<const Layout>, std::vector<std::string>>> layouts;
  for (auto& l : back.layouts) layouts.emplace_back(l.layout, l.segment_names);
  ASSERT_TRUE(sink->Store(back.record_name, back.record_fd.get()).ok());
  keeper.Adopted(model, back.record_name, std::move(back.record_fd), back.host_segment_names, back.arena_names, layouts);
  PublishLayout(*model, backend_.get(), "b", 1, 2);
  keeper.OnLayoutsChanged(model);
  keeper.Flush();
  std::vector<std::string> log = sink->Log();
  ASSERT_GE(log.size(), 2u);
  EXPECT_EQ(std::vector<std::string>(log.end() - 2, log.end()),
            (std::vector<std::string>{"+wd-rec-7.2", "-wd-rec-7.1"}));
  std::vector<NamedFd> now = sink->Passed();
  EXPECT_EQ(std::count_if(now.begin(), now.end(), [](const NamedFd& f) { return f.name == "wd-rec-7.2"; }), 1);
}

}  // namespace
}  // namespace weightd
